"""A Python agent that knows OpenTelemetry but not agl-stream: it continues the trace it is given
($TRACEPARENT) with a span of its own, exports it over OTLP/HTTP where the standard OTEL_*
variables say (endpoint, headers, resource attributes), and prints its reward."""

import os

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

provider = TracerProvider(resource=Resource.create())  # OTEL_RESOURCE_ATTRIBUTES
provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter()))  # OTEL_EXPORTER_OTLP_TRACES_*
parent = TraceContextTextMapPropagator().extract({"traceparent": os.environ.get("TRACEPARENT", "")})
with provider.get_tracer("otlp-agent").start_as_current_span("agent.plan", context=parent) as span:
    span.set_attribute("plan.steps", 3)
provider.shutdown()  # exported before the process ends
print(0.25)
