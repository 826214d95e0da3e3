"""``agl-stream otlp-kafka``: OTLP traces from the OpenTelemetry Collector's Kafka topic into agl.spans.

The role lives in ``consumers.otlp_kafka``, imported when the command runs (its libraries load only then).
The CLI is the one part of ``agl_stream`` above the roles (docs/architecture.md, the layers).
"""

from __future__ import annotations

from typing import Annotated

import typer

from agl_stream.cli.context import settings_of


def otlp_kafka(
    ctx: typer.Context,
    topic: Annotated[
        str | None,
        typer.Option(help="Topic the collector's Kafka exporter writes to, not prefixed (env AGL_OTLP_KAFKA_TOPIC)."),
    ] = None,
    group: Annotated[str | None, typer.Option(help="Consumer group on that topic (env AGL_OTLP_KAFKA_GROUP).")] = None,
    encoding: Annotated[
        str, typer.Option(help="The exporter's encoding: otlp_proto (its default) or otlp_json.")
    ] = "otlp_proto",
    max_records: Annotated[int, typer.Option(min=1, help="Most messages per poll batch.")] = 500,
) -> None:
    """Consume OTLP traces from Kafka (the collector's Kafka exporter) into agl.spans, until SIGTERM.

    Spans must carry the resource (or span) attributes agentlightning.rollout_id and
    agentlightning.attempt_id of an attempt the store knows. Messages with spans that cannot be
    stored go to agl.dlq with the reason; offsets are committed once spans and dead letters are
    acknowledged. Needs the stack (`agl-stream up`): the rollout processor numbers the spans and
    the gateway answers the duplicate check after a restart.
    """
    if encoding not in ("otlp_proto", "otlp_json"):
        raise typer.BadParameter("otlp_proto or otlp_json", param_hint="--encoding")
    from agl_stream.local.stack import local_stack_settings

    settings = local_stack_settings(settings_of(ctx))
    overrides = {k: v for k, v in {"otlp_kafka_topic": topic, "otlp_kafka_group": group}.items() if v is not None}
    if overrides:
        settings = settings.model_copy(update=overrides)
    from agl_stream import metrics
    from consumers import otlp_kafka

    with metrics.expose(settings, "otlp-kafka"):
        otlp_kafka.main(settings, encoding=encoding, max_records=max_records)
