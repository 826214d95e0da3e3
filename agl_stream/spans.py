"""OpenTelemetry SDK spans -> agl Span records (the seed's Span.from_opentelemetry, our way)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agl_stream.models import Span
from agl_stream.models.spans import OtelResource, SpanContext, SpanEvent, SpanLink, SpanStatus

_NANOS = 1_000_000_000


def _seconds(nanos: int | None) -> float | None:
    return None if nanos is None else nanos / _NANOS


def _attributes(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    # OTel attribute values are scalars or homogeneous sequences (often tuples): lists here.
    return {k: list(v) if isinstance(v, (tuple, list)) else v for k, v in (attributes or {}).items()}


def _context(context: Any) -> SpanContext | None:
    if context is None:
        return None
    return SpanContext(
        trace_id=f"{context.trace_id:032x}",
        span_id=f"{context.span_id:016x}",
        is_remote=bool(context.is_remote),
        trace_state=dict(context.trace_state.items()) if context.trace_state else {},
    )


def span_from_otel(readable: Any, rollout_id: str, attempt_id: str, sequence_id: int) -> Span:
    """Convert an ``opentelemetry.sdk.trace.ReadableSpan`` of one attempt."""
    context = _context(readable.context)
    assert context is not None, "a ReadableSpan always has a context"
    parent = _context(readable.parent)
    status = readable.status
    resource = readable.resource
    scope = getattr(readable, "instrumentation_scope", None)
    return Span(
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        sequence_id=sequence_id,
        trace_id=context.trace_id,
        span_id=context.span_id,
        parent_id=parent.span_id if parent else None,
        name=readable.name,
        kind=readable.kind.name,
        status=SpanStatus(status_code=status.status_code.name, description=status.description),
        attributes=_attributes(readable.attributes),
        events=[
            SpanEvent(name=e.name, attributes=_attributes(e.attributes), timestamp=_seconds(e.timestamp))
            for e in readable.events
        ],
        links=[
            SpanLink(context=_context(link.context), attributes=_attributes(link.attributes))  # type: ignore[arg-type]
            for link in readable.links
        ],
        start_time=_seconds(readable.start_time),
        end_time=_seconds(readable.end_time),
        context=context,
        parent=parent,
        resource=OtelResource(
            attributes=_attributes(resource.attributes) if resource else {},
            schema_url=(resource.schema_url or "") if resource else "",
        ),
        scope_name=scope.name if scope else "",
        scope_version=(scope.version or "") if scope else "",
    )
