"""Wires every sub-command module into the root app, each command in its help panel.

A command module imports only typer and the standard library at module level (its libraries
load inside the command), so registering them all costs ``--help`` almost nothing.
"""

from __future__ import annotations

import typer
from typer.core import TyperCommand
from typer.models import DefaultPlaceholder

from agl_stream.cli.context import AglCommand, AglGroup

# The panels of `agl-stream --help`, in the order they are shown.
LOCAL_STACK = "Local stack"
ROLES = "Roles"
TRAINING = "Training"
DATA = "Data & queries"
ADMIN = "Kafka & ClickHouse admin"
PANELS = (LOCAL_STACK, ROLES, TRAINING, DATA, ADMIN)


def register(app: typer.Typer) -> None:
    from agl_stream.cli.stack_cmd import dashboard, down, status, supervise, up

    app.command("up", rich_help_panel=LOCAL_STACK)(up)
    app.command("status", rich_help_panel=LOCAL_STACK)(status)
    app.command("down", rich_help_panel=LOCAL_STACK)(down)
    app.command("dashboard", rich_help_panel=LOCAL_STACK)(dashboard)
    app.command("supervise", rich_help_panel=LOCAL_STACK)(supervise)

    from agl_stream.cli.gateway_cmd import gateway
    from agl_stream.cli.ingress_cmd import ingress
    from agl_stream.cli.llm_proxy_cmd import llm_proxy
    from agl_stream.cli.otlp_kafka_cmd import otlp_kafka
    from agl_stream.cli.roles_cmd import processor, runner, sink

    app.command("processor", rich_help_panel=ROLES)(processor)
    app.command("gateway", rich_help_panel=ROLES)(gateway)
    app.command("ingress", rich_help_panel=ROLES)(ingress)
    app.command("runner", rich_help_panel=ROLES)(runner)
    app.command("llm-proxy", rich_help_panel=ROLES)(llm_proxy)
    app.command("otlp-kafka", rich_help_panel=ROLES)(otlp_kafka)
    app.command("sink", rich_help_panel=ROLES)(sink)

    from agl_stream.cli.batcher_cmd import batcher
    from agl_stream.cli.demo_cmd import demo
    from agl_stream.cli.inference_cmd import inference
    from agl_stream.cli.replay_cmd import replay
    from agl_stream.cli.roles_cmd import triplets
    from agl_stream.cli.trainer_cmd import trainer

    app.command("demo", rich_help_panel=TRAINING)(demo)
    app.command("triplets", rich_help_panel=TRAINING)(triplets)
    app.command("batcher", rich_help_panel=TRAINING)(batcher)
    app.command("trainer", rich_help_panel=TRAINING)(trainer)
    app.command("inference", rich_help_panel=TRAINING)(inference)
    app.command("replay", rich_help_panel=TRAINING)(replay)

    from agl_stream.cli.dlq_cmd import dlq_app
    from agl_stream.cli.enqueue_cmd import enqueue
    from agl_stream.cli.export_cmd import export
    from agl_stream.cli.sql_cmd import sql

    app.command("sql", rich_help_panel=DATA)(sql)
    app.command("enqueue", rich_help_panel=DATA)(enqueue)
    app.command("export", rich_help_panel=DATA)(export)
    app.add_typer(
        dlq_app, name="dlq", help="Dead letters on agl.dlq: list, count, show, resubmit", rich_help_panel=DATA
    )

    from agl_stream.cli.clickhouse_cmd import clickhouse_app
    from agl_stream.cli.kafka_cmd import kafka_app
    from agl_stream.cli.schemas_cmd import schemas_app
    from agl_stream.cli.topics_cmd import topics_app

    app.add_typer(
        kafka_app, name="kafka", help="The local Kafka broker: jars, start, stop, status", rich_help_panel=ADMIN
    )
    app.add_typer(topics_app, name="topics", help="Create the declared topics and report drift", rich_help_panel=ADMIN)
    app.add_typer(clickhouse_app, name="clickhouse", help="ClickHouse schema migrations", rich_help_panel=ADMIN)
    app.add_typer(
        schemas_app,
        name="schemas",
        help="Snapshot schema versions; check compatibility; export them",
        rich_help_panel=ADMIN,
    )

    use_cli_classes(app)


def use_cli_classes(app: typer.Typer) -> None:
    """Every command and group under ``app`` that names no class of its own gets the CLI's
    (:class:`AglCommand`: settings built before it runs, flags shown without a metavar)."""
    for command in app.registered_commands:
        if command.cls is None or command.cls is TyperCommand:  # typer's default
            command.cls = AglCommand
    for group in app.registered_groups:
        sub = group.typer_instance
        if isinstance(group.cls, DefaultPlaceholder) and (sub is None or isinstance(sub.info.cls, DefaultPlaceholder)):
            group.cls = AglGroup
        if sub is not None:
            use_cli_classes(sub)
