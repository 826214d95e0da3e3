"""The ``agl-stream`` command. Each role or tool is a sub-command; see ``agl-stream --help``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from agl_stream.cli.context import AglGroup, SettingsRequest, settings_of
from agl_stream.errors import AglError

ROLE_COMMANDS = frozenset(
    {
        "supervise",
        "processor",
        "gateway",
        "ingress",
        "triplets",
        "batcher",
        "sink",
        "otlp-kafka",
        "runner",
        "trainer",
        "inference",
        "llm-proxy",
    }
)
"""Sub-commands that run a role: each logs a line as it starts, before its heavy imports
(:attr:`SettingsRequest.role`)."""

app = typer.Typer(
    name="agl-stream",
    cls=AglGroup,
    help=(
        "Agent Lightning as an event-sourced pipeline over Apache Kafka.\n\n"
        "Every setting can also come from an AGL_* environment variable (see the README's "
        "Settings table); flags win over the environment."
    ),
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)

__all__ = ["app", "main", "settings_of"]


@app.callback()
def _root(
    ctx: typer.Context,
    data_dir: Annotated[Path | None, typer.Option(help="Local state folder (env AGL_DATA_DIR).")] = None,
    bootstrap: Annotated[
        str | None,
        typer.Option(help="Use this Kafka cluster instead of the local broker (env AGL_KAFKA_BOOTSTRAP)."),
    ] = None,
    topic_prefix: Annotated[str | None, typer.Option(help="Topic name prefix (env AGL_TOPIC_PREFIX).")] = None,
    clickhouse_url: Annotated[
        str | None, typer.Option(help="ClickHouse server URL; unset = embedded chDB (env AGL_CLICKHOUSE_URL).")
    ] = None,
    log_level: Annotated[str | None, typer.Option(help="DEBUG, INFO, WARNING or ERROR (env AGL_LOG_LEVEL).")] = None,
    log_format: Annotated[str | None, typer.Option(help="console or json (env AGL_LOG_FORMAT).")] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set", metavar="NAME=VALUE", help="Any other setting, e.g. --set producer_linger_ms=20 (repeatable)."
        ),
    ] = None,
) -> None:
    extra: dict[str, str] = {}
    for item in set_ or []:
        name, sep, value = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"--set expects NAME=VALUE, got {item!r}")
        extra[name.strip().lower().removeprefix("agl_")] = value
    named = {
        "data_dir": data_dir,
        "kafka_bootstrap": bootstrap,
        "topic_prefix": topic_prefix,
        "clickhouse_url": clickhouse_url,
        "log_level": log_level,
        "log_format": log_format,
    }
    # Built (and logging configured) when the command runs: `agl-stream <command> --help` needs neither.
    ctx.obj = SettingsRequest(
        overrides={**extra, **{k: v for k, v in named.items() if v is not None}},
        role=ctx.invoked_subcommand if ctx.invoked_subcommand in ROLE_COMMANDS else None,
    )


def _register() -> None:
    from agl_stream.cli import commands  # the sub-commands load only when the command runs

    commands.register(app)


def main() -> None:
    _register()
    try:
        app()
    except AglError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise SystemExit(1) from exc
