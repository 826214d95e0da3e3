"""The ingress processor: agl.task-requests (external systems) -> RolloutEnqueued on agl.rollouts.

Each request is decoded and validated by the pure rules of agl_stream/ingress.py, its
``resources_id`` is looked up in a local copy of agl.resources (ResourcesCache), and a valid,
new request becomes one ``RolloutEnqueued`` keyed by its derived rollout id
(``ro-`` + SHA-256(request_id)[:12]). Everything else goes to agl.dlq with the reason and the
request's own bytes. Nothing is dropped silently and bad input never stops the loop.

A plain aiokafka consumer-group member (like processors/batcher.py), processing what one poll
returns as a batch: events and DLQ records are sent, *all* acknowledged by the broker, and only
then are the batch's offsets committed. A crash before the commit re-reads the batch and sends
the same events again (same rollout id, same event id); the rollout processor refuses an
enqueue of a rollout it knows ("rollout ... already exists", on agl.dlq). Repeats this process
saw enqueued lately, and repeats of rollouts ClickHouse already holds (asked once per batch,
so a repeat long after the processor forgot the rollout is caught too), are refused here,
before they reach agl.rollouts, as "duplicate request".
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Mapping

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import CommitFailedError, KafkaError
from aiokafka.structs import ConsumerRecord, OffsetAndMetadata

from agl_stream.codec import Codec
from agl_stream.config import Settings
from agl_stream.errors import AglError, CodecError
from agl_stream.ingress import (
    WRITER,
    DuplicateRequestError,
    IngressLimits,
    RecentRequests,
    TaskRequestError,
    TaskRequestTooLargeError,
    UnknownResourcesError,
    check_key,
    decode_request,
    enqueue_event,
    rollout_id_for,
)
from agl_stream.kafka.io import DeadLetters, Rejected, make_consumer, make_producer
from agl_stream.logs import get_logger
from agl_stream.models import TaskRequest
from agl_stream.store.readside import ReadSide, read_side_for
from agl_stream.store.resources_cache import ResourcesCache

log = get_logger("agl.ingress")

PROCESSOR = WRITER
READY_FILE = "ingress.ready"
MAX_EVENT_BYTES = 1_000_000  # as the store client's limit: under the broker's default message size
_POLL_MS = 500
_MAX_POLL_RECORDS = 1000
_KNOWN_TIMEOUT_S = 5.0


def group_id(settings: Settings) -> str:
    return f"{settings.topic_prefix}.{PROCESSOR}"


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, processor: IngressProcessor) -> None:
        self.processor = processor

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        # Waits for the batch in flight: it is sent and committed before the partitions move.
        async with self.processor.lock:
            self.processor.generation += 1

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        async with self.processor.lock:
            self.processor.generation += 1
        self.processor.settings.run_dir.mkdir(parents=True, exist_ok=True)
        (self.processor.settings.run_dir / READY_FILE).write_text(str(os.getpid()))
        log.info("partitions assigned", partitions=sorted(tp.partition for tp in assigned))


class IngressProcessor:
    def __init__(self, settings: Settings, *, codec: Codec | None = None) -> None:
        self.settings = settings
        self.codec = codec or Codec.default()
        self.limits = IngressLimits.of(settings)
        self.source = settings.topic("task-requests")
        self.output = settings.topic("rollouts")
        self.recent = RecentRequests()
        # Held from processing a fetch to committing it; `generation` changes on every
        # rebalance, so records fetched before one are dropped (positions were reset to the
        # committed offsets) rather than sent and committed for partitions that moved.
        self.lock = asyncio.Lock()
        self.generation = 0
        self.enqueued = 0
        self.rejected = 0
        self._stopping = asyncio.Event()
        self._producer: AIOKafkaProducer | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._resources: ResourcesCache | None = None
        self._reads: ReadSide | None = None
        self.unchecked = 0  # requests enqueued while ClickHouse could not be asked (see _known)

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        settings = self.settings
        producer = self._producer = make_producer(settings)
        consumer = self._consumer = make_consumer(
            settings,
            group_id=group_id(settings),
            max_poll_records=_MAX_POLL_RECORDS,
            # An ingress killed with -9 holds its partitions until its session expires.
            session_timeout_ms=6000,
            heartbeat_interval_ms=1500,
        )
        resources = self._resources = ResourcesCache(settings, self.codec)
        await producer.start()
        try:
            await resources.start()
            dead_letters = DeadLetters(settings, producer, processor=PROCESSOR, codec=self.codec)
            consumer.subscribe([self.source], listener=_Rebalance(self))
            await consumer.start()
            log.info("ingress started", source=self.source, output=self.output, group=group_id(settings))
            try:
                while not self._stopping.is_set():
                    generation = self.generation
                    fetched = await consumer.getmany(timeout_ms=_POLL_MS, max_records=_MAX_POLL_RECORDS)
                    if fetched:
                        async with self.lock:
                            if generation == self.generation:
                                await self._process(fetched, dead_letters)
            finally:
                await consumer.stop()
                await resources.stop()
                if self._reads is not None:
                    await self._reads.aclose()
        finally:
            await producer.stop()
        log.info("ingress stopped", enqueued=self.enqueued, rejected=self.rejected, unchecked=self.unchecked)

    async def _process(
        self, fetched: Mapping[TopicPartition, list[ConsumerRecord[bytes, bytes]]], dead_letters: DeadLetters
    ) -> None:
        """Turn one poll's records into events and DLQ records, send all, then commit."""
        delay = 0.5
        while True:
            try:
                events, rejected = await self._decide(fetched)
                await self._send(events, rejected, dead_letters)
                break
            except (KafkaError, TimeoutError) as exc:
                if self._stopping.is_set():
                    return  # uncommitted: the next owner (or restart) reads the batch again
                # Re-deciding and resending is harmless: same events, and the DLQ is at-least-once.
                log.warning("ingress batch failed, retrying", error=f"{type(exc).__name__}: {exc}"[:300])
                await asyncio.sleep(delay)  # backoff between retries, not synchronisation
                delay = min(delay * 2, 30.0)
        for request_id in (request_id for request_id, _, _ in events):
            self.recent.add(request_id)
        self.enqueued += len(events)
        self.rejected += len(rejected)
        await self._commit({tp: messages[-1].offset + 1 for tp, messages in fetched.items() if messages})

    async def _decide(
        self, fetched: Mapping[TopicPartition, list[ConsumerRecord[bytes, bytes]]]
    ) -> tuple[list[tuple[str, str, bytes]], list[Rejected]]:
        """(request id, rollout id, encoded event) per new valid request; the rest rejected."""
        assert self._resources is not None
        rejected: list[Rejected] = []
        valid: list[tuple[ConsumerRecord[bytes, bytes], TaskRequest]] = []
        for messages in fetched.values():
            for message in messages:
                try:
                    request = decode_request(self.codec, message.value or b"", self.limits)
                    check_key(message.key, request)
                except (CodecError, TaskRequestError) as invalid:
                    rejected.append(Rejected.of(message, invalid))
                    continue
                valid.append((message, request))
        cache = self._resources
        if any(r.resources_id is not None and r.resources_id not in cache.by_id for _, r in valid):
            await cache.catch_up()  # once per batch: snapshots written before the request are found
        # Beyond this process's memory: rollouts ClickHouse already holds were enqueued by an
        # earlier copy, even one the rollout processor has long forgotten.
        known = await self._known([rollout_id_for(r.request_id) for _, r in valid if r.request_id not in self.recent])
        now = time.time()
        events: list[tuple[str, str, bytes]] = []
        in_batch: set[str] = set()
        for message, request in valid:
            request_id = request.request_id
            rollout_id = rollout_id_for(request_id)
            error: TaskRequestError | None = None
            if request.resources_id is not None and request.resources_id not in cache.by_id:
                error = UnknownResourcesError(
                    f"resources_id {request.resources_id!r} names no snapshot on {cache.topic}; "
                    "publish the resources first, or send null for the latest"
                )
            elif request_id in in_batch or request_id in self.recent or rollout_id in known:
                error = DuplicateRequestError(
                    f"duplicate request: request_id {request_id!r} was already enqueued as rollout {rollout_id}; "
                    "this copy changed nothing"
                )
            else:
                data = self.codec.encode(enqueue_event(request, now))
                if len(data) > MAX_EVENT_BYTES:
                    error = TaskRequestTooLargeError(
                        f"the rollout event would be {len(data):,} bytes, over the {MAX_EVENT_BYTES:,}-byte limit "
                        "of agl.rollouts: send less input or metadata"
                    )
                else:
                    events.append((request_id, rollout_id, data))
                    in_batch.add(request_id)
            if error is not None:
                rejected.append(Rejected.of(message, error))
        return events, rejected

    async def _known(self, rollout_ids: list[str]) -> set[str]:
        """Which of these rollouts the read side already holds (one query per batch).

        When it cannot be asked (the gateway not up yet, or down), the batch goes on: the rollout
        processor still refuses a rollout it knows (live, or finished less than its retention
        ago), and only a repeat older than that could enqueue again; counted in ``unchecked``.
        """
        if not rollout_ids:
            return set()
        try:
            if self._reads is None:
                self._reads = read_side_for(self.settings)
            result = await self._reads.query(
                f"SELECT rollout_id FROM {self.settings.clickhouse_database}.rollouts "
                "WHERE rollout_id IN {ids:Array(String)}",
                {"ids": rollout_ids},
                timeout=_KNOWN_TIMEOUT_S,
            )
        except (AglError, OSError) as error:
            self.unchecked += len(rollout_ids)
            self._reads = None  # the gateway may come back elsewhere (a new port): look it up again
            log.warning(
                "could not ask ClickHouse for known rollouts", error=str(error)[:300], requests=len(rollout_ids)
            )
            return set()
        return {str(row[0]) for row in result.rows}

    async def _send(
        self, events: list[tuple[str, str, bytes]], rejected: list[Rejected], dead_letters: DeadLetters
    ) -> None:
        assert self._producer is not None
        futures = [
            await self._producer.send(self.output, data, key=rollout_id.encode()) for _, rollout_id, data in events
        ]
        if rejected:
            await dead_letters.send_many(rejected)
        for future in futures:
            await future

    async def _commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        assert self._consumer is not None
        if not offsets:
            return
        try:
            await self._consumer.commit({tp: OffsetAndMetadata(o, "") for tp, o in offsets.items()})
        except CommitFailedError as exc:
            # A rebalance is under way: the next owner re-reads from the last commit, and the
            # rollout processor refuses the re-sent enqueues of rollouts it already has.
            log.warning("commit failed during a rebalance", error=str(exc)[:200])


async def run_ingress(settings: Settings) -> None:
    processor = IngressProcessor(settings)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, processor.stop)
    await processor.run()


def main(settings: Settings) -> None:
    """Run the ingress processor in the foreground until SIGTERM/SIGINT (``agl-stream ingress``)."""
    asyncio.run(run_ingress(settings))
