"""The wire: pure encoders and decoders of what crosses a process boundary.

The Avro codec and its schema contract (``codec``, ``contract``), Avro's primitive framing
(``avro_primitives``), the span Avro writer and span batches (``span_avro``, ``span_records``),
the processor's replies (``reply_wire``), spans from OpenTelemetry objects and OTLP requests
(``spans``, ``otlp``) and the attribute names they carry (``semconv``). No I/O: an import
contract holds this package to the models, the errors, the bundled resources and its codec
libraries.
"""
