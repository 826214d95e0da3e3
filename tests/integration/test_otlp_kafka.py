"""`agl-stream otlp-kafka`: OTLP traces from a collector's Kafka topic into agl.spans, on the real stack.

Messages are what the OpenTelemetry Collector's Kafka exporter writes with its default encoding
(``otlp_proto``): serialized ExportTraceServiceRequest/TracesData bytes, built here with the
opentelemetry-proto classes and produced with raw aiokafka to a topic of the test's own (the
collector's topic is not prefixed). The consumer runs as a process; spans are read back with the
store's query_spans behind a fence at the end of agl.spans, dead letters from agl.dlq.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import NewTopic
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans
from opentelemetry.proto.trace.v1.trace_pb2 import Span as OtlpSpan

from agl_stream import AglStore, connect
from agl_stream.config import Settings
from agl_stream.kafka.admin import admin_client
from agl_stream.kafka.offsets import fence_at_end
from agl_stream.models import DlqRecord, Span
from agl_stream.wire import otlp
from consumers.otlp_kafka import decode_message
from tests.integration.helpers import dlq_records, start_role, stop_role, wait_committed_at_least

pytestmark = pytest.mark.integration

ROLLOUT = "agentlightning.rollout_id"
ATTEMPT = "agentlightning.attempt_id"
NANOS = 1_000_000_000


@pytest.fixture
async def store(stack_settings: Settings) -> AsyncIterator[AglStore]:
    async with connect(**stack_settings.model_dump(exclude_none=True)) as client:
        yield client


@pytest.fixture
async def otlp_topic(stack_settings: Settings) -> AsyncIterator[str]:
    """A collector-style topic of this test's own (2 partitions), deleted afterwards."""
    topic = f"otlp_spans_{uuid.uuid4().hex[:8]}"
    admin = admin_client(stack_settings)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=2, replication_factor=1)])
        yield topic
        await admin.delete_topics([topic])
    finally:
        await admin.close()


def value(v: Any) -> AnyValue:
    if isinstance(v, bool):
        return AnyValue(bool_value=v)
    if isinstance(v, int):
        return AnyValue(int_value=v)
    if isinstance(v, float):
        return AnyValue(double_value=v)
    if isinstance(v, list):
        return AnyValue(array_value=ArrayValue(values=[value(x) for x in v]))
    return AnyValue(string_value=str(v))


def attributes(attrs: dict[str, Any]) -> list[KeyValue]:
    return [KeyValue(key=k, value=value(v)) for k, v in attrs.items()]


def span(name: str, *, parent: OtlpSpan | None = None, **attrs: Any) -> OtlpSpan:
    start = int(time.time() * NANOS)
    return OtlpSpan(
        trace_id=parent.trace_id if parent else os.urandom(16),
        span_id=os.urandom(8),
        parent_span_id=parent.span_id if parent else b"",
        name=name,
        kind=OtlpSpan.SPAN_KIND_CLIENT,
        start_time_unix_nano=start,
        end_time_unix_nano=start + 1_000_000,
        attributes=attributes(attrs),
    )


def request(*resources: tuple[dict[str, Any], Sequence[OtlpSpan]]) -> bytes:
    """One Kafka message as the exporter writes it: several resource spans in one request."""
    return ExportTraceServiceRequest(
        resource_spans=[
            ResourceSpans(
                resource=Resource(attributes=attributes(resource)),
                scope_spans=[ScopeSpans(scope=InstrumentationScope(name="my.agent", version="0.1"), spans=spans)],
            )
            for resource, spans in resources
        ]
    ).SerializeToString()


def of_attempt(rollout_id: str, attempt_id: str, **extra: Any) -> dict[str, Any]:
    return {ROLLOUT: rollout_id, ATTEMPT: attempt_id, "service.name": "otlp-kafka-test", **extra}


async def produce(settings: Settings, topic: str, messages: Sequence[tuple[bytes | None, bytes]]) -> None:
    producer = AIOKafkaProducer(**settings.kafka_client_options())
    await producer.start()
    try:
        for key, data in messages:
            await producer.send_and_wait(topic, data, key=key)
    finally:
        await producer.stop()


async def spans_behind_everything(store: AglStore, settings: Settings, rollout_id: str, attempt_id: str) -> list[Span]:
    """query_spans once the sink applied every span written so far (another process wrote them)."""
    assert store.side is not None
    await store.side.query("SELECT 1", fence=await fence_at_end(settings, "spans"), timeout=60)
    return await store.query_spans(rollout_id, attempt_id)


async def dead_letters(settings: Settings, source_topic: str, count: int, *, timeout: float = 30.0) -> list[DlqRecord]:
    """The first ``count`` DLQ records whose source is ``source_topic``, in source order."""
    found = await dlq_records(settings, count, lambda r: r.source_topic == source_topic, timeout=timeout)
    return sorted(found, key=lambda r: (r.source_partition, r.source_offset))


async def test_collector_messages_become_spans_and_bad_ones_dead_letters_with_reasons(
    store: AglStore, stack_settings: Settings, otlp_topic: str
) -> None:
    a = await store.start_rollout({"otlp": "kafka-a"})
    b = await store.start_rollout({"otlp": "kafka-b"})
    a_ids = (a.rollout_id, a.attempt.attempt_id)
    b_ids = (b.rollout_id, b.attempt.attempt_id)
    a1 = span("agent", reward=0.5, ok=True, tokens=12, tags=["x", "y"])
    a2 = span("llm", parent=a1, model="tiny")
    b1 = span("tool")
    a3, orphan, stranger = span("late"), span("no-ids"), span("unknown")
    several = request((of_attempt(*a_ids), [a1, a2]), (of_attempt(*b_ids, **{"host.name": "h1"}), [b1]))
    malformed = b"\x0a\xff\x01not a protobuf message"
    partial = request(({"service.name": "no-attempt"}, [orphan]), (of_attempt(*a_ids), [a3]))
    unknown = request((of_attempt("ro-000000000000", "at-000000000000"), [stranger]))
    # All to partition 0 (one key) so offsets follow this order; the exporter's default is no key.
    messages = [(b"k", several), (b"k", malformed), (b"k", partial), (b"k", unknown), (None, request())]
    await produce(stack_settings, otlp_topic, messages)

    group = f"g-{uuid.uuid4().hex[:8]}"
    consumer = start_role(
        stack_settings, "otlp-kafka", "--topic", otlp_topic, "--group", group, log_name=f"otlp-kafka-{group}"
    )
    try:
        await wait_committed_at_least(stack_settings, group, len(messages), timeout=90)
        spans_a = await spans_behind_everything(store, stack_settings, *a_ids)
        spans_b = await spans_behind_everything(store, stack_settings, *b_ids)
        letters = await dead_letters(stack_settings, otlp_topic, 3)
    finally:
        assert stop_role(consumer) == 0, "a clean stop on SIGTERM"

    by_name = {s.name: s for s in spans_a}
    assert sorted(by_name) == ["agent", "late", "llm"] and len(spans_a) == 3
    assert [s.name for s in spans_b] == ["tool"]
    sequence = [s.sequence_id for s in spans_a]
    assert len(set(sequence)) == 3 and min(sequence) >= 1, f"numbered by the store: {sequence}"
    agent = by_name["agent"]
    assert agent.span_id == a1.span_id.hex() and agent.trace_id == a1.trace_id.hex()
    assert agent.attributes["reward"] == 0.5 and agent.attributes["ok"] is True
    assert agent.attributes["tokens"] == 12 and agent.attributes["tags"] == ["x", "y"]
    assert by_name["llm"].parent_id == a1.span_id.hex() and by_name["llm"].attributes["model"] == "tiny"
    assert agent.resource.attributes["service.name"] == "otlp-kafka-test"
    assert agent.scope_name == "my.agent"
    assert spans_b[0].resource.attributes["host.name"] == "h1" and spans_b[0].sequence_id >= 1

    assert [r.source_offset for r in letters] == [1, 2, 3]
    bad, part, strange = letters
    assert all(r.processor == "consumer.otlp-kafka" and r.key == b"k" for r in letters)
    assert bad.value == malformed and bad.error_type == "MalformedOtlpError" and "in otlp_proto" in bad.reason
    assert part.value == partial and part.error_type == "SpansRejectedError"
    assert "rejected 1 of 2 spans" in part.reason and f"without {ROLLOUT} and {ATTEMPT}" in part.reason
    assert "the other 1 were stored" in part.reason
    assert strange.value == unknown and "rejected 1 of 1 spans" in strange.reason and "refused" in strange.reason


async def test_killed_consumer_restarts_and_a_reread_stores_every_span_once(
    store: AglStore, stack_settings: Settings, otlp_topic: str
) -> None:
    """Guarantee: every span stored once. A kill -9 between a batch's write and its commit makes
    the restarted consumer re-read the batch; it finds the spans stored and skips them. A second
    group re-reading the whole topic (a crash before any commit, at its worst) adds nothing."""
    c = await store.start_rollout({"otlp": "kafka-crash"})
    ids = (c.rollout_id, c.attempt.attempt_id)
    sent: list[OtlpSpan] = []
    messages: list[tuple[bytes | None, bytes]] = []
    for i in range(40):
        root = span(f"root-{i}", i=i)
        batch = [root, span(f"child-{i}", parent=root), span(f"other-{i}", i=i)]
        sent.extend(batch)
        messages.append((None, request((of_attempt(*ids), batch))))
    await produce(stack_settings, otlp_topic, messages)

    group = f"g-{uuid.uuid4().hex[:8]}"
    args = ("otlp-kafka", "--topic", otlp_topic, "--group", group, "--max-records", "2")
    first = start_role(stack_settings, *args, log_name=f"otlp-kafka-{group}-1")
    try:
        await wait_committed_at_least(stack_settings, group, 8, timeout=90)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    second = start_role(stack_settings, *args, log_name=f"otlp-kafka-{group}-2")
    try:
        await wait_committed_at_least(stack_settings, group, len(messages), timeout=90)
    finally:
        assert stop_role(second) == 0

    expected = sorted(s.span_id.hex() for s in sent)
    stored = await spans_behind_everything(store, stack_settings, *ids)
    assert sorted(s.span_id for s in stored) == expected, "every span, once"
    assert len({s.sequence_id for s in stored}) == len(sent)

    again = f"g-{uuid.uuid4().hex[:8]}"
    reread = start_role(
        stack_settings, "otlp-kafka", "--topic", otlp_topic, "--group", again, log_name=f"otlp-kafka-{again}"
    )
    try:
        await wait_committed_at_least(stack_settings, again, len(messages), timeout=90)
    finally:
        assert stop_role(reread) == 0
    after = await spans_behind_everything(store, stack_settings, *ids)
    assert sorted(s.span_id for s in after) == expected, "a re-read stores nothing twice"


def test_oversized_and_malformed_messages_are_refused_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    good = request((of_attempt("ro-1", "at-1"), [span("x")]))
    decoded = decode_message(good, "otlp_proto")
    assert isinstance(decoded, otlp.DecodedTraces) and len(decoded.spans) == 1
    assert isinstance(decode_message(b"\x0a\xff", "otlp_proto"), otlp.MalformedOtlpError)
    assert isinstance(decode_message(b"{not json", "otlp_json"), otlp.MalformedOtlpError)
    monkeypatch.setattr(otlp, "MAX_BODY_BYTES", len(good) - 1)
    assert isinstance(decode_message(good, "otlp_proto"), otlp.OtlpTooLargeError)
