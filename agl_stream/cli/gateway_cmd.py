"""``agl-stream gateway``: the sinks and the query API in the process that owns ClickHouse.

The role lives in ``consumers.gateway``, imported when the command runs (its libraries load only then).
The CLI is the one part of ``agl_stream`` above the roles (docs/architecture.md, the layers).
"""

from __future__ import annotations

from typing import Annotated

import typer

from agl_stream.cli.context import settings_of


def gateway(
    ctx: typer.Context,
    host: Annotated[str | None, typer.Option(help="Address to bind (env AGL_GATEWAY_HOST).")] = None,
    port: Annotated[
        int | None,
        typer.Option(min=0, max=65535, help="Port to bind, 0 for a free one (env AGL_GATEWAY_PORT)."),
    ] = None,
    query_clients: Annotated[int, typer.Option(min=1, help="Queries that may run at once.")] = 4,
    query_time_limit: Annotated[int, typer.Option(min=1, help="Longest a query may run, in seconds.")] = 30,
) -> None:
    """Run the gateway: every ClickHouse sink plus the read API, until SIGTERM or Ctrl-C.

    With the embedded engine this process owns the ClickHouse data dir; other processes read
    through its HTTP API. The URL it serves is recorded in <data dir>/run/gateway.json.
    """
    settings = settings_of(ctx)
    overrides = {k: v for k, v in {"gateway_host": host, "gateway_port": port}.items() if v is not None}
    if overrides:
        settings = settings.model_copy(update=overrides)
    from agl_stream import metrics
    from consumers import gateway

    metrics.set_role("gateway")  # served on its own app, at /metrics
    gateway.main(settings, query_clients=query_clients, query_time_limit_s=query_time_limit)
