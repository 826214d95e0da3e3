"""OTLP/HTTP trace export requests -> agl Span records. Pure: no I/O, no clock, no store.

The gateway's ``POST /v1/traces`` (consumers/gateway.py) reads the body, hands it here, then
reserves sequence ids and writes what comes back. Both encodings of the OTLP/HTTP spec are
read: binary protobuf (``application/x-protobuf``) and the OTLP JSON mapping
(``application/json``), which differs from protobuf's own JSON mapping in that trace and span
ids are hex, not base64 (lowerCamelCase and snake_case field names, int64 as strings or numbers
and enums as integers or names are all accepted, as the spec asks of receivers). Bodies may be
gzip-compressed (``Content-Encoding: gzip``, one member or several).

Field conventions follow agl_stream/wire/spans.py (SDK spans): times in float seconds (``None`` for
an unset 0), hex ids, kind and status code by name (``SPAN_KIND_UNSPECIFIED`` reads as
``INTERNAL``, as the OpenTelemetry spec allows). Attribute values keep their types: string, bool,
int, double, bytes (as base64 text, as OTLP JSON carries them), arrays of those as lists. Our
model has no maps and no nested arrays, so a ``kvlist`` is flattened into dotted keys
(``{"a": {"b": 1}}`` -> ``"a.b": 1``, the convention of OpenTelemetry's map-valued semantic
attributes) and an array holding a kvlist or an array into indexed keys (``"a.0.b"``, Agent
Lightning's own layout: ``agentlightning.reward.0.value``); an empty kvlist leaves no key, and a
flattened key replaces an equal key that came before it.

A span belongs to the attempt named by the attributes ``agentlightning.rollout_id`` and
``agentlightning.attempt_id``: resource attributes (set once on the TracerProvider), or span
attributes, which win. A span may carry its own ``agentlightning.span_sequence_id`` (a span
or, as Agent Lightning's own exporter sends it, a resource attribute); the others come back
flagged for the caller to number. Spans that cannot be stored (no rollout or attempt
id, invalid ids, too large) are rejected and counted by reason, never raised: OTLP reports them
in ``partial_success``. A body that is not an export request at all raises
:class:`MalformedOtlpError`.
"""

from __future__ import annotations

import base64
import json
import zlib
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

# No stubs for protobuf's runtime here (types-protobuf is not a dependency): untyped on purpose.
from google.protobuf import json_format  # type: ignore[import-untyped]
from google.protobuf.message import DecodeError  # type: ignore[import-untyped]
from google.rpc import code_pb2, status_pb2  # type: ignore[import-untyped]
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ScopeSpans, SpanFlags, Status
from opentelemetry.proto.trace.v1.trace_pb2 import Span as OtlpSpan
from pydantic import ValidationError

from agl_stream.errors import AglError
from agl_stream.models import Span
from agl_stream.models.spans import Attributes, OtelResource, SpanContext, SpanEvent, SpanLink, SpanStatus
from agl_stream.wire.semconv import ATTEMPT_ID_KEY, ROLLOUT_ID_KEY, SEQUENCE_ID_KEY

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
Encoding: TypeAlias = Literal["protobuf", "json"]

MAX_BODY_BYTES = 32 << 20
"""Largest request body, after decompression. The SDKs' batch exporters send at most 512 spans
per request by default, far below this; the cap bounds a gateway's memory per request (and
what a gzip bomb can cost)."""

MAX_SPAN_BYTES = 2 << 20
"""Largest span, counted as its protobuf size plus its resource's (our record repeats the
resource in every span). The Avro record is about as large, and it must fit in one produce
request (``producer_max_request_size``, 4 MiB by default) and in agl.spans' 8 MiB messages."""

_NANOS = 1_000_000_000
_KINDS = {
    OtlpSpan.SPAN_KIND_INTERNAL: "INTERNAL",
    OtlpSpan.SPAN_KIND_SERVER: "SERVER",
    OtlpSpan.SPAN_KIND_CLIENT: "CLIENT",
    OtlpSpan.SPAN_KIND_PRODUCER: "PRODUCER",
    OtlpSpan.SPAN_KIND_CONSUMER: "CONSUMER",
}
_STATUS_CODES = {Status.STATUS_CODE_OK: "OK", Status.STATUS_CODE_ERROR: "ERROR"}
_HAS_IS_REMOTE = SpanFlags.SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK
_IS_REMOTE = SpanFlags.SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK


class OtlpError(AglError, ValueError):
    """An OTLP/HTTP request the gateway cannot read; the message says what to change."""


class MalformedOtlpError(OtlpError):
    """The body is not an ExportTraceServiceRequest in the encoding its Content-Type names (HTTP 400)."""


class OtlpTooLargeError(OtlpError):
    """The body is over :data:`MAX_BODY_BYTES` (HTTP 413)."""


class UnsupportedOtlpContentError(OtlpError):
    """A Content-Type or Content-Encoding that OTLP/HTTP does not define (HTTP 415)."""


# -- the request ---------------------------------------------------------------------------


def content_encoding(content_type: str | None) -> Encoding:
    """Which OTLP encoding a Content-Type header names (parameters such as charset ignored)."""
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    if media_type == PROTOBUF:
        return "protobuf"
    if media_type == JSON:
        return "json"
    raise UnsupportedOtlpContentError(
        f"unsupported Content-Type {content_type or '(none)'!r}: OTLP/HTTP sends traces as {PROTOBUF} or {JSON}"
    )


def decompress(body: bytes, content_encoding_header: str | None, *, limit: int = MAX_BODY_BYTES) -> bytes:
    """The body without its Content-Encoding (gzip or none), refused once over ``limit`` bytes."""
    coding = (content_encoding_header or "identity").strip().lower()
    if coding == "identity":
        data = body
    elif coding in ("gzip", "x-gzip"):
        data = _gunzip(body, limit)
    else:
        raise UnsupportedOtlpContentError(
            f"unsupported Content-Encoding {content_encoding_header!r}: OTLP/HTTP bodies are sent as is or as gzip"
        )
    if len(data) > limit:
        raise OtlpTooLargeError(
            f"the request is over {limit:,} bytes uncompressed: export fewer spans per request "
            "(the SDK batch processor's max_export_batch_size)"
        )
    return data


_GZIP_CHUNK = 64 << 10
MAX_GZIP_MEMBERS = 1000
"""Gzip members one body may hold (RFC 1952: a gzip stream is one or more members, read as
one). SDKs send one; the cap bounds the work of a body made of many tiny members."""


def _gunzip(body: bytes, limit: int) -> bytes:
    """Every member of a gzip body, stopping once past ``limit`` bytes of output. Fed in chunks,
    so what zlib copies of the input after each member's end stays small."""
    view = memoryview(body)
    parts: list[bytes] = []
    size = position = members = 0
    while members == 0 or position < len(view):
        members += 1
        if members > MAX_GZIP_MEMBERS:
            raise MalformedOtlpError(f"the gzip body has more than {MAX_GZIP_MEMBERS} members: send one")
        inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        while not inflater.eof:
            if position >= len(view):
                raise MalformedOtlpError("the gzip body is truncated: send the whole compressed request")
            chunk = view[position : position + _GZIP_CHUNK]
            position += len(chunk)
            try:
                part = inflater.decompress(chunk, limit + 1 - size)
            except zlib.error as error:
                where = "the body" if members == 1 else f"gzip member {members} of the body"
                raise MalformedOtlpError(
                    f"{where} is not valid gzip ({error}); send it as Content-Encoding: gzip"
                ) from error
            parts.append(part)
            size += len(part)
            if size > limit:
                return b"".join(parts)  # decompress() refuses it as too large
        position -= len(inflater.unused_data)
    return b"".join(parts)


def parse_request(body: bytes, encoding: Encoding) -> ExportTraceServiceRequest:
    """An ExportTraceServiceRequest from an (uncompressed) body."""
    if encoding == "protobuf":
        try:
            return ExportTraceServiceRequest.FromString(body)
        except DecodeError as error:
            raise MalformedOtlpError(
                f"the body is not a protobuf ExportTraceServiceRequest ({error}); is the Content-Type right?"
            ) from error
    try:
        document = json.loads(body)
    except (UnicodeDecodeError, ValueError) as error:
        raise MalformedOtlpError(f"the body is not JSON: {error}") from error
    except RecursionError:
        raise MalformedOtlpError("the body is JSON nested too deeply to be an OTLP request") from None
    if not isinstance(document, dict):
        raise MalformedOtlpError(
            f"an OTLP JSON request is an object with resourceSpans, not a {type(document).__name__}"
        )
    _hex_ids_to_base64(document)
    request = ExportTraceServiceRequest()
    try:
        # The spec asks receivers to ignore unknown fields (newer senders add some).
        json_format.ParseDict(document, request, ignore_unknown_fields=True)
    except json_format.ParseError as error:
        raise MalformedOtlpError(f"the JSON body is not an OTLP ExportTraceServiceRequest: {error}") from error
    return request


def _hex_ids_to_base64(document: dict[str, Any]) -> None:
    """OTLP JSON writes ids as hex; protobuf's JSON mapping, which does the rest, reads base64."""
    for i, resource_spans in enumerate(_items(document, "resourceSpans", "resource_spans", "")):
        where = f"resourceSpans[{i}]"
        for j, scope_spans in enumerate(_items(resource_spans, "scopeSpans", "scope_spans", where)):
            for k, span in enumerate(_items(scope_spans, "spans", "spans", f"{where}.scopeSpans[{j}]")):
                at = f"{where}.scopeSpans[{j}].spans[{k}]"
                _convert_ids(span, at, ("traceId", "trace_id", "spanId", "span_id", "parentSpanId", "parent_span_id"))
                for m, link in enumerate(_items(span, "links", "links", at)):
                    _convert_ids(link, f"{at}.links[{m}]", ("traceId", "trace_id", "spanId", "span_id"))


def _items(parent: dict[str, Any], camel: str, snake: str, where: str) -> list[dict[str, Any]]:
    name = camel if camel in parent else snake
    value = parent.get(name)
    if value is None:
        return []
    path = f"{where}.{camel}" if where else camel
    if not isinstance(value, list):
        raise MalformedOtlpError(f"{path} must be a JSON array, not {type(value).__name__}")
    for index, item in enumerate(value):
        if not isinstance(item, dict):
            raise MalformedOtlpError(f"{path}[{index}] must be a JSON object, not {type(item).__name__}")
    return value


def _convert_ids(message: dict[str, Any], where: str, names: Iterable[str]) -> None:
    for name in names:
        value = message.get(name)
        if value is None:
            continue
        if not isinstance(value, str):
            raise MalformedOtlpError(f"{where}.{name} must be a hex string, not {type(value).__name__}")
        try:
            raw = bytes.fromhex(value)
        except ValueError:
            raise MalformedOtlpError(
                f"{where}.{name} is {value[:64]!r}, not hex: OTLP JSON writes trace and span ids as hex "
                "(not base64 as protobuf's own JSON mapping would)"
            ) from None
        message[name] = base64.b64encode(raw).decode("ascii")


# -- spans ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodedSpan:
    """One span of the request. Without a sequence id of its own, ``span.sequence_id`` is 0 and
    the caller numbers it (``span.model_copy(update={"sequence_id": n})``)."""

    span: Span
    needs_sequence_id: bool


@dataclass
class DecodedTraces:
    """The spans of a request that can be stored, and how many were rejected for which reason."""

    spans: list[DecodedSpan] = field(default_factory=list)
    rejected: Counter[str] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return len(self.spans) + self.rejected_count

    @property
    def rejected_count(self) -> int:
        return sum(self.rejected.values())


def rejection_message(rejected: Mapping[str, int], total: int) -> str:
    """The ``partial_success.error_message`` for ``rejected`` (reason -> count) out of ``total``."""
    if not rejected:
        return ""
    count = sum(rejected.values())
    reasons = "; ".join(f"{n} {reason}" for reason, n in sorted(rejected.items(), key=lambda item: -item[1]))
    return f"rejected {count} of {total} spans: {reasons}"


def decode_request(request: ExportTraceServiceRequest) -> DecodedTraces:
    """Every span of ``request`` as an agl Span of its attempt, or a counted rejection."""
    result = DecodedTraces()
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        otel_resource = OtelResource(attributes=resource, schema_url=resource_spans.schema_url)
        resource_bytes = resource_spans.resource.ByteSize()
        for scope_spans in resource_spans.scope_spans:
            for otlp_span in scope_spans.spans:
                if otlp_span.ByteSize() + resource_bytes > MAX_SPAN_BYTES:
                    result.rejected[
                        f"over {MAX_SPAN_BYTES:,} bytes (span and resource; keep large payloads out of spans)"
                    ] += 1
                    continue
                decoded = _decode_span(otlp_span, resource, otel_resource, scope_spans)
                if isinstance(decoded, str):
                    result.rejected[decoded] += 1
                else:
                    result.spans.append(decoded)
    return result


def decode_body(body: bytes, encoding: Encoding) -> DecodedTraces:
    """:func:`parse_request` then :func:`decode_request`."""
    return decode_request(parse_request(body, encoding))


def _decode_span(
    otlp: OtlpSpan,
    resource: Attributes,
    otel_resource: OtelResource,
    scope_spans: ScopeSpans,
) -> DecodedSpan | str:
    """The span, or the reason it is rejected."""
    attributes = _attributes(otlp.attributes)
    rollout_id = attributes.get(ROLLOUT_ID_KEY, resource.get(ROLLOUT_ID_KEY))
    attempt_id = attributes.get(ATTEMPT_ID_KEY, resource.get(ATTEMPT_ID_KEY))
    missing = [key for key, value in ((ROLLOUT_ID_KEY, rollout_id), (ATTEMPT_ID_KEY, attempt_id)) if value is None]
    if missing:
        return (
            f"without {' and '.join(missing)} (set both as resource attributes of the TracerProvider, "
            "or as span attributes)"
        )
    if not isinstance(rollout_id, str) or not rollout_id or not isinstance(attempt_id, str) or not attempt_id:
        return f"whose {ROLLOUT_ID_KEY} or {ATTEMPT_ID_KEY} is not a non-empty string"
    sequence_id = attributes.get(SEQUENCE_ID_KEY, resource.get(SEQUENCE_ID_KEY))
    if sequence_id is not None and (type(sequence_id) is not int or sequence_id < 0):
        return f"whose {SEQUENCE_ID_KEY} is not a non-negative integer"
    if not _valid_id(otlp.trace_id, 16):
        return "with an invalid trace id (16 bytes, not all zero)"
    if not _valid_id(otlp.span_id, 8):
        return "with an invalid span id (8 bytes, not all zero)"
    if otlp.parent_span_id and len(otlp.parent_span_id) != 8:
        return "with an invalid parent span id (8 bytes, or empty for a root span)"
    if any(not _valid_id(link.trace_id, 16) or not _valid_id(link.span_id, 8) for link in otlp.links):
        return "with a link whose trace or span id is invalid"
    trace_id = otlp.trace_id.hex()
    has_parent = bool(otlp.parent_span_id) and any(otlp.parent_span_id)
    parent = (
        SpanContext(
            trace_id=trace_id,
            span_id=otlp.parent_span_id.hex(),
            # In a span's flags these bits describe its parent's context (trace.proto).
            is_remote=_is_remote(otlp.flags),
        )
        if has_parent
        else None
    )
    try:
        span = Span(
            rollout_id=rollout_id,
            attempt_id=attempt_id,
            sequence_id=sequence_id if sequence_id is not None else 0,
            trace_id=trace_id,
            span_id=otlp.span_id.hex(),
            parent_id=parent.span_id if parent else None,
            name=otlp.name,
            kind=_KINDS.get(otlp.kind, "INTERNAL"),
            status=SpanStatus(
                status_code=_STATUS_CODES.get(otlp.status.code, "UNSET"), description=otlp.status.message or None
            ),
            attributes=attributes,
            events=[
                SpanEvent(
                    name=event.name, attributes=_attributes(event.attributes), timestamp=_seconds(event.time_unix_nano)
                )
                for event in otlp.events
            ],
            links=[
                SpanLink(
                    context=SpanContext(
                        trace_id=link.trace_id.hex(),
                        span_id=link.span_id.hex(),
                        is_remote=_is_remote(link.flags),
                        trace_state=_trace_state(link.trace_state),
                    ),
                    attributes=_attributes(link.attributes),
                )
                for link in otlp.links
            ],
            start_time=_seconds(otlp.start_time_unix_nano),
            end_time=_seconds(otlp.end_time_unix_nano),
            context=SpanContext(
                trace_id=trace_id, span_id=otlp.span_id.hex(), trace_state=_trace_state(otlp.trace_state)
            ),
            parent=parent,
            resource=otel_resource,
            scope_name=scope_spans.scope.name,
            scope_version=scope_spans.scope.version,
        )
    except ValidationError as error:  # not expected: every field above is checked or typed
        first = error.errors()[0]
        return f"that do not make a valid span ({'.'.join(map(str, first['loc']))}: {first['msg']})"
    return DecodedSpan(span=span, needs_sequence_id=sequence_id is None)


def _valid_id(raw: bytes, size: int) -> bool:
    return len(raw) == size and any(raw)


def _is_remote(flags: int) -> bool:
    return bool(flags & _HAS_IS_REMOTE) and bool(flags & _IS_REMOTE)


def _seconds(nanos: int) -> float | None:
    # OTLP has no "unset" for fixed64: 0 is how a sender says it (an open span's end).
    return nanos / _NANOS if nanos else None


def _trace_state(header: str) -> dict[str, str]:
    """A W3C tracestate header as a dict; members that are not key=value are skipped."""
    state: dict[str, str] = {}
    for member in header.split(","):
        key, sep, value = member.strip().partition("=")
        if sep and key:
            state[key] = value
    return state


def _attributes(pairs: Iterable[KeyValue]) -> Attributes:
    out: Attributes = {}
    for pair in pairs:
        _put(out, pair.key, pair.value)
    return out


def _put(out: Attributes, key: str, value: AnyValue) -> None:
    kind = value.WhichOneof("value")
    if kind == "kvlist_value":
        for pair in value.kvlist_value.values:
            _put(out, f"{key}.{pair.key}", pair.value)
    elif kind == "array_value":
        items = value.array_value.values
        if any(item.WhichOneof("value") in ("kvlist_value", "array_value") for item in items):
            for index, item in enumerate(items):
                _put(out, f"{key}.{index}", item)
        else:
            out[key] = [_scalar(item) for item in items]
    else:
        out[key] = _scalar(value)


def _scalar(value: AnyValue) -> str | bool | int | float | None:
    kind = value.WhichOneof("value")
    if kind == "string_value":
        return value.string_value
    if kind == "bool_value":
        return value.bool_value
    if kind == "int_value":
        return value.int_value
    if kind == "double_value":
        return value.double_value
    if kind == "bytes_value":
        return base64.b64encode(value.bytes_value).decode("ascii")
    return None  # an empty AnyValue: OTLP's null


# -- responses -----------------------------------------------------------------------------


def export_response(rejected: int, message: str, encoding: Encoding) -> bytes:
    """An ExportTraceServiceResponse; ``partial_success`` only when something is to be said
    (the spec: rejected 0 with a message is a warning, and a full success leaves it unset)."""
    response = ExportTraceServiceResponse()
    if rejected or message:
        response.partial_success.rejected_spans = rejected
        response.partial_success.error_message = message
    if encoding == "protobuf":
        return response.SerializeToString()
    return json_format.MessageToJson(response, indent=None).encode()


GRPC_INVALID_ARGUMENT = code_pb2.INVALID_ARGUMENT
GRPC_RESOURCE_EXHAUSTED = code_pb2.RESOURCE_EXHAUSTED
GRPC_UNAVAILABLE = code_pb2.UNAVAILABLE
GRPC_INTERNAL = code_pb2.INTERNAL


def error_status(code: int, message: str) -> bytes:
    """A protobuf ``google.rpc.Status``: the body OTLP/HTTP gives protobuf clients on failure."""
    return status_pb2.Status(code=code, message=message).SerializeToString()
