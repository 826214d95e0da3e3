"""ReadableSpan -> Span conversion with the real OpenTelemetry SDK."""

from __future__ import annotations

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Status, StatusCode

from agl_stream.codec import Codec
from agl_stream.models import Span
from agl_stream.spans import span_from_otel


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
