"""Long-running roles. Each lives in its own top-level package and is loaded by module name,
so the library never imports the roles (DESIGN.md, dependency direction)."""

from __future__ import annotations

import importlib
from typing import Annotated

import typer

from agl_stream.cli import settings_of


def sink(
    ctx: typer.Context,
    batch_size: Annotated[int, typer.Option(min=1, help="Most span rows per INSERT.")] = 10_000,
    flush_ms: Annotated[int, typer.Option(min=1, help="Longest wait to fill a span batch, in ms.")] = 200,
) -> None:
    """Run the ClickHouse sinks (spans, rollout states, resources, workers) until SIGTERM or Ctrl-C.

    The gateway runs the same sinks plus the query API; run this only without a gateway.

    With the embedded engine this process owns the ClickHouse data dir.
    """
    module = importlib.import_module("consumers.clickhouse_sink")
    module.main(settings_of(ctx), batch_size=batch_size, flush_ms=flush_ms)


def processor(
    ctx: typer.Context,
    watchdog_interval: Annotated[
        float | None, typer.Option(min=0.05, help="Seconds between watchdog scans (env AGL_WATCHDOG_INTERVAL_S).")
    ] = None,
    finished_retention: Annotated[
        float | None,
        typer.Option(min=0.0, help="Seconds a finished rollout stays in memory (env AGL_FINISHED_RETENTION_S)."),
    ] = None,
) -> None:
    """Run the rollout processor (state machine, task queue, watchdog) until SIGTERM or Ctrl-C."""
    settings = settings_of(ctx)
    overrides = {"watchdog_interval_s": watchdog_interval, "finished_retention_s": finished_retention}
    settings = settings.model_copy(update={k: v for k, v in overrides.items() if v is not None})
    importlib.import_module("processors.rollouts").main(settings)
