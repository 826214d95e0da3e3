"""The ingress processor: agl.task-requests (external systems) -> RolloutEnqueued on agl.rollouts.

Each request is decoded and validated by the pure rules of agl_stream/domain/ingress.py, its
``resources_id`` is looked up in a local copy of agl.resources (ResourcesCache), and a valid,
new request becomes one ``RolloutEnqueued`` keyed by its derived rollout id
(``ro-`` + SHA-256(request_id)[:32 hex]). Invalid requests, and requests whose rollout holds a
different request (a reused request id with another input, a collision of rollout ids:
``RequestConflictError``), go to agl.dlq with the reason and the request's own bytes. A copy of
a request already enqueued is an answer, not a dead letter: it is counted
(``agl_ingress_requests_total{outcome="already_enqueued"}``, ``already_enqueued``) and logged
per batch, and changes nothing. Nothing is dropped silently and bad input never stops the loop.

A handler of the processor skeleton (agl_stream/kafka/processor.py), processing what one poll
returns as a batch: events and DLQ records are sent, *all* acknowledged by the broker, and only
then are the batch's offsets committed (coalesced by the skeleton). A crash before the commit
re-reads the batch and sends the same events again (same rollout id, same event id); the
rollout processor refuses an enqueue of a rollout it knows ("rollout ... already exists", on
agl.dlq). What a rollout holds is known from this process's memory of what it enqueued lately
(request id and input) and, for older rollouts, from ClickHouse (the input, asked once per
batch, under the derived id and under the legacy 12-hex id of rollouts enqueued before
128-bit ids), so a copy long after the processor forgot the rollout is answered too.
"""

from __future__ import annotations

import asyncio
import time

from aiokafka import ConsumerRecord, TopicPartition

from agl_stream import metrics
from agl_stream.config import Settings
from agl_stream.domain.ingress import (
    WRITER,
    AlreadyEnqueued,
    HeldRequest,
    IngressLimits,
    RecentRequests,
    TaskRequestError,
    TaskRequestTooLargeError,
    UnknownResourcesError,
    check_key,
    classify,
    decode_request,
    enqueue_event,
    held_from_rows,
    rollout_id_for,
    stored_for,
    stored_rollouts_query,
)
from agl_stream.errors import AglError, CodecError
from agl_stream.kafka.io import Outbox, Record, Rejected
from agl_stream.kafka.processor import Batch, run_processor
from agl_stream.local.processes import run_until_stopped
from agl_stream.logs import describe, get_logger
from agl_stream.models import TaskRequest
from agl_stream.store.readside import ReadSide, read_side_for
from agl_stream.store.resources_cache import ResourcesCache
from agl_stream.wire.avro_primitives import MAX_RECORD_BYTES

log = get_logger("agl.ingress")

PROCESSOR = WRITER
_POLL_S = 0.5
_MAX_POLL_RECORDS = 1000
_KNOWN_TIMEOUT_S = 5.0


def group_id(settings: Settings) -> str:
    return f"{settings.topic_prefix}.{PROCESSOR}"


class IngressProcessor:
    """The handler the processor skeleton (agl_stream.kafka.processor) runs; one task calls it."""

    def __init__(self, settings: Settings, outbox: Outbox) -> None:
        self.settings = settings
        self.codec = outbox.codec
        self.limits = IngressLimits.of(settings)
        self.source = settings.topic("task-requests")
        self.output = settings.topic("rollouts")
        self.recent = RecentRequests()
        self.enqueued = 0
        self.rejected = 0
        self.already_enqueued = 0
        self.outbox = outbox
        self._resources = ResourcesCache(settings, self.codec)
        self._reads: ReadSide | None = None
        self.unchecked = 0  # requests enqueued while ClickHouse could not be asked (see _known)

    async def assigned(self, partitions: set[TopicPartition]) -> None:
        pass  # nothing kept per partition: copies are recognized by rollout id wherever they land

    def revoked(self, partitions: set[TopicPartition]) -> None:
        pass

    def poll_timeout(self) -> float:
        return _POLL_S

    async def tick(self) -> None:
        pass

    async def handle(self, batch: Batch) -> None:
        """Turn one poll's records into events and DLQ records and send them all (the skeleton
        commits after; a broker error re-runs the batch: same events, DLQ at-least-once)."""
        events, rejected, copies = await self._decide(batch)
        await self._send(events, rejected)
        for held, _ in events:
            self.recent.add(held)
        self.enqueued += len(events)
        self.rejected += len(rejected)
        self.already_enqueued += len(copies)
        outcomes = {"enqueued": len(events), "already_enqueued": len(copies), "refused": len(rejected)}
        for outcome, count in outcomes.items():
            if count:
                metrics.INGRESS_REQUESTS.labels(metrics.role(), outcome).inc(count)
        if copies:
            log.info(
                "already enqueued: copies answered, nothing sent",
                copies=len(copies),
                first=str(copies[0]),
            )

    async def _decide(
        self, fetched: Batch
    ) -> tuple[list[tuple[HeldRequest, bytes]], list[Rejected], list[AlreadyEnqueued]]:
        """(what the new rollout holds, encoded event) per new valid request; the rejected ones;
        the copies of requests already enqueued."""
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
        unknown = [r.request_id for _, r in valid if rollout_id_for(r.request_id) not in self.recent]
        stored = await self._stored(unknown)
        now = time.time()
        events: list[tuple[HeldRequest, bytes]] = []
        copies: list[AlreadyEnqueued] = []
        in_batch: dict[str, HeldRequest] = {}
        for message, request in valid:
            request_id = request.request_id
            rollout_id = rollout_id_for(request_id)
            held = in_batch.get(rollout_id) or self.recent.held(rollout_id) or stored_for(stored, request_id)
            try:
                answer = classify(request, held)
                if answer is not None:
                    copies.append(answer)
                    continue
                data = self._event(request, now)
            except TaskRequestError as refused:
                rejected.append(Rejected.of(message, refused))
                continue
            new = HeldRequest.of(request)
            events.append((new, data))
            in_batch[rollout_id] = new
        return events, rejected, copies

    def _event(self, request: TaskRequest, now: float) -> bytes:
        """The encoded enqueue event of a new request, or why it cannot be one."""
        cache = self._resources
        if request.resources_id is not None and request.resources_id not in cache.by_id:
            raise UnknownResourcesError(
                f"resources_id {request.resources_id!r} names no snapshot on {cache.topic}; "
                "publish the resources first, or send null for the latest"
            )
        data = self.codec.encode(enqueue_event(request, now))
        if len(data) > MAX_RECORD_BYTES:
            raise TaskRequestTooLargeError(
                f"the rollout event would be {len(data):,} bytes, over the {MAX_RECORD_BYTES:,}-byte limit "
                "of agl.rollouts: send less input or metadata"
            )
        return data

    async def _stored(self, request_ids: list[str]) -> dict[str, HeldRequest]:
        """What ClickHouse says the rollouts of these requests hold (one query per batch; see
        agl_stream.domain.ingress.stored_rollouts_query), by rollout id.

        When it cannot be asked (the gateway not up yet, or down), the batch goes on: the rollout
        processor still refuses a rollout it knows (live, or finished less than its retention
        ago), and only a repeat older than that could enqueue again; counted in ``unchecked``.
        """
        if not request_ids:
            return {}
        sql, parameters = stored_rollouts_query(self.settings.clickhouse_database, request_ids)
        try:
            if self._reads is None:
                self._reads = read_side_for(self.settings)
            result = await self._reads.query(sql, parameters, timeout=_KNOWN_TIMEOUT_S)
        except (AglError, OSError) as error:
            self.unchecked += len(request_ids)
            self._reads = None  # the gateway may come back elsewhere (a new port): look it up again
            log.warning(
                "could not ask ClickHouse for known rollouts", error=describe(error)[:300], requests=len(request_ids)
            )
            return {}
        return held_from_rows(result.rows)

    async def _send(self, events: list[tuple[HeldRequest, bytes]], rejected: list[Rejected]) -> None:
        await self.outbox.reject(rejected)
        await self.outbox.send_all(Record(self.output, held.rollout_id.encode(), data) for held, data in events)


async def run_ingress(settings: Settings, stop: asyncio.Event) -> None:
    async with Outbox.started(settings, PROCESSOR) as outbox:
        processor = IngressProcessor(settings, outbox)
        try:
            await processor._resources.start()
            log.info("ingress started", source=processor.source, output=processor.output, group=group_id(settings))
            await run_processor(
                settings,
                processor,
                name=PROCESSOR,
                topics=[processor.source],
                stop=stop,
                ready_as="ingress",
                max_records=_MAX_POLL_RECORDS,
            )
        finally:
            await processor._resources.stop()
            if processor._reads is not None:
                await processor._reads.aclose()
    log.info(
        "ingress stopped",
        enqueued=processor.enqueued,
        already_enqueued=processor.already_enqueued,
        rejected=processor.rejected,
        unchecked=processor.unchecked,
    )


def main(settings: Settings) -> None:
    """Run the ingress processor in the foreground until SIGTERM/SIGINT (``agl-stream ingress``)."""
    run_until_stopped(lambda stop: run_ingress(settings, stop))
