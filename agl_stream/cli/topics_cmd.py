"""``agl-stream topics``: create the declared topics, report drift, show the topology."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Annotated

import typer

from agl_stream.cli import output
from agl_stream.cli.context import settings_of

if TYPE_CHECKING:
    from agl_stream.topics import TopicPlan

topics_app = typer.Typer(no_args_is_help=True)


def _show(plan: TopicPlan, *, applied: bool) -> None:
    """Print the plan; exit 2 when there is drift."""
    console = output.console()
    for topic in plan.create:
        verb = "created" if applied else "would create"
        console.print(f"[green]{verb}[/] {topic.name} partitions={topic.partitions} replication={topic.replication}")
    for name in plan.unchanged:
        console.print(f"[dim]ok[/] {name}")
    for drift in plan.drift:
        console.print(f"[yellow]drift[/] {drift}")
    if plan.drift:
        console.print(
            "[yellow]Drift is reported, never changed automatically: changing partitions breaks key "
            "ordering. Fix the topic by hand or the declaration in topics/topics.toml.[/]"
        )
        raise typer.Exit(2)


@topics_app.command("apply")
def apply_cmd(ctx: typer.Context) -> None:
    """Create missing topics from topics/topics.toml; report drift (exit 2 when there is drift)."""
    from agl_stream.kafka import admin

    _show(asyncio.run(admin.apply(settings_of(ctx))), applied=True)


@topics_app.command("plan")
def plan_cmd(ctx: typer.Context) -> None:
    """Show what `apply` would do, changing nothing."""
    from agl_stream.kafka import admin

    _show(asyncio.run(admin.plan(settings_of(ctx))), applied=False)


@topics_app.command("prune-replies")
def prune_replies_cmd(
    ctx: typer.Context,
    idle: Annotated[
        float, typer.Option(help="Seconds without a record (keepalives included) after which a client is gone.")
    ] = 1800.0,
) -> None:
    """Delete reply topics of store clients that are gone (killed without closing).

    Every store client has a reply topic (<prefix>.replies.<client id>) that it deletes when it
    closes and writes a keepalive to every 5 minutes; the rollout processor runs this hourly.
    """
    from agl_stream.store.replies import prune_reply_topics

    deleted = asyncio.run(prune_reply_topics(settings_of(ctx), idle_s=idle))
    console = output.console()
    for name in deleted:
        console.print(f"[yellow]deleted[/] {name}")
    console.print(f"{len(deleted)} reply topic(s) deleted")


@topics_app.command("list")
def list_cmd(ctx: typer.Context) -> None:
    """List the declared topics with their key, schema and retention."""
    from agl_stream.topics import load_topic_specs

    settings = settings_of(ctx)
    table = output.new_table("topic", "key", "value schema", "partitions", "cleanup", "retention ms", "what")
    for spec in load_topic_specs():
        table.add_row(
            spec.full_name(settings.topic_prefix),
            spec.key,
            spec.value_schema,
            str(spec.partitions),
            spec.cleanup_policy,
            str(spec.retention_ms),
            spec.doc,
        )
    output.show(table)


@topics_app.command("table")
def table_cmd(ctx: typer.Context) -> None:
    """Print the topology (who writes and who reads each topic) as Markdown: docs/architecture.md's table."""
    from agl_stream.topics import load_topology, topology_table

    specs, roles = load_topology()
    print(topology_table(specs, roles, settings_of(ctx).topic_prefix), end="")
