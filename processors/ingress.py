"""The ingress processor: agl.task-requests (external systems) -> RolloutEnqueued on agl.rollouts.

Each request is decoded and validated by the pure rules of agl_stream/domain/ingress.py, its
``resources_id`` is looked up in a local copy of agl.resources (ResourcesCache), and a valid,
new request becomes one ``RolloutEnqueued`` keyed by its derived rollout id
(``ro-`` + SHA-256(request_id)[:12]). Everything else goes to agl.dlq with the reason and the
request's own bytes. Nothing is dropped silently and bad input never stops the loop.

A handler of the processor skeleton (agl_stream/kafka/processor.py), processing what one poll
returns as a batch: events and DLQ records are sent, *all* acknowledged by the broker, and only
then are the batch's offsets committed (coalesced by the skeleton). A crash before the commit
re-reads the batch and sends the same events again (same rollout id, same event id); the
rollout processor refuses an
enqueue of a rollout it knows ("rollout ... already exists", on agl.dlq). Repeats this process
saw enqueued lately, and repeats of rollouts ClickHouse already holds (asked once per batch,
so a repeat long after the processor forgot the rollout is caught too), are refused here,
before they reach agl.rollouts, as "duplicate request".
"""

from __future__ import annotations

import asyncio
import signal
import time

from aiokafka import AIOKafkaProducer, ConsumerRecord, TopicPartition

from agl_stream import metrics
from agl_stream.codec import Codec
from agl_stream.config import Settings
from agl_stream.domain.ingress import (
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
from agl_stream.errors import AglError, CodecError
from agl_stream.kafka.io import DeadLetters, Rejected, make_producer
from agl_stream.kafka.processor import Batch, run_processor
from agl_stream.logs import get_logger
from agl_stream.models import TaskRequest
from agl_stream.store.readside import ReadSide, read_side_for
from agl_stream.store.resources_cache import ResourcesCache

log = get_logger("agl.ingress")

PROCESSOR = WRITER
READY_FILE = "ingress.ready"
MAX_EVENT_BYTES = 1_000_000  # as the store client's limit: under the broker's default message size
_POLL_S = 0.5
_MAX_POLL_RECORDS = 1000
_KNOWN_TIMEOUT_S = 5.0


def group_id(settings: Settings) -> str:
    return f"{settings.topic_prefix}.{PROCESSOR}"


class IngressProcessor:
    """The handler the processor skeleton (agl_stream.kafka.processor) runs; one task calls it."""

    def __init__(self, settings: Settings, producer: AIOKafkaProducer, *, codec: Codec | None = None) -> None:
        self.settings = settings
        self.codec = codec or Codec.default()
        self.limits = IngressLimits.of(settings)
        self.source = settings.topic("task-requests")
        self.output = settings.topic("rollouts")
        self.recent = RecentRequests()
        self.enqueued = 0
        self.rejected = 0
        self._producer = producer
        self._dead_letters = DeadLetters(settings, producer, processor=PROCESSOR, codec=self.codec)
        self._resources = ResourcesCache(settings, self.codec)
        self._reads: ReadSide | None = None
        self.unchecked = 0  # requests enqueued while ClickHouse could not be asked (see _known)

    async def assigned(self, partitions: set[TopicPartition]) -> None:
        pass  # nothing kept per partition: repeats are refused by request id wherever they land

    def revoked(self, partitions: set[TopicPartition]) -> None:
        pass

    def poll_timeout(self) -> float:
        return _POLL_S

    async def tick(self) -> None:
        pass

    async def handle(self, batch: Batch) -> None:
        """Turn one poll's records into events and DLQ records and send them all (the skeleton
        commits after; a broker error re-runs the batch: same events, DLQ at-least-once)."""
        events, rejected = await self._decide(batch)
        await self._send(events, rejected)
        for request_id, _, _ in events:
            self.recent.add(request_id)
        self.enqueued += len(events)
        self.rejected += len(rejected)

    async def _decide(self, fetched: Batch) -> tuple[list[tuple[str, str, bytes]], list[Rejected]]:
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

    async def _send(self, events: list[tuple[str, str, bytes]], rejected: list[Rejected]) -> None:
        futures = [
            await self._producer.send(self.output, data, key=rollout_id.encode()) for _, rollout_id, data in events
        ]
        if rejected:
            await self._dead_letters.send_many(rejected)
        for future in futures:
            await future
        metrics.count_out(self.output, len(futures))


async def run_ingress(settings: Settings, stop: asyncio.Event | None = None) -> None:
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    producer = make_producer(settings)
    await producer.start()
    processor = IngressProcessor(settings, producer)
    try:
        await processor._resources.start()
        log.info("ingress started", source=processor.source, output=processor.output, group=group_id(settings))
        await run_processor(
            settings,
            processor,
            name=PROCESSOR,
            topics=[processor.source],
            stop=stop,
            ready_file=READY_FILE,
            max_records=_MAX_POLL_RECORDS,
        )
    finally:
        await processor._resources.stop()
        if processor._reads is not None:
            await processor._reads.aclose()
        await producer.stop()
    log.info("ingress stopped", enqueued=processor.enqueued, rejected=processor.rejected, unchecked=processor.unchecked)


def main(settings: Settings) -> None:
    """Run the ingress processor in the foreground until SIGTERM/SIGINT (``agl-stream ingress``)."""
    asyncio.run(run_ingress(settings))
