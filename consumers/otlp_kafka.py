"""OTLP traces from Kafka: what the OpenTelemetry Collector's Kafka exporter writes -> agl.spans.

The collector's Kafka exporter (``exporters: kafka``) writes traces to the topic ``otlp_spans``
by default, encoded ``otlp_proto``: each message value is a protobuf ``TracesData``, which is
wire-identical to ``ExportTraceServiceRequest`` (field 1, repeated ResourceSpans), with any
number of resource spans; ``otlp_json`` is its OTLP JSON form. The key is empty unless
``partition_traces_by_id`` (the trace id) or ``message_key_from_metadata_key`` is set, and
headers carry only what ``include_metadata_keys``/``record_headers`` add: none of it is read.
Spans belong to the attempt named by ``agentlightning.rollout_id``/``attempt_id`` (resource or
span attributes), exactly as for the gateway's ``POST /v1/traces``; decoding is
agl_stream/wire/otlp.py and numbering and writing agl_stream/trace_ingest.py, shared with it.

A handler on the processor skeleton (``agl_stream.kafka.processor``; group ``agl-otlp-kafka``
by default; the topic is the collector's, so it is not prefixed). Per poll batch: decode every
message off the event loop, reserve sequence ids once per attempt for the whole batch, write the accepted spans with one
``add_many_spans``, send one agl.dlq record per message that had anything refused (the original
bytes, the reason with counts: malformed protobuf, too large, no rollout/attempt attributes,
an attempt the store refused; the message's other spans are stored), and commit the batch's
offsets only after the spans and the DLQ records are acknowledged. A store or broker failure
makes the skeleton handle the batch again with backoff; nothing about the input stops it.

Concurrency model: the skeleton's one loop task calls every method here, rebalances under the
loop's lock; nothing here is shared.

Duplicates. Sequence ids are reserved, so a message processed twice would be stored twice
under new ids. Messages that may have been processed before (on assignment, every offset from
the committed one to the partition's end; after a failed batch, that batch) are checked first:
behind a fence at the end of agl.spans, spans of theirs already in ``otel_traces`` (same
rollout, attempt, trace id and span id) are skipped. So a restart after kill -9, a rebalance or
a retried batch stores each span once; what is not covered is a collector that sends the same
span twice in two messages (its own retries), and a crash between a batch's spans and their
heartbeat (the spans are then skipped on re-read and the attempt's span count stays short,
which the triplet builder tolerates after its settle time).
"""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError

from agl_stream.config import Settings
from agl_stream.errors import AglError
from agl_stream.kafka.io import Outbox, Rejected
from agl_stream.kafka.offsets import fence_at_end
from agl_stream.kafka.processor import Batch, run_processor
from agl_stream.local.processes import stop_on_signals
from agl_stream.logs import get_logger
from agl_stream.store.client import AglStore
from agl_stream.trace_ingest import SpansRejectedError, TraceIngest, number_spans, write_spans
from agl_stream.wire import otlp

log = get_logger("agl.otlp_kafka")

PROCESSOR = "consumer.otlp-kafka"
KafkaEncoding = Literal["otlp_proto", "otlp_json"]
_ENCODINGS: dict[str, otlp.Encoding] = {"otlp_proto": "protobuf", "otlp_json": "json"}
_POLL_S = 0.5  # idle poll, which also bounds how late a stop is noticed
# What a batch may fail with that is not about its input: the batch is retried.
_TRANSIENT = (AglError, KafkaError, OSError, asyncio.TimeoutError)

Message: TypeAlias = ConsumerRecord[bytes, bytes]


# -- the functional core -----------------------------------------------------------------------


def decode_message(value: bytes, encoding: KafkaEncoding) -> otlp.DecodedTraces | otlp.OtlpError:
    """One message value as decoded traces, or the error that sends it to the DLQ."""
    if len(value) > otlp.MAX_BODY_BYTES:
        return otlp.OtlpTooLargeError(
            f"the message is {len(value):,} bytes, over {otlp.MAX_BODY_BYTES:,}: let the collector send "
            "smaller batches (batch processor send_batch_max_size)"
        )
    try:
        return otlp.decode_body(value, _ENCODINGS[encoding])
    except otlp.MalformedOtlpError as error:
        # The decoder's own hint is about HTTP Content-Types; say what it is about here.
        detail = error.__cause__ if error.__cause__ is not None else error
        return otlp.MalformedOtlpError(f"the message is not an OTLP trace request in {encoding} ({detail})")
    except otlp.OtlpError as error:
        return error
    except Exception as error:  # a protobuf runtime refusing odd input must not stop the consumer
        return otlp.MalformedOtlpError(f"the message is not an OTLP trace request ({type(error).__name__}: {error})")


def decode_all(values: Sequence[bytes], encoding: KafkaEncoding) -> list[otlp.DecodedTraces | otlp.OtlpError]:
    return [decode_message(value, encoding) for value in values]


def rejection_reason(rejected: Counter[str], total: int, stored: int) -> str:
    """The DLQ reason of a message with refused spans (``stored``: its spans that are stored)."""
    reason = otlp.rejection_message(rejected, total)
    return f"{reason}; the other {stored} were stored" if stored else reason


@dataclass(frozen=True)
class SpanKey:
    """A span's identity within its attempt: what a re-read message is checked against."""

    rollout_id: str
    attempt_id: str
    trace_id: str
    span_id: str

    @classmethod
    def of(cls, decoded: otlp.DecodedSpan) -> SpanKey:
        span = decoded.span
        return cls(span.rollout_id, span.attempt_id, span.trace_id, span.span_id)


# -- the imperative shell ----------------------------------------------------------------------


class OtlpKafkaConsumer:
    """The skeleton's handler (``assigned``, ``revoked``, ``handle``)."""

    def __init__(
        self,
        settings: Settings,
        *,
        topic: str | None = None,
        group: str | None = None,
        encoding: KafkaEncoding = "otlp_proto",
        max_records: int = 500,
    ) -> None:
        self.settings = settings
        self.topic = topic or settings.otlp_kafka_topic
        self.group = group or settings.otlp_kafka_group
        self.encoding = encoding
        self.max_records = max_records
        self.ingest = TraceIngest(settings)
        self.recheck_end: dict[int, int] = {}  # partition -> offsets below it may be stored already
        self._dedup_fence: dict[str, dict[int, int]] | None = None
        self.counts: Counter[str] = Counter()
        self._consumer: AIOKafkaConsumer | None = None
        self._outbox: Outbox | None = None
        self._stopping = asyncio.Event()

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        settings = self.settings
        self.ingest.start()
        try:
            async with Outbox.started(settings, PROCESSOR) as self._outbox:
                log.info("otlp-kafka started", topic=self.topic, group=self.group, encoding=self.encoding)
                await run_processor(
                    settings,
                    self,
                    name=PROCESSOR,
                    group_id=self.group,
                    topics=[self.topic],
                    stop=self._stopping,
                    max_records=self.max_records,
                    on_start=self._started,
                    retry_on=_TRANSIENT,
                )
        finally:
            await self.ingest.close()
        log.info("otlp-kafka stopped", **dict(self.counts))

    def _started(self, consumer: AIOKafkaConsumer) -> None:
        self._consumer = consumer

    # -- the skeleton's calls -------------------------------------------------------------

    def poll_timeout(self) -> float:
        return _POLL_S

    async def tick(self) -> None:
        """No timers."""

    async def handle(self, batch: Batch) -> None:
        assert self._outbox is not None
        messages = [message for records in batch.values() for message in records]
        try:
            await self._process(messages, self._outbox)
        except _TRANSIENT as error:
            # Some spans or DLQ records may be out already: check the batch again when re-read.
            for message in messages:
                end = self.recheck_end.get(message.partition, 0)
                self.recheck_end[message.partition] = max(end, message.offset + 1)
            self._dedup_fence = None
            self.counts["retries"] += 1
            log.warning("an OTLP batch failed; retrying it", error=f"{type(error).__name__}: {error}"[:500])
            raise

    def revoked(self, partitions: set[TopicPartition]) -> None:
        for tp in partitions:
            self.recheck_end.pop(tp.partition, None)
        log.info("partitions revoked", partitions=sorted(tp.partition for tp in partitions))

    async def assigned(self, partitions: set[TopicPartition]) -> None:
        consumer = self._consumer
        assert consumer is not None
        self._dedup_fence = None
        assigned = sorted(partitions, key=lambda tp: tp.partition)
        ends = await consumer.end_offsets(assigned) if assigned else {}
        for tp in assigned:
            # Whatever is already in the partition may have been stored by an earlier owner that
            # died before committing it.
            self.recheck_end[tp.partition] = ends[tp]
        log.info("partitions assigned", recheck_below={tp.partition: ends[tp] for tp in assigned})

    async def _process(self, messages: Sequence[Message], outbox: Outbox) -> None:
        # Off the event loop: a batch of large requests would hold up heartbeats and fetches.
        decoded = await asyncio.to_thread(decode_all, [m.value or b"" for m in messages], self.encoding)
        spans: list[otlp.DecodedSpan] = []
        owner: list[int] = []  # the message of each span
        for index, traces in enumerate(decoded):
            if isinstance(traces, otlp.DecodedTraces):
                spans.extend(traces.spans)
                owner.extend([index] * len(traces.spans))
        stored: Counter[int] = Counter()
        refused: dict[int, Counter[str]] = defaultdict(Counter)
        if spans:
            store = await self.ingest.store()
            maybe_stored = [
                k
                for k in range(len(spans))
                if messages[owner[k]].offset < self.recheck_end.get(messages[owner[k]].partition, 0)
            ]
            present = await self._already_stored(store, [spans[k] for k in maybe_stored]) if maybe_stored else set()
            skipped = {k for k in maybe_stored if SpanKey.of(spans[k]) in present}
            fresh = [k for k in range(len(spans)) if k not in skipped]
            numbered = await number_spans(store, [spans[k] for k in fresh])
            await write_spans(store, numbered)
            for k in skipped:
                stored[owner[k]] += 1
            for j, k in enumerate(fresh):
                if j in numbered.refused:
                    refused[owner[k]][numbered.refused[j]] += 1
                else:
                    stored[owner[k]] += 1
            self.counts["spans"] += len(numbered.spans)
            self.counts["duplicates_skipped"] += len(skipped)
        rejected: list[Rejected] = []
        for index, (message, traces) in enumerate(zip(messages, decoded, strict=True)):
            if isinstance(traces, otlp.OtlpError):
                rejected.append(Rejected.of(message, traces))
                continue
            reasons = traces.rejected + refused[index]
            if reasons:
                error = SpansRejectedError(rejection_reason(reasons, traces.total, stored[index]))
                rejected.append(Rejected.of(message, error))
        if rejected:
            await outbox.reject(rejected)
        self.counts["messages"] += len(messages)
        self.counts["dead_lettered"] += len(rejected)
        log.info(
            "OTLP batch stored",
            messages=len(messages),
            spans=sum(stored.values()),
            dead_lettered=len(rejected),
            skipped_as_stored=self.counts["duplicates_skipped"],
        )

    async def _already_stored(self, store: AglStore, spans: Sequence[otlp.DecodedSpan]) -> set[SpanKey]:
        """Which of ``spans`` are in otel_traces, behind a fence covering every span written so
        far (taken once per assignment or failure: whatever an earlier run wrote is below it)."""
        if self._dedup_fence is None:
            self._dedup_fence = await fence_at_end(self.settings, "spans")
        keys = {SpanKey.of(span) for span in spans}
        assert store.side is not None, "the store is started"
        result = await store.side.query(
            f"SELECT RolloutId, AttemptId, TraceId, SpanId FROM {self.settings.clickhouse_database}.otel_traces "
            "WHERE RolloutId IN {rollouts:Array(String)} AND AttemptId IN {attempts:Array(String)} "
            "AND SpanId IN {span_ids:Array(String)}",
            {
                "rollouts": sorted({k.rollout_id for k in keys}),
                "attempts": sorted({k.attempt_id for k in keys}),
                "span_ids": sorted({k.span_id for k in keys}),
            },
            fence=self._dedup_fence,
            timeout=60.0,
        )
        return {SpanKey(*(str(v) for v in row)) for row in result.rows} & keys


async def run_otlp_kafka(settings: Settings, **options: Any) -> None:
    consumer = OtlpKafkaConsumer(settings, **options)
    with stop_on_signals(consumer.stop):
        await consumer.run()


def main(settings: Settings, **options: Any) -> None:
    """Run the OTLP Kafka consumer until SIGTERM/SIGINT (``agl-stream otlp-kafka``)."""
    asyncio.run(run_otlp_kafka(settings, **options))
