"""Wires every sub-command module into the root app."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    from agl_stream.cli.kafka_cmd import kafka_app

    app.add_typer(kafka_app, name="kafka", help="The local Kafka broker: jars, start, stop, status")

    from agl_stream.cli.clickhouse_cmd import clickhouse_app
    from agl_stream.cli.demo_cmd import demo
    from agl_stream.cli.roles_cmd import sink
    from agl_stream.cli.topics_cmd import topics_app

    app.add_typer(topics_app, name="topics", help="Create the declared topics and report drift")
    app.add_typer(clickhouse_app, name="clickhouse", help="ClickHouse schema migrations")
    app.command("sink")(sink)
    app.command("demo")(demo)

    from agl_stream.cli.schemas_cmd import schemas_app

    app.add_typer(schemas_app, name="schemas", help="Snapshot schema versions; check compatibility")

    from agl_stream.cli.roles_cmd import processor, runner, triplets
    from agl_stream.cli.stack_cmd import dashboard, down, status, supervise, up
    from agl_stream.cli.trainer_cmd import trainer

    app.command("up")(up)
    app.command("status")(status)
    app.command("down")(down)
    app.command("dashboard")(dashboard)
    app.command("supervise")(supervise)
    app.command("processor")(processor)
    app.command("runner")(runner)
    app.command("triplets")(triplets)
    app.command("trainer")(trainer)
    from agl_stream.cli.batcher_cmd import batcher

    app.command("batcher")(batcher)
    from agl_stream.cli.replay_cmd import replay

    app.command("replay")(replay)
    from agl_stream.cli.inference_cmd import inference

    app.command("inference")(inference)
    from agl_stream.cli.sql_cmd import sql

    app.command("sql")(sql)
    from agl_stream.cli.llm_proxy_cmd import llm_proxy

    app.command("llm-proxy")(llm_proxy)
    from agl_stream.cli.gateway_cmd import gateway

    app.command("gateway")(gateway)
    from agl_stream.cli.otlp_kafka_cmd import otlp_kafka

    app.command("otlp-kafka")(otlp_kafka)
    from agl_stream.cli.enqueue_cmd import enqueue
    from agl_stream.cli.ingress_cmd import ingress

    app.command("ingress")(ingress)
    app.command("enqueue")(enqueue)
