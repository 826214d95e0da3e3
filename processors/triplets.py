"""The triplet builder: when an attempt finishes, turn all of its spans into one TripletRecord.

A consumer-group member over two co-partitioned topics, ``agl.spans`` and ``agl.rollout-state``
(both keyed by rollout id, so one member sees every span and every state of a rollout). The
pure :class:`~agl_stream.trace_collector.TraceCollector` holds each attempt's spans until the
attempt finished and the span count its writers reported has arrived (or it settled); then the
pure adapter (:mod:`agl_stream.adapter`) extracts the triplets and the record goes to
``agl.triplets`` (keyed by group id, so a GRPO group meets in one batcher partition) with the
resources snapshot the attempt ran with and its policy version.

Nothing is lost when the process dies: each input partition is committed only up to its
lowest *pending* offset (a span or state whose attempt has not been emitted yet), after the
records of the emitted attempts were acknowledged. A restart or a new owner reads every
pending record again; an attempt emitted just before a crash may be emitted again, with the
same rollout and attempt ids (the batcher drops the repeat). This is a plain aiokafka member,
not a faust agent, for that reason: faust commits past the first unacknowledged offset of a
partition when later ones are acknowledged (the batcher's notes say more).

A record of agl.spans is one span or an agl.SpanBatch (a writer's flush of one attempt's
spans, :mod:`agl_stream.span_records`); a batch stays pending until every attempt it holds
spans of was emitted.

Undecodable records go to ``agl.dlq`` (acknowledged before their offset is committed); spans of
attempts that never finish are evicted after a bound (counted, logged), so memory and the
uncommitted range stay bounded.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from aiokafka import ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import CommitFailedError, KafkaError
from aiokafka.structs import OffsetAndMetadata

from agl_stream.adapter import AdapterConfig
from agl_stream.codec import Codec
from agl_stream.config import Settings
from agl_stream.errors import CodecError
from agl_stream.kafka.io import DeadLetters, Rejected, make_consumer, make_producer
from agl_stream.logs import get_logger
from agl_stream.models import RolloutState, TripletRecord
from agl_stream.span_records import spans_of
from agl_stream.store.resources_cache import ResourcesCache
from agl_stream.trace_collector import (
    EvictedAttempt,
    ReadyAttempt,
    TraceCollector,
    resources_id_of,
    spans_by_attempt,
    triplet_record,
)

log = get_logger("agl.triplets")

PROCESSOR = "processor.triplets"
READY_FILE = "triplets.ready"
_POLL_MS = 200
_COMMIT_EVERY_S = 0.5

Token = tuple[TopicPartition, int]


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, builder: TripletBuilder) -> None:
        self.builder = builder

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        await self.builder.commit(force=True)
        # Eager rebalancing: every partition is re-assigned and read again from its commit
        # point, so what this member holds in memory is dropped, not handed over.
        self.builder.reset()

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        self.builder.settings.run_dir.mkdir(parents=True, exist_ok=True)
        (self.builder.settings.run_dir / READY_FILE).write_text(str(os.getpid()))
        log.info("triplet builder assigned", partitions=sorted(f"{tp.topic}:{tp.partition}" for tp in assigned))


class TripletBuilder:
    def __init__(
        self,
        settings: Settings,
        *,
        adapter: AdapterConfig | None = None,
        settle_s: float = 5.0,
        max_wait_s: float = 600.0,
        max_spans: int = 200_000,
    ) -> None:
        self.settings = settings
        self.adapter = adapter or AdapterConfig()
        self.settle_s, self.max_wait_s, self.max_spans = settle_s, max_wait_s, max_spans
        self.codec = Codec.default()
        self.spans_topic = settings.topic("spans")
        self.states_topic = settings.topic("rollout-state")
        self.collector: TraceCollector[Token] = self._new_collector()
        # Per partition, offset -> how many attempts still hold that record (a span batch of
        # several attempts is done when the last of them is emitted; everything else holds 1).
        self.pending: dict[TopicPartition, dict[int, int]] = defaultdict(dict)
        self.emitted = 0
        self._last_commit = 0.0
        self._committed: dict[TopicPartition, int] = {}
        self.consumer: Any = None

    def _new_collector(self) -> TraceCollector[Token]:
        return TraceCollector(settle_s=self.settle_s, max_wait_s=self.max_wait_s, max_spans=self.max_spans)

    def reset(self) -> None:
        self.collector = self._new_collector()
        self.pending.clear()
        self._committed.clear()

    # -- the loop -------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        producer = make_producer(self.settings)
        consumer = make_consumer(
            self.settings, group_id=f"{self.settings.topic_prefix}.{PROCESSOR}", max_poll_records=5000
        )
        self.consumer = consumer
        resources = ResourcesCache(self.settings, self.codec)
        await producer.start()
        try:
            await resources.start()
            dead_letters = DeadLetters(self.settings, producer, PROCESSOR, self.codec)
            consumer.subscribe([self.spans_topic, self.states_topic], listener=_Rebalance(self))
            await consumer.start()
            last_tick = 0.0
            while not stop.is_set():
                fetched = await consumer.getmany(timeout_ms=_POLL_MS, max_records=5000)
                now = time.monotonic()
                ready: list[ReadyAttempt[Token]] = []
                rejected: list[tuple[Token, Rejected]] = []
                done: list[Token] = []
                for tp, messages in fetched.items():
                    for message in messages:
                        token = (tp, message.offset)
                        got, at_once = self._take(tp, message, token, now, rejected)
                        ready += got
                        done += at_once
                if rejected:  # durable in the DLQ before their offsets can be committed
                    await dead_letters.send_many([r for _, r in rejected])
                    done += [token for token, _ in rejected]
                if now - last_tick >= min(1.0, max(0.1, self.settle_s / 5)):
                    last_tick = now
                    settled, evicted = self.collector.tick(now)
                    ready += settled
                    done += self._evicted(evicted)
                await self._emit(producer, resources, ready)
                for attempt in ready:
                    done += attempt.tokens
                self._done(done)
                await self.commit()
            await self.commit(force=True)
        finally:
            await consumer.stop()
            await resources.stop()
            await producer.stop()
        log.info("triplet builder stopped", emitted=self.emitted, **vars(self.collector.stats))

    def _take(
        self, tp: TopicPartition, message: Any, token: Token, now: float, rejected: list[tuple[Token, Rejected]]
    ) -> tuple[list[ReadyAttempt[Token]], list[Token]]:
        self.pending[tp][message.offset] = 1
        if message.value is None:  # a tombstone on the state topic: a forgotten rollout
            return [], [token]
        try:
            if tp.topic == self.spans_topic:  # an agl.Span or an agl.SpanBatch
                groups = spans_by_attempt(spans_of(self.codec, message.value))
            else:
                return self.collector.add_state(self.codec.decode(message.value, RolloutState), token, now)
        except CodecError as error:
            rejected.append((token, Rejected.of(message, error)))
            return [], []
        if not groups:  # an empty batch
            return [], [token]
        self.pending[tp][message.offset] = len(groups)
        ready: list[ReadyAttempt[Token]] = []
        done: list[Token] = []
        for group in groups:
            got, at_once = self.collector.add_spans(group, token, now)
            ready += got
            done += at_once
        return ready, done

    def _evicted(self, evicted: Iterable[EvictedAttempt[Token]]) -> list[Token]:
        tokens: list[Token] = []
        for attempt in evicted:
            log.warning(
                "spans of an unfinished attempt evicted",
                rollout=attempt.rollout_id,
                attempt=attempt.attempt_id,
                spans=attempt.spans,
                reason=attempt.reason,
            )
            tokens += attempt.tokens
        return tokens

    async def _emit(self, producer: Any, resources: ResourcesCache, ready: list[ReadyAttempt[Token]]) -> None:
        sends = []
        for attempt in ready:
            record = await self._record(resources, attempt)
            sends.append(
                await producer.send(
                    self.settings.topic("triplets"), self.codec.encode(record), key=record.group_id.encode()
                )
            )
        await asyncio.gather(*sends)  # acknowledged before the inputs count as done
        self.emitted += len(ready)

    async def _record(self, resources: ResourcesCache, ready: ReadyAttempt[Token]) -> TripletRecord:
        resources_id = resources_id_of(ready.finished)
        snapshot = await resources.get(resources_id) if resources_id else None
        record, result = triplet_record(ready.finished, ready.spans, self.adapter, snapshot)
        if result.issues or not ready.complete:
            log.info(
                "attempt's trace had issues",
                rollout=record.rollout_id,
                attempt=record.attempt_id,
                complete=ready.complete,
                spans=len(ready.spans),
                expected=ready.finished.expected_spans,
                issues=result.issues[:5],
            )
        return record

    def _done(self, tokens: Iterable[Token]) -> None:
        for tp, offset in tokens:
            held = self.pending[tp]
            left = held.get(offset, 0) - 1
            if left > 0:
                held[offset] = left
            else:
                held.pop(offset, None)

    async def commit(self, *, force: bool = False) -> None:
        """Commit each partition up to its lowest pending offset (or all it read)."""
        consumer = self.consumer
        if consumer is None or (not force and time.monotonic() - self._last_commit < _COMMIT_EVERY_S):
            return
        self._last_commit = time.monotonic()
        offsets: dict[TopicPartition, OffsetAndMetadata] = {}
        for tp in consumer.assignment():
            held = self.pending.get(tp)
            position = min(held) if held else await consumer.position(tp)
            if self._committed.get(tp) != position:
                offsets[tp] = OffsetAndMetadata(position, "")
        if not offsets:
            return
        try:
            await consumer.commit(offsets)
            self._committed.update({tp: o.offset for tp, o in offsets.items()})
        except (CommitFailedError, KafkaError) as error:  # a rebalance: the next owner re-reads
            log.warning("commit failed; pending records will be read again", error=str(error))


def main(
    settings: Settings,
    *,
    adapter: AdapterConfig | None = None,
    settle_s: float = 5.0,
    max_wait_s: float = 600.0,
    max_spans: int = 200_000,
) -> None:
    """Run the triplet builder in the foreground until SIGTERM/SIGINT."""

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        builder = TripletBuilder(
            settings, adapter=adapter, settle_s=settle_s, max_wait_s=max_wait_s, max_spans=max_spans
        )
        await builder.run(stop)

    asyncio.run(run())
