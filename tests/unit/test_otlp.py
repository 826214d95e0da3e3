"""agl_stream.wire.otlp: OTLP/HTTP export requests (protobuf and OTLP JSON) -> agl Span records."""

from __future__ import annotations

import base64
import gzip
import json
import math
from typing import Any

import pytest
from google.protobuf import json_format
from google.rpc import status_pb2
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, InstrumentationScope, KeyValue, KeyValueList
from opentelemetry.proto.resource.v1.resource_pb2 import Resource as OtlpResource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, SpanFlags, Status
from opentelemetry.proto.trace.v1.trace_pb2 import Span as OtlpSpan
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanKind, StatusCode

from agl_stream.errors import AglError
from agl_stream.models import Span
from agl_stream.models.spans import OtelResource, SpanContext, SpanEvent, SpanLink, SpanStatus
from agl_stream.wire import otlp
from agl_stream.wire.spans import span_from_otel

TRACE = bytes.fromhex("0af7651916cd43dd8448eb211c80319c")
SPAN = bytes.fromhex("b7ad6b7169203331")
PARENT = bytes.fromhex("00f067aa0ba902b7")
LINK_TRACE = bytes.fromhex("4bf92f3577b34da6a3ce929d0e0e4736")
LINK_SPAN = bytes.fromhex("53995c3f42cd8ad8")
T0 = 1_700_000_000_123_456_789


def value(v: Any) -> AnyValue:
    """An OTLP AnyValue from a Python value (dict -> kvlist, list -> array, None -> empty)."""
    if v is None:
        return AnyValue()
    if isinstance(v, bool):
        return AnyValue(bool_value=v)
    if isinstance(v, int):
        return AnyValue(int_value=v)
    if isinstance(v, float):
        return AnyValue(double_value=v)
    if isinstance(v, str):
        return AnyValue(string_value=v)
    if isinstance(v, bytes):
        return AnyValue(bytes_value=v)
    if isinstance(v, list):
        return AnyValue(array_value=ArrayValue(values=[value(x) for x in v]))
    if isinstance(v, dict):
        return AnyValue(kvlist_value=KeyValueList(values=attrs(v)))
    raise TypeError(v)


def attrs(mapping: dict[str, Any]) -> list[KeyValue]:
    return [KeyValue(key=k, value=value(v)) for k, v in mapping.items()]


IDS = {"agentlightning.rollout_id": "ro-1", "agentlightning.attempt_id": "at-1"}

EVERY_KIND: dict[str, Any] = {
    "str": "hé",
    "empty_str": "",
    "bool": True,
    "int": 1,
    "int_max": 2**63 - 1,
    "int_min": -(2**63),
    "float": 1.0,
    "neg_zero": -0.0,
    "bytes": b"\x00\xffbin",
    "strs": ["a", "b"],
    "mixed": [1, 1.5, "x", True, None],
    "empty_array": [],
    "null": None,
    "map": {"a": 1, "b": {"c": "deep"}, "d": [1, 2]},
    "empty_map": {},
    "structs": [{"name": "primary", "value": 1.0}, [1, 2]],
}

EVERY_KIND_DECODED: dict[str, Any] = {
    "str": "hé",
    "empty_str": "",
    "bool": True,
    "int": 1,
    "int_max": 2**63 - 1,
    "int_min": -(2**63),
    "float": 1.0,
    "neg_zero": -0.0,
    "bytes": base64.b64encode(b"\x00\xffbin").decode(),
    "strs": ["a", "b"],
    "mixed": [1, 1.5, "x", True, None],
    "empty_array": [],
    "null": None,
    "map.a": 1,
    "map.b.c": "deep",
    "map.d": [1, 2],
    "structs.0.name": "primary",
    "structs.0.value": 1.0,
    "structs.1": [1, 2],
}


def full_request() -> ExportTraceServiceRequest:
    span = OtlpSpan(
        trace_id=TRACE,
        span_id=SPAN,
        parent_span_id=PARENT,
        trace_state="vendor=abc, other=1",
        flags=SpanFlags.SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK | SpanFlags.SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK | 0x01,
        name="llm call",
        kind=OtlpSpan.SPAN_KIND_CLIENT,
        start_time_unix_nano=T0,
        end_time_unix_nano=T0 + 1_500_000_000,
        attributes=attrs(EVERY_KIND),
        events=[
            OtlpSpan.Event(name="token", time_unix_nano=T0 + 1000, attributes=attrs({"n": 3})),
            OtlpSpan.Event(name="untimed"),
        ],
        links=[
            OtlpSpan.Link(
                trace_id=LINK_TRACE,
                span_id=LINK_SPAN,
                trace_state="k=v",
                attributes=attrs({"why": "retry"}),
                flags=SpanFlags.SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK,  # known to be local
            )
        ],
        status=Status(code=Status.STATUS_CODE_ERROR, message="boom"),
    )
    return ExportTraceServiceRequest(
        resource_spans=[
            ResourceSpans(
                resource=OtlpResource(attributes=attrs({**IDS, "service.name": "agent"})),
                schema_url="https://opentelemetry.io/schemas/1.26.0",
                scope_spans=[ScopeSpans(scope=InstrumentationScope(name="my.lib", version="2.0"), spans=[span])],
            )
        ]
    )


EXPECTED = Span(
    rollout_id="ro-1",
    attempt_id="at-1",
    sequence_id=0,
    trace_id=TRACE.hex(),
    span_id=SPAN.hex(),
    parent_id=PARENT.hex(),
    name="llm call",
    kind="CLIENT",
    status=SpanStatus(status_code="ERROR", description="boom"),
    attributes=EVERY_KIND_DECODED,
    events=[
        SpanEvent(name="token", attributes={"n": 3}, timestamp=(T0 + 1000) / 10**9),
        SpanEvent(name="untimed", attributes={}, timestamp=None),
    ],
    links=[
        SpanLink(
            context=SpanContext(
                trace_id=LINK_TRACE.hex(), span_id=LINK_SPAN.hex(), is_remote=False, trace_state={"k": "v"}
            ),
            attributes={"why": "retry"},
        )
    ],
    start_time=T0 / 10**9,
    end_time=(T0 + 1_500_000_000) / 10**9,
    context=SpanContext(trace_id=TRACE.hex(), span_id=SPAN.hex(), trace_state={"vendor": "abc", "other": "1"}),
    parent=SpanContext(trace_id=TRACE.hex(), span_id=PARENT.hex(), is_remote=True),
    resource=OtelResource(
        attributes={**IDS, "service.name": "agent"}, schema_url="https://opentelemetry.io/schemas/1.26.0"
    ),
    scope_name="my.lib",
    scope_version="2.0",
)


def assert_same_types(got: Any, want: Any) -> None:
    """Equal, and bool/int/float kept apart (1 == 1.0 == True in Python)."""
    assert got == want
    assert type(got) is type(want), (got, want)
    if isinstance(want, dict):
        for key in want:
            assert_same_types(got[key], want[key])
    elif isinstance(want, list):
        for g, w in zip(got, want, strict=True):
            assert_same_types(g, w)
    elif isinstance(want, float) and want == 0:
        assert math.copysign(1, got) == math.copysign(1, want)


def test_protobuf_request_decodes_every_field() -> None:
    decoded = otlp.decode_body(full_request().SerializeToString(), "protobuf")
    assert not decoded.rejected
    [one] = decoded.spans
    assert one.needs_sequence_id
    assert one.span == EXPECTED
    assert_same_types(one.span.attributes, EXPECTED.attributes)


def otlp_json(request: ExportTraceServiceRequest) -> dict[str, Any]:
    """The OTLP JSON encoding of a request, as an OTLP JSON exporter writes it: hex ids,
    int64 as strings (protobuf's mapping does that), enums as integers."""
    document = json_format.MessageToDict(request, use_integers_for_enums=True)
    for resource_spans in document["resourceSpans"]:
        for scope_spans in resource_spans["scopeSpans"]:
            for span in scope_spans["spans"]:
                for item in [span, *span.get("links", [])]:
                    for key in ("traceId", "spanId", "parentSpanId"):
                        if key in item:
                            item[key] = base64.b64decode(item[key]).hex()
    return document


def test_json_request_decodes_like_protobuf() -> None:
    document = otlp_json(full_request())
    span_json = document["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert span_json["traceId"] == TRACE.hex()
    assert span_json["startTimeUnixNano"] == str(T0)
    assert span_json["kind"] == 3
    document["someFutureField"] = {"x": 1}  # unknown fields are ignored, as the spec asks
    decoded = otlp.decode_body(json.dumps(document).encode(), "json")
    [one] = decoded.spans
    assert one.span == EXPECTED
    assert_same_types(one.span.attributes, EXPECTED.attributes)


def test_json_request_with_snake_case_names_numbers_and_enum_names() -> None:
    document = {
        "resource_spans": [
            {
                "resource": {"attributes": [{"key": k, "value": {"stringValue": v}} for k, v in IDS.items()]},
                "scope_spans": [
                    {
                        "spans": [
                            {
                                "trace_id": TRACE.hex().upper(),
                                "span_id": SPAN.hex(),
                                "parent_span_id": "",
                                "name": "root",
                                "kind": "SPAN_KIND_SERVER",
                                "start_time_unix_nano": T0,
                                "attributes": [{"key": "n", "value": {"int_value": 7}}],
                            }
                        ]
                    }
                ],
            }
        ]
    }
    [one] = otlp.decode_body(json.dumps(document).encode(), "json").spans
    assert (one.span.trace_id, one.span.parent_id, one.span.parent) == (TRACE.hex(), None, None)
    assert (one.span.kind, one.span.start_time, one.span.end_time) == ("SERVER", T0 / 10**9, None)
    assert_same_types(one.span.attributes, {"n": 7})


def test_sdk_spans_decode_as_agl_stream_spans_converts_them() -> None:
    """What the real exporter sends equals what agl_stream.wire.spans makes of the same SDK spans."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({**IDS, "service.name": "sdk"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("agent.scope", "1.2.3")
    with tracer.start_as_current_span("outer", kind=SpanKind.SERVER, attributes={"f": 0.5, "xs": (1, 2)}) as outer:
        with tracer.start_as_current_span("inner", links=[Link(outer.get_span_context(), {"l": True})]) as inner:
            inner.add_event("ev", {"k": "v"})
            inner.set_status(StatusCode.OK)
    readable = memory.get_finished_spans()
    decoded = otlp.decode_body(encode_spans(readable).SerializeToString(), "protobuf")
    assert not decoded.rejected
    got = [d.span for d in decoded.spans]
    want = [span_from_otel(r, "ro-1", "at-1", 0) for r in readable]
    assert got == want
    assert got[0].parent_id == got[1].span_id  # inner ends first, so it is exported first


def request_with(
    span_attributes: dict[str, Any] | None = None,
    resource_attributes: dict[str, Any] | None = None,
    **fields: Any,
) -> ExportTraceServiceRequest:
    span = OtlpSpan(
        trace_id=fields.pop("trace_id", TRACE),
        span_id=fields.pop("span_id", SPAN),
        name="s",
        attributes=attrs(span_attributes or {}),
        **fields,
    )
    return ExportTraceServiceRequest(
        resource_spans=[
            ResourceSpans(
                resource=OtlpResource(attributes=attrs(IDS if resource_attributes is None else resource_attributes)),
                scope_spans=[ScopeSpans(spans=[span])],
            )
        ]
    )


def test_spans_without_rollout_or_attempt_id_are_rejected_and_counted() -> None:
    request = request_with(resource_attributes={"agentlightning.rollout_id": "ro-1"})
    request.resource_spans[0].scope_spans[0].spans.append(OtlpSpan(trace_id=TRACE, span_id=PARENT, name="b"))
    request.resource_spans.append(
        ResourceSpans(scope_spans=[ScopeSpans(spans=[OtlpSpan(trace_id=TRACE, span_id=SPAN)])])
    )
    decoded = otlp.decode_request(request)
    assert decoded.spans == []
    assert decoded.total == 3
    assert decoded.rejected_count == 3
    reasons = dict(decoded.rejected)
    assert sum(n for r, n in reasons.items() if "without agentlightning.attempt_id (" in r) == 2
    assert sum(n for r, n in reasons.items() if "agentlightning.rollout_id and agentlightning.attempt_id" in r) == 1
    message = otlp.rejection_message(decoded.rejected, decoded.total)
    assert message.startswith("rejected 3 of 3 spans: 2 without agentlightning.attempt_id")
    assert "TracerProvider" in message


def test_span_attributes_name_the_attempt_and_win_over_the_resource() -> None:
    only_span = otlp.decode_request(request_with(span_attributes=IDS, resource_attributes={}))
    assert [(d.span.rollout_id, d.span.attempt_id) for d in only_span.spans] == [("ro-1", "at-1")]
    override = otlp.decode_request(request_with(span_attributes={"agentlightning.attempt_id": "at-2"}))
    assert [(d.span.rollout_id, d.span.attempt_id) for d in override.spans] == [("ro-1", "at-2")]
    not_text = otlp.decode_request(request_with(span_attributes={"agentlightning.rollout_id": 5}))
    assert not not_text.spans and "not a non-empty string" in next(iter(not_text.rejected))


def test_own_sequence_ids_from_span_or_resource_attributes() -> None:
    from_span = otlp.decode_request(request_with(span_attributes={"agentlightning.span_sequence_id": 42}))
    assert [(d.span.sequence_id, d.needs_sequence_id) for d in from_span.spans] == [(42, False)]
    from_resource = otlp.decode_request(request_with(resource_attributes={**IDS, "agentlightning.span_sequence_id": 7}))
    assert [(d.span.sequence_id, d.needs_sequence_id) for d in from_resource.spans] == [(7, False)]
    for bad in ("3", -1, True, 1.0):
        decoded = otlp.decode_request(request_with(span_attributes={"agentlightning.span_sequence_id": bad}))
        assert not decoded.spans, bad
        assert "agentlightning.span_sequence_id is not a non-negative integer" in next(iter(decoded.rejected))


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"trace_id": bytes(16)}, "invalid trace id"),
        ({"trace_id": TRACE[:8]}, "invalid trace id"),
        ({"span_id": b""}, "invalid span id"),
        ({"parent_span_id": b"\x01\x02"}, "invalid parent span id"),
        ({"links": [OtlpSpan.Link(trace_id=TRACE, span_id=bytes(8))]}, "link whose trace or span id is invalid"),
    ],
)
def test_spans_with_invalid_ids_are_rejected(fields: dict[str, Any], reason: str) -> None:
    decoded = otlp.decode_request(request_with(**fields))
    assert not decoded.spans
    assert reason in next(iter(decoded.rejected))


def test_all_zero_parent_is_a_root_and_unspecified_kind_is_internal() -> None:
    [one] = otlp.decode_request(request_with(parent_span_id=bytes(8), kind=OtlpSpan.SPAN_KIND_UNSPECIFIED)).spans
    assert (one.span.parent_id, one.span.parent, one.span.kind) == (None, None, "INTERNAL")
    assert one.span.status == SpanStatus(status_code="UNSET", description=None)


def test_oversized_spans_are_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(otlp, "MAX_SPAN_BYTES", 1000)
    request = request_with(span_attributes={"big": "x" * 2000})
    request.resource_spans[0].scope_spans[0].spans.append(OtlpSpan(trace_id=TRACE, span_id=PARENT, name="small"))
    decoded = otlp.decode_request(request)
    assert [d.span.name for d in decoded.spans] == ["small"]
    assert dict(decoded.rejected) == {"over 1,000 bytes (span and resource; keep large payloads out of spans)": 1}


@pytest.mark.parametrize(
    ("body", "encoding", "match"),
    [
        (b"\x0a\x05abc", "protobuf", "not a protobuf ExportTraceServiceRequest"),
        (b"\xff\xfe garbage", "protobuf", "not a protobuf ExportTraceServiceRequest"),
        (b"{not json", "json", "not JSON"),
        (b"[1, 2]", "json", "not a list"),
        (b'{"resourceSpans": {"a": 1}}', "json", "resourceSpans must be a JSON array"),
        (b'{"resourceSpans": [{"scopeSpans": [{"spans": [1]}]}]}', "json", r"spans\[0\] must be a JSON object"),
        (
            json.dumps(
                {"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": base64.b64encode(TRACE).decode()}]}]}]}
            ).encode(),
            "json",
            r"resourceSpans\[0\]\.scopeSpans\[0\]\.spans\[0\]\.traceId is .*not hex",
        ),
        (b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"spanId": 12}]}]}]}', "json", "must be a hex string"),
        (b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"name": 5}]}]}]}', "json", "not an OTLP"),
    ],
)
def test_malformed_bodies_raise_a_typed_error(body: bytes, encoding: otlp.Encoding, match: str) -> None:
    with pytest.raises(otlp.MalformedOtlpError, match=match) as caught:
        otlp.decode_body(body, encoding)
    assert isinstance(caught.value, AglError)
    assert isinstance(caught.value, ValueError)


def test_empty_requests_decode_to_nothing() -> None:
    assert otlp.decode_body(b"", "protobuf").total == 0
    assert otlp.decode_body(b"{}", "json").total == 0


def test_content_types_and_encodings() -> None:
    assert otlp.content_encoding("application/x-protobuf") == "protobuf"
    assert otlp.content_encoding("Application/JSON; charset=utf-8") == "json"
    for bad in (None, "text/plain", "application/grpc"):
        with pytest.raises(otlp.UnsupportedOtlpContentError, match="application/x-protobuf"):
            otlp.content_encoding(bad)
    body = full_request().SerializeToString()
    assert otlp.decompress(body, None) == body
    assert otlp.decompress(gzip.compress(body), "gzip") == body
    with pytest.raises(otlp.MalformedOtlpError, match="not valid gzip"):
        otlp.decompress(body, "gzip")
    with pytest.raises(otlp.MalformedOtlpError, match="truncated"):
        otlp.decompress(gzip.compress(body)[:-12], "gzip")
    with pytest.raises(otlp.UnsupportedOtlpContentError, match="gzip"):
        otlp.decompress(body, "br")
    with pytest.raises(otlp.OtlpTooLargeError, match="max_export_batch_size"):
        otlp.decompress(gzip.compress(bytes(10_000)), "gzip", limit=1000)  # stops inflating at the limit
    with pytest.raises(otlp.OtlpTooLargeError):
        otlp.decompress(bytes(1001), None, limit=1000)


def test_responses_in_both_encodings() -> None:
    assert otlp.export_response(0, "", "json") == b"{}"
    assert otlp.export_response(0, "", "protobuf") == b""
    assert json.loads(otlp.export_response(2, "why", "json")) == {
        "partialSuccess": {"rejectedSpans": "2", "errorMessage": "why"}
    }
    response = ExportTraceServiceResponse.FromString(otlp.export_response(0, "a warning", "protobuf"))
    assert response.HasField("partial_success")
    assert (response.partial_success.rejected_spans, response.partial_success.error_message) == (0, "a warning")
    status = status_pb2.Status.FromString(otlp.error_status(otlp.GRPC_INVALID_ARGUMENT, "bad"))
    assert (status.code, status.message) == (3, "bad")
