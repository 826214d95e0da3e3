"""``agl-stream sql``: read-only SQL over every trace, rollout and triplet in ClickHouse."""

from __future__ import annotations

import asyncio
import csv
import enum
import json
import re
import sys
from datetime import datetime
from typing import TYPE_CHECKING, Annotated

import typer

from agl_stream.cli import output
from agl_stream.cli.context import settings_of
from agl_stream.errors import AglError, GatewayUnavailableError, QueryError

if TYPE_CHECKING:
    from rich.console import Console

    from agl_stream.config import Settings
    from agl_stream.store.readside import QueryResult


# A datetime as the gateway's JSON carries it (Python's isoformat): shown in the CLI's one format.
_ISO_DATETIME = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,6})?([+-]\d{2}:\d{2})?")


def _table_value(value: object) -> object:
    if isinstance(value, str) and _ISO_DATETIME.fullmatch(value):
        return datetime.fromisoformat(value)
    return value


class OutputFormat(str, enum.Enum):
    table = "table"
    csv = "csv"
    json = "json"


async def _run(settings: Settings, sql: str, timeout: float) -> QueryResult:
    from agl_stream.auth import auth_headers
    from agl_stream.store.readside import ClickHouseReadSide, GatewayReadSide, read_side_for

    side = read_side_for(settings)
    try:
        if isinstance(side, GatewayReadSide):
            return await _via_gateway(side.url, sql, timeout, auth_headers(settings))
        if isinstance(side, ClickHouseReadSide):
            return await asyncio.to_thread(_on_server, settings, sql, timeout)
        return await side.query(sql, timeout=timeout)
    finally:
        await side.aclose()


async def _via_gateway(url: str, sql: str, timeout: float, headers: dict[str, str]) -> QueryResult:
    """The gateway's ``/v1/sql``: the same checks and limits as every analytics client."""
    import httpx

    from agl_stream.store.readside import QueryResult

    async with httpx.AsyncClient(headers=headers) as client:
        try:
            response = await client.post(
                f"{url}/v1/sql", json={"query": sql, "format": "json", "timeout": timeout}, timeout=timeout + 30
            )
        except httpx.TransportError as exc:
            raise GatewayUnavailableError(
                f"gateway {url} does not answer ({exc}); is `agl-stream up` running?"
            ) from exc
    try:
        payload = response.json()
    except ValueError:
        payload = {}
    if response.status_code == 200:
        return QueryResult(list(payload["columns"]), [list(r) for r in payload["rows"]])
    message = payload.get("message") or response.text
    raise QueryError(f"{payload.get('error', response.status_code)}: {message}", code=payload.get("code"))


def _on_server(settings: Settings, sql: str, timeout: float) -> QueryResult:
    """A ClickHouse server: readonly=2 and the analytics limits; what may be read is the user's grants
    (docs/sql.md, "Access")."""
    from clickhouse_connect.driver.exceptions import DatabaseError

    from agl_stream.clickhouse.client import get_client
    from agl_stream.store.readside import QueryResult

    client = get_client(
        settings,
        readonly=True,
        max_execution_time=min(timeout, settings.sql_time_limit_s),
        max_memory_usage=settings.sql_max_memory_bytes,
        max_result_rows=settings.sql_max_result_rows,
        max_result_bytes=settings.sql_max_result_bytes,
        result_overflow_mode="throw",
    )
    try:
        result = client.query(sql)
    except DatabaseError as exc:
        raise QueryError(str(exc), code=getattr(exc, "code", None)) from exc
    finally:
        client.close()
    return QueryResult(list(result.column_names), [list(row) for row in result.result_rows])


def render(result: QueryResult, fmt: OutputFormat, console: Console) -> None:
    """Print a result as a table (fitting the terminal; times in the CLI's one format), CSV
    (header first) or JSON lines (one object per row): the last two print values as they are."""
    if fmt is OutputFormat.csv:
        writer = csv.writer(sys.stdout)
        writer.writerow(result.columns)
        writer.writerows(result.rows)
    elif fmt is OutputFormat.json:
        for record in result.dicts():
            sys.stdout.write(json.dumps(record, default=str) + "\n")
    else:
        table = output.new_table(*result.columns)
        for values in result.rows:
            table.add_row(*(output.cell(_table_value(v), none=output.NULL) for v in values))
        output.show(table, console)
        console.print(f"[dim]{len(result.rows)} row(s)[/]")


def sql(
    ctx: typer.Context,
    query: Annotated[
        str, typer.Argument(help="The SELECT to run; tables live in the database AGL_CLICKHOUSE_DATABASE.")
    ],
    fmt: Annotated[OutputFormat, typer.Option("--output", "-o", help="table, csv or json (lines).")] = (
        OutputFormat.table
    ),
    timeout: Annotated[float, typer.Option(min=0.1, help="Seconds to wait for the answer.")] = 30.0,
) -> None:
    """Run read-only SQL on ClickHouse (through the gateway, or a ClickHouse server).

    Read-only is enforced by ClickHouse itself, not by looking at the SQL: through the gateway's
    /v1/sql only one SELECT over the agl database runs (readonly settings, the engine's own
    analysis of the tables it reads, time/memory/result limits); on a server, readonly settings,
    the limits and the user's grants. Cookbook: docs/sql.md. Example:

        agl-stream sql "SELECT policy_version, avg(final_reward) FROM agl.triplet_records FINAL GROUP BY 1"
    """
    settings = settings_of(ctx)
    try:
        result = asyncio.run(_run(settings, query, timeout))
    except AglError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(1) from error
    render(result, fmt, output.console())
