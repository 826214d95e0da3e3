"""Replies to a store client's writes, read from the processor's output.

Every event a client writes is answered by exactly one record: the rollout's new state on
``agl.rollout-state`` (its ``cause_event_id`` is the event) when the fold applied it, or a DLQ
record naming the event's (partition, offset) when it was rejected. The client reads both
topics from their end (manual assignment, no consumer group, so no rebalancing) and resolves
the future registered for the event. Records for rollouts nobody here waits for are skipped
without decoding.

The same stream serves ``wait_for_rollouts``: watchers get every state of their rollouts.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, TopicPartition

from agl_stream.codec import Codec
from agl_stream.config import Settings
from agl_stream.errors import AglError
from agl_stream.logs import get_logger
from agl_stream.models import DlqRecord, RolloutState

log = get_logger("agl.store.replies")


class RejectedError(AglError, ValueError):
    """The processor rejected the event (unknown id, illegal transition, ...); the reason says why.

    A ValueError, as the LightningStore contract asks for missing ids and invalid updates.
    """


@dataclass(frozen=True)
class Reply:
    state: RolloutState
    partition: int
    offset: int  # of the state record on agl.rollout-state: a read fence for what follows


class ReplyReader:
    def __init__(self, settings: Settings, codec: Codec | None = None) -> None:
        self.settings = settings
        self.codec = codec or Codec.default()
        self.state_topic = settings.topic("rollout-state")
        self.dlq_topic = settings.topic("dlq")
        self.rollouts_topic = settings.topic("rollouts")
        self._by_event: dict[str, asyncio.Future[Reply]] = {}
        self._by_position: dict[tuple[int, int], str] = {}  # (partition, offset) on agl.rollouts -> event id
        self._position_of: dict[str, tuple[int, int]] = {}
        self._early_dlq: dict[tuple[int, int], DlqRecord] = {}
        self._waiting_rollouts: dict[bytes, int] = defaultdict(int)  # keys worth decoding
        self._watchers: dict[str, list[Callable[[RolloutState, int, int], None]]] = defaultdict(list)
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None
        # Per partition of agl.rollout-state, the last offset handed to futures and watchers.
        self.dispatched: dict[int, int] = {}

    async def start(self) -> None:
        consumer = AIOKafkaConsumer(
            **self.settings.kafka_client_options(),
            enable_auto_commit=False,
            isolation_level="read_committed",
            # Long polls: the broker answers as soon as a record arrives, so this costs no latency
            # (a short wait only made every idle client poll the broker).
        )
        await consumer.start()
        partitions = []
        for topic in (self.state_topic, self.dlq_topic):
            found = consumer.partitions_for_topic(topic)
            if not found:
                await consumer._client.force_metadata_update()
                found = consumer.partitions_for_topic(topic) or set()
            partitions += [TopicPartition(topic, p) for p in sorted(found)]
        if not partitions:
            await consumer.stop()
            raise AglError(f"topics {self.state_topic} and {self.dlq_topic} do not exist: run `agl-stream up`")
        consumer.assign(partitions)
        await consumer.seek_to_end(*partitions)
        for tp in partitions:  # resolve the end positions now, before any write is sent
            await consumer.position(tp)
        self._consumer = consumer
        self._task = asyncio.create_task(self._run(), name="agl-store-replies")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._consumer is not None:
            await self._consumer.stop()
        for future in self._by_event.values():
            if not future.done():
                future.cancel()

    # -- registration ----------------------------------------------------------------------

    def expect(self, event_id: str, rollout_id: str) -> asyncio.Future[Reply]:
        """Register before sending, so the reply cannot slip past."""
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._by_event[event_id] = future
        self._waiting_rollouts[rollout_id.encode()] += 1
        future.add_done_callback(lambda _: self._release(event_id, rollout_id))
        return future

    def sent(self, event_id: str, partition: int, offset: int) -> None:
        """The event landed at (partition, offset) of agl.rollouts: a DLQ record may name it."""
        position = (partition, offset)
        early = self._early_dlq.pop(position, None)
        future = self._by_event.get(event_id)
        if early is not None and future is not None and not future.done():
            future.set_exception(RejectedError(early.reason))
            return
        if future is not None and not future.done():
            self._by_position[position] = event_id
            self._position_of[event_id] = position

    def _release(self, event_id: str, rollout_id: str) -> None:
        self._by_event.pop(event_id, None)
        position = self._position_of.pop(event_id, None)
        if position is not None:
            self._by_position.pop(position, None)
        key = rollout_id.encode()
        self._waiting_rollouts[key] -= 1
        if self._waiting_rollouts[key] <= 0:
            del self._waiting_rollouts[key]

    def watch(self, rollout_id: str, callback: Callable[[RolloutState, int, int], None]) -> Callable[[], None]:
        """Call ``callback(state, partition, offset)`` for every new state of the rollout."""
        self._watchers[rollout_id].append(callback)
        self._waiting_rollouts[rollout_id.encode()] += 1

        def unwatch() -> None:
            callbacks = self._watchers.get(rollout_id, [])
            if callback in callbacks:
                callbacks.remove(callback)
                self._release("", rollout_id)
            if not callbacks:
                self._watchers.pop(rollout_id, None)

        return unwatch

    # -- the loop --------------------------------------------------------------------------

    async def _run(self) -> None:
        assert self._consumer is not None
        while True:
            try:
                batches = await self._consumer.getmany(timeout_ms=500)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # a broker hiccup must not silence every later reply
                log.warning("reading replies failed; retrying", error=str(error))
                continue
            for tp, messages in batches.items():
                if tp.topic == self.state_topic:
                    for message in messages:
                        if message.value is not None and message.key in self._waiting_rollouts:
                            self._on_state(message.value, tp.partition, message.offset)
                    if messages:
                        self.dispatched[tp.partition] = messages[-1].offset
                else:
                    for message in messages:
                        self._on_dlq(message.value or b"")

    def _on_state(self, value: bytes, partition: int, offset: int) -> None:
        try:
            state = self.codec.decode(value, RolloutState)
        except AglError as error:  # not ours to dead-letter: the sink does that for this topic
            log.warning("undecodable rollout state", partition=partition, offset=offset, error=str(error))
            return
        future = self._by_event.get(state.cause_event_id)
        if future is not None and not future.done():
            future.set_result(Reply(state, partition, offset))
        for callback in list(self._watchers.get(state.rollout.rollout_id, ())):
            callback(state, partition, offset)

    def _on_dlq(self, value: bytes) -> None:
        try:
            record = self.codec.decode(value, DlqRecord)
        except AglError:
            return
        if record.source_topic != self.rollouts_topic:
            return
        position = (record.source_partition, record.source_offset)
        event_id = self._by_position.pop(position, None)
        if event_id is None:
            # The rejection can arrive before our producer's acknowledgement: keep it briefly.
            if len(self._early_dlq) > 10_000:
                self._early_dlq.clear()
            self._early_dlq[position] = record
            return
        future = self._by_event.get(event_id)
        if future is not None and not future.done():
            future.set_exception(RejectedError(record.reason))
