"""The gateway's OTLP/HTTP receiver (POST /v1/traces) against the real stack.

Spans go in through the OpenTelemetry SDK's own OTLP/HTTP exporter (and raw httpx posts) and
come out of ClickHouse through the store. The gateway, not this client, wrote them, so this
client's read fence does not cover them: reads poll with a deadline (:func:`wait_until`).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import httpx
import pytest
from google.rpc import status_pb2
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from agl_stream import AglStore, connect
from agl_stream.config import Settings
from agl_stream.kafka.offsets import end_offsets
from agl_stream.local import stack
from agl_stream.models import RolloutEvent, RolloutState, Span, SpanSequenceRequested
from agl_stream.trace_ingest import MAX_ATTEMPTS_PER_EXPORT
from agl_stream.wire.codec import Codec
from agl_stream.wire.otlp import PROTOBUF
from tests.integration.helpers import read_to_end

pytestmark = pytest.mark.integration

T = TypeVar("T")
ROLLOUT = "agentlightning.rollout_id"
ATTEMPT = "agentlightning.attempt_id"


@pytest.fixture
async def store(stack_settings: Settings) -> AsyncIterator[AglStore]:
    async with connect(**stack_settings.model_dump(exclude_none=True)) as client:
        yield client


@pytest.fixture
def traces_url(stack_settings: Settings) -> str:
    recorded = stack.read_stack(stack_settings)
    assert recorded is not None and recorded.gateway_url, "the stack records its gateway"
    return f"{recorded.gateway_url}/v1/traces"


async def wait_until(
    probe: Callable[[], Awaitable[T]], done: Callable[[T], bool], *, what: str, timeout: float = 60.0
) -> T:
    """Poll ``probe`` until ``done`` holds. Only for what another process wrote (no fence covers it)."""
    deadline = time.monotonic() + timeout
    while True:
        value = await probe()
        if done(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout}s; last seen: {value!r}")
        await asyncio.sleep(0.05)


async def spans_of(store: AglStore, rollout_id: str, attempt_id: str, count: int) -> list[Span]:
    return await wait_until(
        lambda: store.query_spans(rollout_id, attempt_id),
        lambda spans: len(spans) >= count,
        what=f"{count} spans of {rollout_id}/{attempt_id} in ClickHouse",
    )


def record_spans(resource: dict[str, Any], run: Callable[[TracerProvider], None]) -> Sequence[ReadableSpan]:
    """The SDK spans ``run`` makes with a provider whose resource is ``resource``."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create(resource))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    run(provider)
    provider.shutdown()
    return memory.get_finished_spans()


def agent_run(provider: TracerProvider) -> None:
    tracer = provider.get_tracer("my.agent", "0.3")
    with tracer.start_as_current_span("agent", kind=SpanKind.SERVER):
        with tracer.start_as_current_span("llm", kind=SpanKind.CLIENT) as llm:
            llm.set_attributes({"reward": 0.5, "ok": True, "tokens": 12, "one": 1.0, "tags": ["a", "b"]})
            llm.add_event("first_token", {"ms": 31})
        with tracer.start_as_current_span("tool") as tool:
            tool.set_status(StatusCode.ERROR, "tool failed")


def export(url: str, spans: Sequence[ReadableSpan], **options: Any) -> SpanExportResult:
    exporter = OTLPSpanExporter(endpoint=url, **options)
    try:
        return exporter.export(spans)
    finally:
        exporter.shutdown()


async def test_sdk_exporter_spans_arrive_once_numbered_typed_and_as_heartbeats(
    store: AglStore, traces_url: str
) -> None:
    started = await store.start_rollout({"otlp": "sdk"})
    rid, aid = started.rollout_id, started.attempt.attempt_id
    assert started.attempt.status == "preparing"
    resource = {ROLLOUT: rid, ATTEMPT: aid, "service.name": "otlp-test"}
    first = record_spans(resource, agent_run)  # three spans, nested: one request
    second = record_spans(resource, lambda p: p.get_tracer("later").start_span("late", attributes={"n": -3}).end())
    assert await asyncio.to_thread(export, traces_url, first) == SpanExportResult.SUCCESS
    assert await asyncio.to_thread(export, traces_url, second, compression=Compression.Gzip) == SpanExportResult.SUCCESS

    spans = await spans_of(store, rid, aid, 4)
    assert len(spans) == 4
    assert len({s.span_id for s in spans}) == 4, "each span stored once"
    sequence = [s.sequence_id for s in spans]
    assert sequence == sorted(set(sequence)), f"strictly increasing: {sequence}"
    by_name = {s.name: s for s in spans}
    # The SDK exports in end order (children first); ids follow the request order, requests in turn.
    assert [s.name for s in spans] == ["llm", "tool", "agent", "late"]
    agent, llm, tool, late = by_name["agent"], by_name["llm"], by_name["tool"], by_name["late"]
    assert agent.parent_id is None and llm.parent_id == agent.span_id and tool.parent_id == agent.span_id
    assert {s.trace_id for s in (agent, llm, tool)} == {agent.trace_id} != {late.trace_id}
    assert (agent.kind, llm.kind, tool.kind) == ("SERVER", "CLIENT", "INTERNAL")
    assert tool.status.status_code == "ERROR" and tool.status.description == "tool failed"
    assert llm.attributes == {"reward": 0.5, "ok": True, "tokens": 12, "one": 1.0, "tags": ["a", "b"]}
    assert [type(llm.attributes[k]) for k in ("reward", "ok", "tokens", "one")] == [float, bool, int, float]
    assert late.attributes == {"n": -3}
    assert [(e.name, e.attributes) for e in llm.events] == [("first_token", {"ms": 31})]
    assert llm.start_time is not None and llm.end_time is not None and llm.start_time <= llm.end_time
    assert (llm.scope_name, llm.scope_version) == ("my.agent", "0.3")
    assert llm.resource.attributes[ROLLOUT] == rid and llm.resource.attributes["service.name"] == "otlp-test"

    attempt = await wait_until(
        lambda: store.get_latest_attempt(rid),
        lambda a: a is not None and a.status == "running",
        what="the attempt running after its spans arrived",
    )
    assert attempt is not None and attempt.last_heartbeat_time is not None

    # Each export was one event about the attempt: the reservation of its spans' ids, which
    # was their heartbeat too (no heartbeat of its own).
    codec = Codec.default()
    events = [
        codec.decode(r.value, RolloutEvent).payload
        for r in await read_to_end(store.settings, store.settings.topic("rollouts"))
        if r.key == rid.encode()
    ]
    assert [type(e).__name__ for e in events] == ["RolloutEnqueued", "SpanSequenceRequested", "SpanSequenceRequested"]
    assert [(e.count, e.span_count) for e in events[1:] if isinstance(e, SpanSequenceRequested)] == [(3, 3), (1, 1)]
    # The count the triplet builder waits for, in the rollout's newest state.
    states = [
        r for r in await read_to_end(store.settings, store.settings.topic("rollout-state")) if r.key == rid.encode()
    ]
    assert codec.decode(states[-1].value, RolloutState).span_counts == {aid: 4}


async def test_json_bodies_with_own_and_assigned_sequence_ids(store: AglStore, traces_url: str) -> None:
    started = await store.start_rollout({"otlp": "json"})
    rid, aid = started.rollout_id, started.attempt.attempt_id
    trace_id = "5b8efff798038103d269b633813fc60c"
    body = {
        "resourceSpans": [
            {
                "resource": {"attributes": [{"key": ROLLOUT, "value": {"stringValue": rid}}]},
                "scopeSpans": [
                    {
                        "scope": {"name": "js-agent"},
                        "spans": [
                            {
                                "traceId": trace_id,
                                "spanId": "eee19b7ec3c1b174",
                                "name": "numbered by the client",
                                "kind": 3,
                                "startTimeUnixNano": "1700000000000000000",
                                "endTimeUnixNano": "1700000001000000000",
                                "attributes": [
                                    {"key": ATTEMPT, "value": {"stringValue": aid}},
                                    {"key": "agentlightning.span_sequence_id", "value": {"intValue": "100"}},
                                    {"key": "big", "value": {"intValue": str(2**62)}},
                                    {"key": "ratio", "value": {"doubleValue": 2.0}},
                                    {"key": "cfg", "value": {"kvlistValue": {"values": [
                                        {"key": "temp", "value": {"doubleValue": 0.7}},
                                    ]}}},
                                ],
                                "status": {"code": 1},
                            },
                            {
                                "traceId": trace_id,
                                "spanId": "eee19b7ec3c1b175",
                                "parentSpanId": "eee19b7ec3c1b174",
                                "name": "numbered by the gateway",
                                "startTimeUnixNano": "1700000000500000000",
                                "endTimeUnixNano": "1700000000600000000",
                                "attributes": [{"key": ATTEMPT, "value": {"stringValue": aid}}],
                            },
                        ],
                    }
                ],
            }
        ]
    }  # fmt: skip
    async with httpx.AsyncClient(timeout=60) as http:
        response = await http.post(traces_url, json=body)
        assert response.status_code == 200, response.text
        assert response.headers["content-type"].startswith("application/json")
        assert response.json() == {}  # full success leaves partialSuccess unset
        # The same spans again under new ids, gzipped, the client's own id now 200.
        again = json.dumps(body).replace("b174", "c174").replace("b175", "c175").replace('"100"', '"200"')
        zipped = await http.post(
            traces_url,
            content=gzip.compress(again.encode()),
            headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
        )
        assert zipped.status_code == 200 and zipped.json() == {}, zipped.text

    spans = await spans_of(store, rid, aid, 4)
    # The first heartbeat carried the client's 100, so the gateway's next reservation starts past it.
    assert [(s.name, s.sequence_id) for s in spans] == [
        ("numbered by the gateway", 1),
        ("numbered by the client", 100),
        ("numbered by the gateway", 101),
        ("numbered by the client", 200),
    ]
    own = spans[1]
    assert own.trace_id == trace_id and own.kind == "CLIENT" and own.status.status_code == "OK"
    assert own.attributes["big"] == 2**62 and own.attributes["cfg.temp"] == 0.7
    assert type(own.attributes["ratio"]) is float
    assert (own.start_time, own.end_time) == (1_700_000_000.0, 1_700_000_001.0)
    assert (spans[0].parent_id, spans[2].parent_id) == ("eee19b7ec3c1b174", "eee19b7ec3c1c174")
    assert (spans[0].scope_name, spans[0].resource.attributes) == ("js-agent", {ROLLOUT: rid})


async def test_unknown_attempts_and_untagged_spans_are_rejected_the_rest_stored(
    store: AglStore, traces_url: str
) -> None:
    started = await store.start_rollout({"otlp": "partial"})
    rid, aid = started.rollout_id, started.attempt.attempt_id
    good = record_spans({ROLLOUT: rid, ATTEMPT: aid}, lambda p: p.get_tracer("t").start_span("kept").end())
    unknown = record_spans({ROLLOUT: rid, ATTEMPT: "at-00000bad"}, agent_run)
    untagged = record_spans({"service.name": "no ids"}, lambda p: p.get_tracer("t").start_span("orphan").end())
    body = encode_spans([*good, *unknown, *untagged]).SerializeToString()
    async with httpx.AsyncClient(timeout=60) as http:
        answer = await http.post(traces_url, content=body, headers={"Content-Type": "application/x-protobuf"})
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/x-protobuf"
    partial = ExportTraceServiceResponse.FromString(answer.content).partial_success
    assert partial.rejected_spans == 4
    assert partial.error_message.startswith("rejected 4 of 5 spans: 3 of an attempt the store refused")
    assert "unknown attempt id at-00000bad" in partial.error_message
    assert "1 without agentlightning.rollout_id and agentlightning.attempt_id" in partial.error_message

    spans = await spans_of(store, rid, aid, 1)
    assert [(s.name, s.sequence_id) for s in spans] == [("kept", 1)]

    # The real exporter reports success (OTLP's partial success is not a failure) ...
    assert await asyncio.to_thread(export, traces_url, unknown) == SpanExportResult.SUCCESS
    # ... and an unknown rollout is refused as such.
    other = record_spans({ROLLOUT: "ro-00000bad", ATTEMPT: aid}, lambda p: p.get_tracer("t").start_span("x").end())
    async with httpx.AsyncClient(timeout=60) as http:
        answer = await http.post(
            traces_url,
            content=encode_spans(other).SerializeToString(),
            headers={"Content-Type": "application/x-protobuf"},
        )
    partial = ExportTraceServiceResponse.FromString(answer.content).partial_success
    assert partial.rejected_spans == 1 and "unknown rollout id ro-00000bad" in partial.error_message


async def test_one_export_naming_hundreds_of_unknown_attempts_writes_a_bounded_few_events(
    store: AglStore, stack_settings: Settings, traces_url: str
) -> None:
    started = await store.start_rollout({"otlp": "many"})
    rid = started.rollout_id
    named = MAX_ATTEMPTS_PER_EXPORT + 44
    unknown = [
        span
        for i in range(named)
        for span in record_spans(
            {ROLLOUT: rid, ATTEMPT: f"at-{i:08x}"}, lambda p: p.get_tracer("t").start_span("x").end()
        )
    ]
    topics = [stack_settings.topic("rollouts"), stack_settings.topic("dlq")]
    before = [sum((await end_offsets(stack_settings, t)).values()) for t in topics]
    async with httpx.AsyncClient(timeout=60) as http:
        answer = await http.post(
            traces_url, content=encode_spans(unknown).SerializeToString(), headers={"Content-Type": PROTOBUF}
        )
    partial = ExportTraceServiceResponse.FromString(answer.content).partial_success
    assert partial.rejected_spans == named
    assert f"44 of an export naming more than {MAX_ATTEMPTS_PER_EXPORT} attempts" in partial.error_message
    after = [sum((await end_offsets(stack_settings, t)).values()) for t in topics]
    # one reservation event per attempt checked, none for the rest; the refusals were answered
    # to the gateway, so none of them is dead-lettered as well
    assert after[0] - before[0] == MAX_ATTEMPTS_PER_EXPORT
    assert after[1] == before[1]


async def test_malformed_and_unsupported_requests(traces_url: str) -> None:
    async with httpx.AsyncClient(timeout=60) as http:
        garbage = await http.post(
            traces_url, content=b"\x0a\x05abc", headers={"Content-Type": "application/x-protobuf"}
        )
        assert garbage.status_code == 400
        assert garbage.headers["content-type"] == "application/x-protobuf"
        status = status_pb2.Status.FromString(garbage.content)
        assert status.code == 3 and "not a protobuf ExportTraceServiceRequest" in status.message

        not_json = await http.post(traces_url, content=b"{oops", headers={"Content-Type": "application/json"})
        assert not_json.status_code == 400
        assert not_json.json()["error"] == "malformed_otlp" and not_json.json()["code"] == 3
        assert "not JSON" in not_json.json()["message"]

        base64_ids = await http.post(
            traces_url,
            json={"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "AAECAwQFBgcICQoLDA0ODw=="}]}]}]},
        )
        assert base64_ids.status_code == 400 and "not hex" in base64_ids.json()["message"]

        not_gzip = await http.post(
            traces_url,
            content=b"plain",
            headers={"Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"},
        )
        assert not_gzip.status_code == 400
        assert "not valid gzip" in status_pb2.Status.FromString(not_gzip.content).message

        text = await http.post(traces_url, content=b"hello", headers={"Content-Type": "text/plain"})
        assert text.status_code == 415 and "application/x-protobuf" in text.json()["message"]

        brotli = await http.post(
            traces_url, content=b"x", headers={"Content-Type": "application/json", "Content-Encoding": "br"}
        )
        assert brotli.status_code == 415 and brotli.json()["error"] == "unsupported_media_type"
