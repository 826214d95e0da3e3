"""How the CLI prints: one console, tables that fit the terminal, one format for times.

- :func:`format_time`: every time the CLI prints, ISO 8601 in UTC to the second
  (``2026-01-05T14:03:07Z``); :func:`cell` applies it to the values of a table.
- :func:`new_table` and :func:`show`: a table within the console's width. Cells wrap, and a
  word longer than its column (an id, a URL) folds onto the next line instead of being cut; a
  table too wide for even its headers prints one block of ``column  value`` lines per row.

rich loads only when something is printed (``--help`` does not pay for it here).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import date, datetime, timezone
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console, RenderableType
    from rich.table import Table

NULL = "NULL"


def format_time(moment: float | datetime, *, milliseconds: bool = False) -> str:
    """``moment`` (epoch seconds, or a datetime; a naive one is UTC, as the stack's ClickHouse
    columns are) as ISO 8601 in UTC: ``2026-01-05T14:03:07Z``, or ``...07.250Z`` with milliseconds."""
    if isinstance(moment, datetime):
        utc = moment.replace(tzinfo=timezone.utc) if moment.tzinfo is None else moment.astimezone(timezone.utc)
    else:
        utc = datetime.fromtimestamp(moment, timezone.utc)
    return utc.isoformat(timespec="milliseconds" if milliseconds else "seconds").replace("+00:00", "Z")


def cell(value: object, *, none: str = "-") -> str:
    """A value as a table cell: times in the CLI's one format (with the milliseconds a time has),
    ``none`` for a missing value, anything else as ``str`` does."""
    if value is None:
        return none
    if isinstance(value, datetime):
        return format_time(value, milliseconds=value.microsecond != 0)
    if isinstance(value, date):
        return value.isoformat()
    return str(value)


def fits(headers: Sequence[str], width: int) -> bool:
    """Whether a table with these headers can be drawn ``width`` cells wide with every header
    whole: each column its header, one cell of padding either side and one border line."""
    from rich.cells import cell_len

    return sum(cell_len(h) + 3 for h in headers) + 1 <= width


def console(*, stderr: bool = False) -> Console:
    """A console on stdout (or stderr) at the terminal's width (``COLUMNS`` when it is not a terminal)."""
    from rich.console import Console

    return Console(stderr=stderr)


def new_table(*columns: str, title: str | None = None) -> Table:
    """A table whose cells wrap within their column and fold a word longer than it (nothing is cut off)."""
    from rich.table import Table

    table = Table(title=title)
    for header in columns:
        table.add_column(header, overflow="fold")
    return table


def show(table: Table, out: Console | None = None) -> None:
    """Print ``table`` within the width of ``out`` (stdout's console by default); one block of
    ``column  value`` lines per row when the table is too wide for even its headers."""
    from rich.table import Table

    out = out if out is not None else console()
    headers = [str(column.header) for column in table.columns]
    if fits(headers, out.width):
        out.print(table)
        return
    if table.title:
        out.print(table.title, style="bold")
    rows: list[list[RenderableType]] = [list(column.cells) for column in table.columns]
    for index in range(table.row_count):
        record = Table.grid(padding=(0, 2))
        record.add_column(style="bold", overflow="fold")
        record.add_column(overflow="fold")
        for header, cells in zip(headers, rows, strict=True):
            record.add_row(header, cells[index])
        out.print(record)
        if index < table.row_count - 1:
            out.print()
