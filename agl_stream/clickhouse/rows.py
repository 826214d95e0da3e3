"""Pure mappings from decoded records to ClickHouse rows (column order = the *_COLUMNS lists)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

SPAN_COLUMNS: tuple[str, ...] = (
    "Timestamp",
    "TraceId",
    "SpanId",
    "ParentSpanId",
    "TraceState",
    "SpanName",
    "SpanKind",
    "ServiceName",
    "ResourceAttributes",
    "ScopeName",
    "ScopeVersion",
    "SpanAttributes",
    "Duration",
    "StatusCode",
    "StatusMessage",
    "Events.Timestamp",
    "Events.Name",
    "Events.Attributes",
    "Links.TraceId",
    "Links.SpanId",
    "Links.TraceState",
    "Links.Attributes",
    "RolloutId",
    "AttemptId",
    "SequenceId",
    "KafkaPartition",
    "KafkaOffset",
)

# The OpenTelemetry Collector's exporter writes pdata's String() of these enums.
_STATUS = {"UNSET": "Unset", "OK": "Ok", "ERROR": "Error"}
_KIND = {
    "INTERNAL": "Internal",
    "SERVER": "Server",
    "CLIENT": "Client",
    "PRODUCER": "Producer",
    "CONSUMER": "Consumer",
    "UNSPECIFIED": "Unspecified",
}


def attribute_text(value: Any) -> str:
    """An OTel attribute value as the exporter stores it: strings as-is, the rest as JSON."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value, separators=(",", ":"))


def attributes_text(attributes: Mapping[str, Any] | None) -> dict[str, str]:
    if not attributes:
        return {}
    return {k: v if isinstance(v, str) else attribute_text(v) for k, v in attributes.items()}


def nanos(seconds: float | None) -> int:
    return 0 if seconds is None else round(seconds * 1_000_000_000)


def _trace_state(context: Mapping[str, Any] | None) -> str:
    if not context or not context.get("trace_state"):
        return ""
    return ",".join(f"{k}={v}" for k, v in context["trace_state"].items())


def span_row(span: Mapping[str, Any], partition: int, offset: int) -> list[Any]:
    """One decoded ``agl.Span`` (a dict, as the codec's fast path returns it) -> an otel_traces row."""
    start = nanos(span.get("start_time"))
    end = nanos(span.get("end_time"))
    resource = span.get("resource") or {}
    resource_attributes = attributes_text(resource.get("attributes"))
    status = span.get("status") or {}
    events: Sequence[Mapping[str, Any]] = span.get("events") or ()
    links: Sequence[Mapping[str, Any]] = span.get("links") or ()
    return [
        start,
        span["trace_id"],
        span["span_id"],
        span.get("parent_id") or "",
        _trace_state(span.get("context")),
        span["name"],
        _KIND.get(str(span.get("kind") or "INTERNAL").upper(), str(span.get("kind"))),
        resource_attributes.get("service.name", ""),
        resource_attributes,
        span.get("scope_name") or "",
        span.get("scope_version") or "",
        attributes_text(span.get("attributes")),
        max(0, end - start) if end else 0,
        _STATUS.get(str(status.get("status_code") or "UNSET"), "Unset"),
        status.get("description") or "",
        [nanos(e.get("timestamp")) for e in events],
        [e.get("name", "") for e in events],
        [attributes_text(e.get("attributes")) for e in events],
        [(link.get("context") or {}).get("trace_id", "") for link in links],
        [(link.get("context") or {}).get("span_id", "") for link in links],
        [_trace_state(link.get("context")) for link in links],
        [attributes_text(link.get("attributes")) for link in links],
        span["rollout_id"],
        span["attempt_id"],
        span["sequence_id"],
        partition,
        offset,
    ]
