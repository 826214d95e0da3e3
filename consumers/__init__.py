"""Consumers: roles that act on what the log holds.

- ``gateway``: the ClickHouse sinks (``clickhouse_sink``, declared in ``sink_specs``) and the
  HTTP read side: ``/v1/query``, ``/v1/sql`` (``gateway_sql``), the dashboard (``dashboard``,
  ``dashboard_sql``), OTLP and task intake (``gateway_tasks``), the seed's REST API
  (``gateway_agl``, ``gateway_agl_shapes``).
- ``runner``: claims rollouts and runs the user's agent on them.
- ``trainer``: the policy trainer (``PolicyTrainer``).
- ``inference``: the model server for the tiny CPU policy or an HF model; ``vllm_server`` and
  ``switch_gate``: vLLM as a managed child behind a hand-off gate.
- ``otlp_kafka``: the OpenTelemetry Collector's Kafka exporter -> spans.
"""
