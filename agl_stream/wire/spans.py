"""OpenTelemetry SDK spans -> agl Span records (the seed's Span.from_opentelemetry, our way).

Two ways to one result. Validating the models (``Span(...)`` with its nested models) cost the
runner ~40 us per span, for data the SDK has already cleaned: ids are ints, the kind and status
code are enums, attribute values are str, bool, int, float or tuples of them. So
:func:`span_from_otel` first checks by hand exactly what validation would refuse or change
(exact types, int64 range, the epoch range of times, hex ids of the right width) and builds the
models without validation; the first thing it does not find plain (a subclass, a value out of
range, a type the SDK should not let through) sends the span down the validated path, which
gives the same model or the ValidationError it always gave. ``tests/unit/test_spans.py`` holds
both paths equal.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel

from agl_stream.models import Span
from agl_stream.models.base import MAX_EPOCH_SECONDS
from agl_stream.models.spans import OtelResource, SpanContext, SpanEvent, SpanLink, SpanStatus

_NANOS = 1_000_000_000
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_TRACE_ID_END, _SPAN_ID_END = 2**128, 2**64  # ids at or past these are no 32/16 hex digits
_STATUS_CODES = frozenset({"UNSET", "OK", "ERROR"})


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
    """Convert an ``opentelemetry.sdk.trace.ReadableSpan`` of one attempt (ValidationError if
    it holds what a Span cannot)."""
    try:
        return _plain_span(readable, rollout_id, attempt_id, sequence_id)
    except (_NotPlain, AttributeError, TypeError):  # not what the SDK makes: validation says what it is
        return _validated_span(readable, rollout_id, attempt_id, sequence_id)


def _validated_span(readable: Any, rollout_id: str, attempt_id: str, sequence_id: int) -> Span:
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


# --------------------------------------------------------------------------------------------
# The plain path: checked by hand, built without validation
# --------------------------------------------------------------------------------------------


class _NotPlain(Exception):
    """Something validation would look at: the validated path decides."""


M = TypeVar("M", bound=BaseModel)

_FIELD_SETS: dict[type[BaseModel], frozenset[str]] = {
    model: frozenset(model.model_fields) for model in (Span, SpanContext, SpanStatus, SpanEvent, SpanLink, OtelResource)
}


def _slot_setters() -> tuple[Callable[[Any, Any], None], ...] | None:
    """Setters of what ``model_construct`` sets on an instance (BaseModel's four slots), when
    these models are plain enough for that to be all: no private attributes, no post-init hook,
    no root model. None otherwise (another pydantic, other models): then ``model_construct``."""
    if any(
        model.__pydantic_root_model__ or model.__pydantic_post_init__ is not None or model.__private_attributes__
        for model in _FIELD_SETS
    ):
        return None
    try:
        return tuple(
            BaseModel.__dict__[slot].__set__
            for slot in ("__dict__", "__pydantic_fields_set__", "__pydantic_extra__", "__pydantic_private__")
        )
    except (KeyError, AttributeError):
        return None


_SETTERS = _slot_setters()


def _build(model: type[M], fields: dict[str, Any]) -> M:
    """``model.model_construct(**fields)`` for ``fields`` naming every field of ``model``: what
    it sets on the instance, without its Python loop over defaults and aliases (as costly as
    validating here). Every field is marked set, as when all fields are passed in."""
    if _SETTERS is None:
        return model.model_construct(**fields)
    set_dict, set_fields_set, set_extra, set_private = _SETTERS
    instance = model.__new__(model)
    set_dict(instance, fields)
    set_fields_set(instance, set(_FIELD_SETS[model]))
    set_extra(instance, None)
    set_private(instance, None)
    return instance


def _plain_text(value: Any) -> str:
    if type(value) is not str:
        raise _NotPlain
    return value


def _plain_seconds(nanos: Any) -> float | None:
    if nanos is None:
        return None
    if type(nanos) is not int:
        raise _NotPlain
    seconds = nanos / _NANOS
    if not 0.0 <= seconds <= MAX_EPOCH_SECONDS:
        raise _NotPlain
    return seconds


def _plain_scalar(value: Any) -> bool:
    kind = type(value)
    if kind is int:
        return _INT64_MIN <= value <= _INT64_MAX
    return kind is str or kind is float or kind is bool or value is None


def _plain_attributes(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if not attributes:
        return out
    for key, value in attributes.items():
        kind = type(value)
        if type(key) is not str:
            raise _NotPlain
        if kind is str or kind is float or kind is bool or value is None:
            out[key] = value
        elif kind is int:
            if not _INT64_MIN <= value <= _INT64_MAX:
                raise _NotPlain
            out[key] = value
        elif kind is tuple or kind is list:
            items = list(value)
            for item in items:
                if not _plain_scalar(item):
                    raise _NotPlain
            out[key] = items
        else:
            raise _NotPlain
    return out


def _plain_context(context: Any) -> SpanContext:
    trace_id, span_id = context.trace_id, context.span_id
    if type(trace_id) is not int or type(span_id) is not int:
        raise _NotPlain
    if not (0 <= trace_id < _TRACE_ID_END and 0 <= span_id < _SPAN_ID_END):
        raise _NotPlain
    trace_state: dict[str, str] = {}
    if context.trace_state:
        trace_state = dict(context.trace_state.items())
        for key, value in trace_state.items():
            if type(key) is not str or type(value) is not str:
                raise _NotPlain
    return _build(
        SpanContext,
        {
            "trace_id": f"{trace_id:032x}",
            "span_id": f"{span_id:016x}",
            "is_remote": bool(context.is_remote),
            "trace_state": trace_state,
        },
    )


_resources: dict[int, tuple[Any, dict[str, Any], str, bool]] = {}
_RESOURCES_KEPT = 64


def _plain_resource(resource: Any) -> OtelResource:
    """A resource's model, its attributes read once per SDK resource (a provider has one, and
    SDK resources are immutable). Cached by identity, holding the resource so its id cannot be
    reused while cached; each span still gets its own model and dict."""
    if not resource:
        return _build(OtelResource, {"attributes": {}, "schema_url": ""})
    cached = _resources.get(id(resource))
    if cached is None or cached[0] is not resource:
        attributes = _plain_attributes(resource.attributes)
        schema_url = _plain_text(resource.schema_url or "")
        has_lists = any(type(value) is list for value in attributes.values())
        if len(_resources) >= _RESOURCES_KEPT:
            _resources.clear()
        cached = _resources[id(resource)] = (resource, attributes, schema_url, has_lists)
    _, attributes, schema_url, has_lists = cached
    copied = (
        {key: list(value) if type(value) is list else value for key, value in attributes.items()}
        if has_lists
        else dict(attributes)
    )
    return _build(OtelResource, {"attributes": copied, "schema_url": schema_url})


def _plain_span(readable: Any, rollout_id: str, attempt_id: str, sequence_id: int) -> Span:
    if type(rollout_id) is not str or type(attempt_id) is not str or type(sequence_id) is not int:
        raise _NotPlain
    context = _plain_context(readable.context)
    parent_context = readable.parent
    parent = None if parent_context is None else _plain_context(parent_context)
    status = readable.status
    code = status.status_code.name
    description = status.description
    if code not in _STATUS_CODES or not (description is None or type(description) is str):
        raise _NotPlain
    events = [
        _build(
            SpanEvent,
            {
                "name": _plain_text(event.name),
                "attributes": _plain_attributes(event.attributes),
                "timestamp": _plain_seconds(event.timestamp),
            },
        )
        for event in readable.events
    ]
    links = [
        _build(SpanLink, {"context": _plain_context(link.context), "attributes": _plain_attributes(link.attributes)})
        for link in readable.links
    ]
    scope = getattr(readable, "instrumentation_scope", None)
    return _build(
        Span,
        {
            "rollout_id": rollout_id,
            "attempt_id": attempt_id,
            "sequence_id": sequence_id,
            "trace_id": context.trace_id,
            "span_id": context.span_id,
            "parent_id": parent.span_id if parent is not None else None,
            "name": _plain_text(readable.name),
            "kind": _plain_text(readable.kind.name),
            "status": _build(SpanStatus, {"status_code": code, "description": description}),
            "attributes": _plain_attributes(readable.attributes),
            "events": events,
            "links": links,
            "start_time": _plain_seconds(readable.start_time),
            "end_time": _plain_seconds(readable.end_time),
            "context": context,
            "parent": parent,
            "resource": _plain_resource(readable.resource),
            "scope_name": _plain_text(scope.name) if scope else "",
            "scope_version": _plain_text(scope.version or "") if scope else "",
        },
    )
