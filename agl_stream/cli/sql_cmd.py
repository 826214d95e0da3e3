"""``agl-stream sql``: read-only SQL over every trace, rollout and triplet in ClickHouse."""

from __future__ import annotations

import asyncio
import csv
import enum
import json
import sys
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from agl_stream.cli import settings_of
from agl_stream.errors import AglError
from agl_stream.store.readside import QueryResult, read_side_for


class OutputFormat(str, enum.Enum):
    table = "table"
    csv = "csv"
    json = "json"


async def _run(settings: Any, sql: str, timeout: float) -> QueryResult:
    side = read_side_for(settings)
    try:
        return await side.query(sql, timeout=timeout)
    finally:
        await side.aclose()


def render(result: QueryResult, output: OutputFormat, console: Console) -> None:
    """Print a result as a rich table, CSV (header first) or JSON lines (one object per row)."""
    if output is OutputFormat.csv:
        writer = csv.writer(sys.stdout)
        writer.writerow(result.columns)
        writer.writerows(result.rows)
    elif output is OutputFormat.json:
        for record in result.dicts():
            sys.stdout.write(json.dumps(record, default=str) + "\n")
    else:
        table = Table(*result.columns)
        for values in result.rows:
            table.add_row(*("NULL" if v is None else str(v) for v in values))
        console.print(table)
        console.print(f"[dim]{len(result.rows)} row(s)[/]")


def sql(
    ctx: typer.Context,
    query: Annotated[
        str, typer.Argument(help="The SELECT to run; tables live in the database AGL_CLICKHOUSE_DATABASE.")
    ],
    output: Annotated[OutputFormat, typer.Option("--output", "-o", help="table, csv or json (lines).")] = (
        OutputFormat.table
    ),
    timeout: Annotated[float, typer.Option(min=0.1, help="Seconds to wait for the answer.")] = 30.0,
) -> None:
    """Run read-only SQL on ClickHouse (through the gateway, or a ClickHouse server).

    Read-only is enforced by ClickHouse itself (readonly settings), not by looking at the SQL:
    INSERT, DDL and SET are refused. Example:

        agl-stream sql "SELECT policy_version, avg(final_reward) FROM agl.triplet_records FINAL GROUP BY 1"
    """
    settings = settings_of(ctx)
    try:
        result = asyncio.run(_run(settings, query, timeout))
    except AglError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(1) from error
    render(result, output, Console())
