"""ReadableSpan -> Span conversion with the real OpenTelemetry SDK."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, Tracer, TraceState
from pydantic import ValidationError

from agl_stream.models import Span
from agl_stream.wire import spans
from agl_stream.wire.codec import Codec
from agl_stream.wire.spans import span_from_otel
from tests.unit.test_models import attribute_values, typed


def test_a_real_sdk_span_converts_and_round_trips() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "agent"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("scope", "1.2")
    with tracer.start_as_current_span("outer") as outer:
        outer.set_attribute("ids", [1, 2, 3])
        with tracer.start_as_current_span("inner") as inner:
            inner.add_event("e", {"k": True})
            inner.set_status(Status(StatusCode.ERROR, "boom"))
    inner_span, outer_span = exporter.get_finished_spans()
    span = span_from_otel(inner_span, "ro-000000000001", "at-00000001", 7)
    assert span.name == "inner" and span.sequence_id == 7
    assert span.parent_id == f"{outer_span.context.span_id:016x}"
    assert span.trace_id == f"{outer_span.context.trace_id:032x}"
    assert span.status.status_code == "ERROR" and span.status.description == "boom"
    assert span.events[0].name == "e" and span.events[0].attributes == {"k": True}
    assert span.resource.attributes["service.name"] == "agent"
    assert (span.scope_name, span.scope_version) == ("scope", "1.2")
    assert span.start_time is not None and span.end_time is not None and span.end_time >= span.start_time
    outer_converted = span_from_otel(outer_span, "ro-000000000001", "at-00000001", 8)
    assert outer_converted.attributes["ids"] == [1, 2, 3] and outer_converted.parent_id is None
    codec = Codec.default()
    assert codec.decode(codec.encode(span), Span) == span


# -- the plain path (built without validation) gives what validation gives ----------------------

_RESOURCE = Resource(
    {"service.name": "agent", "ratio": 0.5, "n": 3, "on": True, "tags": ("a", "b"), "ports": (80, 443)},
    schema_url="https://opentelemetry.io/schemas/1.21.0",
)


def _finished(make: Callable[[Tracer], None], resource: Resource = _RESOURCE) -> list[ReadableSpan]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    make(provider.get_tracer("scope", None))
    return list(exporter.get_finished_spans())


def _assert_same_as_validated(readable: Any, sequence_id: int = 7) -> Span:
    """The plain path took the span, and its model is the validated one in every respect."""
    plain = spans._plain_span(readable, "ro-000000000001", "at-00000001", sequence_id)
    validated = spans._validated_span(readable, "ro-000000000001", "at-00000001", sequence_id)
    assert plain == validated
    assert plain.model_dump() == validated.model_dump()
    assert typed(plain.model_dump()) == typed(validated.model_dump())  # bool/int/float kept apart
    assert plain.model_fields_set == validated.model_fields_set
    for name in ("status", "context", "parent", "resource"):
        assert type(getattr(plain, name)) is type(getattr(validated, name))
    assert [type(e) for e in plain.events] == [type(e) for e in validated.events]
    assert [type(link) for link in plain.links] == [type(link) for link in validated.links]
    assert repr(plain) == repr(validated)  # every dict in the same order too
    codec = Codec.default()
    assert codec.encode(plain) == codec.encode(validated)
    return plain


def test_representative_sdk_spans_convert_without_validation_to_the_validated_model() -> None:
    linked = SpanContext(0xABC, 0xDEF, is_remote=True, trace_state=TraceState([("vendor", "v1")]))

    def make(tracer: Tracer) -> None:
        with tracer.start_as_current_span("agent", kind=SpanKind.SERVER) as outer:
            outer.set_attributes({"ids": [1, 2, 3], "flags": [True, False], "xs": [0.5, 1.0], "names": ["a", "é"]})
            with tracer.start_as_current_span(
                "llm", kind=SpanKind.CLIENT, links=[Link(linked, {"why": "retry"})]
            ) as inner:
                inner.set_attributes({"prompt": "x" * 3000, "n": -(2**63), "big": 2**63 - 1, "t": 0.0, "on": False})
                inner.add_event("token", {"i": 1, "p": 0.25, "list": (1, 2)})
                inner.add_event("empty")
                inner.set_status(Status(StatusCode.ERROR, "boom"))
            with tracer.start_as_current_span("ok") as done:
                done.set_status(Status(StatusCode.OK))

    finished = _finished(make)
    assert [s.name for s in finished] == ["llm", "ok", "agent"]
    for readable in finished:
        _assert_same_as_validated(readable)
    llm = span_from_otel(finished[0], "ro-000000000001", "at-00000001", 1)
    assert llm.links[0].context.trace_state == {"vendor": "v1"} and llm.links[0].context.is_remote
    assert llm.resource.attributes["ports"] == [80, 443] and llm.resource.schema_url.startswith("https://")


def test_converted_spans_share_no_mutable_state() -> None:
    """The resource is read once per SDK resource, but every span owns its dicts and lists."""
    first, second = (span_from_otel(r, "ro-1", "at-1", 1) for r in _finished(_two_spans))
    assert first.resource == second.resource
    first.resource.attributes["service.name"] = "changed"
    first.resource.attributes["tags"].append("c")  # type: ignore[union-attr]
    assert second.resource.attributes["service.name"] == "agent"
    assert second.resource.attributes["tags"] == ["a", "b"]
    assert first.attributes is not second.attributes
    first.sequence_id = 9  # assignment works as on any model, and is noted as set
    assert "sequence_id" in first.model_fields_set and second.sequence_id == 1


def _two_spans(tracer: Tracer) -> None:
    for name in ("a", "b"):
        with tracer.start_as_current_span(name):
            pass


@settings(max_examples=150, deadline=None)
@given(attributes=st.dictionaries(st.text(min_size=1, max_size=8), attribute_values, max_size=6))
def test_any_sdk_attributes_convert_to_the_validated_model(attributes: dict[str, Any]) -> None:
    def make(tracer: Tracer) -> None:
        with tracer.start_as_current_span("s", attributes=attributes) as span:
            span.add_event("e", attributes)

    [readable] = _finished(make, Resource(attributes))
    try:
        want = spans._validated_span(readable, "ro-1", "at-1", 1)
    except ValidationError:
        with pytest.raises(ValidationError):
            span_from_otel(readable, "ro-1", "at-1", 1)
        return
    got = span_from_otel(readable, "ro-1", "at-1", 1)
    assert got == want and typed(got.model_dump()) == typed(want.model_dump()) and repr(got) == repr(want)


class _Float(float):
    pass


class _Text(str):
    pass


def _readable(**overrides: Any) -> ReadableSpan:
    fields: dict[str, Any] = {
        "name": "s",
        "context": SpanContext(1, 2, False),
        "attributes": {"a": 1},
        "start_time": 1_000_000_000,
        "end_time": 2_000_000_000,
    }
    fields.update(overrides)
    return ReadableSpan(**fields)


@pytest.mark.parametrize(
    "overrides",
    [
        {"attributes": {"big": 2**64}},  # validation makes it a float
        {"attributes": {"sub": _Float(0.5)}},
        {"attributes": {"sub": _Text("x")}},
        {"attributes": {"mixed": (1, "a", None)}},
        {"attributes": {"bad": object()}},
        {"attributes": {"nested": {"a": 1}}},
        {"attributes": {1: "key not a str"}},
        {"name": _Text("sub")},
        {"name": 5},
        {"start_time": -1},
        {"start_time": 10**20},
        {"start_time": 1.5e9},
        {"end_time": None},
        {"context": SpanContext(2**128, 1, False)},
        {"context": SpanContext(-1, 1, False)},
        {"parent": SpanContext(1, 2**64, False)},
        {"status": Status(StatusCode.ERROR, "why")},
        {"events": [Event("e", {"k": 2**70}, timestamp=-5)]},
        {"links": [Link(SpanContext(3, 4, True), {"k": _Float(1.0)})]},
        {"resource": Resource({"r": 2**64})},
    ],
)
def test_whatever_the_plain_path_declines_gets_the_validated_answer(overrides: dict[str, Any]) -> None:
    readable = _readable(**overrides)
    try:
        want: Span | type[Exception] = spans._validated_span(readable, "ro-1", "at-1", 1)
    except (ValidationError, TypeError, AttributeError) as error:
        want = type(error)
    if isinstance(want, Span):
        got = span_from_otel(readable, "ro-1", "at-1", 1)
        assert got == want and typed(got.model_dump()) == typed(want.model_dump())
    else:
        with pytest.raises(want):
            span_from_otel(readable, "ro-1", "at-1", 1)


def test_the_plain_path_is_taken_for_what_the_sdk_makes() -> None:
    """Guards the speed: a plain SDK span must not fall back to validation."""
    for readable in _finished(_two_spans):
        spans._plain_span(readable, "ro-1", "at-1", 1)  # raises _NotPlain otherwise
    assert spans._SETTERS is not None, "pydantic's BaseModel slots changed: _build uses model_construct (slow)"
