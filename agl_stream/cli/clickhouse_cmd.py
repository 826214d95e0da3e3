"""``agl-stream clickhouse``: schema migrations and a quick look at the tables."""

from __future__ import annotations

import typer

from agl_stream.cli import output
from agl_stream.cli.context import settings_of

clickhouse_app = typer.Typer(no_args_is_help=True)


@clickhouse_app.command("migrate")
def migrate_cmd(ctx: typer.Context) -> None:
    """Apply pending DDL migrations from infra/clickhouse (idempotent), then the retention
    setting clickhouse_ttl_days (0: keep forever; see docs/retention.md).

    With the embedded engine this process must be the only one that has the data dir open:
    stop the sink / gateway first.
    """
    from agl_stream.clickhouse.access import apply_reader_role, reader_name
    from agl_stream.clickhouse.client import get_client
    from agl_stream.clickhouse.migrations import migrate

    console = output.console()
    settings = settings_of(ctx)
    client = get_client(settings)
    try:
        applied = migrate(client, settings.clickhouse_database, ttl_days=settings.clickhouse_ttl_days)
    finally:
        client.close()
    if not applied:
        console.print("[dim]up to date[/]")
    for migration in applied:
        console.print(f"[green]applied[/] {migration.version:03d}_{migration.name}")
    if settings.uses_embedded_clickhouse:
        return  # chDB has no access control: the gateway's checks and client settings are it
    client = get_client(settings)
    try:
        refused = apply_reader_role(client, settings)
    finally:
        client.close()
    role = reader_name(settings.clickhouse_database)
    if refused is None:
        console.print(f"[green]applied[/] the reader role and settings profile {role}")
    else:
        console.print(
            f"[yellow]skipped[/] the reader role {role}: {refused}. Run `clickhouse migrate` as a user "
            "that may manage access to apply it (docs/sql.md, Access)"
        )
