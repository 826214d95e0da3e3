"""The CLI's output: one format for times, tables within the terminal's width."""

from __future__ import annotations

import io
from datetime import date, datetime, timedelta, timezone

from rich.cells import cell_len
from rich.console import Console

from agl_stream.cli import output
from agl_stream.cli.sql_cmd import OutputFormat, render
from agl_stream.store.readside import QueryResult

MOMENT = datetime(2026, 1, 5, 14, 3, 7, 250_000, tzinfo=timezone.utc)


def _console(width: int) -> Console:
    return Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False)


def _text(console: Console) -> str:
    file = console.file
    assert isinstance(file, io.StringIO)
    return file.getvalue()


def test_times_are_iso_8601_utc_to_the_second() -> None:
    assert output.format_time(MOMENT.timestamp()) == "2026-01-05T14:03:07Z"
    assert output.format_time(MOMENT) == "2026-01-05T14:03:07Z"
    assert output.format_time(MOMENT, milliseconds=True) == "2026-01-05T14:03:07.250Z"
    two_hours_east = MOMENT.astimezone(timezone(timedelta(hours=2)))
    assert output.format_time(two_hours_east) == "2026-01-05T14:03:07Z"
    assert output.format_time(MOMENT.replace(tzinfo=None)) == "2026-01-05T14:03:07Z"  # naive: UTC


def test_cells_show_times_in_that_format_and_a_mark_for_missing_values() -> None:
    assert output.cell(MOMENT) == "2026-01-05T14:03:07.250Z"
    assert output.cell(MOMENT.replace(microsecond=0)) == "2026-01-05T14:03:07Z"
    assert output.cell(date(2026, 1, 5)) == "2026-01-05"
    assert output.cell(None) == "-"
    assert output.cell(None, none=output.NULL) == "NULL"
    assert output.cell(1.5) == "1.5"


def test_a_table_fits_when_each_header_gets_its_width_padding_and_border() -> None:
    assert output.fits(["id", "state"], 2 + 5 + 3 * 2 + 1)
    assert not output.fits(["id", "state"], 2 + 5 + 3 * 2)
    assert output.fits([], 1)


def test_a_wide_table_wraps_within_the_width_and_keeps_every_character() -> None:
    rollout = "ro-" + "0123456789abcdef" * 2
    url = "http://127.0.0.1:43215/metrics/" + "x" * 40
    table = output.new_table("role", "pid", "url", title="roles")
    table.add_row("processor", "4242", url)
    table.add_row(rollout, "7", "-")
    console = _console(40)
    output.show(table, console)
    text = _text(console)
    assert max(cell_len(line) for line in text.splitlines()) <= 40
    columns = [[field.strip() for field in line.split("│")[1:-1]] for line in text.splitlines() if "│" in line]
    assert len(columns) > 3  # folded over several lines
    assert rollout in "".join(fields[0] for fields in columns)  # nothing cut off
    assert url in "".join(fields[2] for fields in columns)


def test_a_table_too_wide_for_its_headers_prints_one_block_per_row() -> None:
    headers = [f"column_{i}" for i in range(8)]
    table = output.new_table(*headers, title="many")
    table.add_row(*(f"v{i}" for i in range(8)))
    table.add_row(*(f"w{i}" for i in range(8)))
    console = _console(30)
    output.show(table, console)
    lines = _text(console).splitlines()
    assert lines[0] == "many"
    assert [line.split() for line in lines[1:9]] == [[f"column_{i}", f"v{i}"] for i in range(8)]
    assert lines[9] == ""
    assert [line.split() for line in lines[10:18]] == [[f"column_{i}", f"w{i}"] for i in range(8)]


def test_sql_tables_print_times_in_the_cli_format() -> None:
    result = QueryResult(["rollout_id", "start_time", "reward"], [["ro-1", MOMENT, None]])
    console = _console(120)
    render(result, OutputFormat.table, console)
    text = _text(console)
    assert "2026-01-05T14:03:07.250Z" in text
    assert "NULL" in text
    assert "1 row(s)" in text


def test_sql_tables_show_the_gateways_iso_times_in_the_cli_format_too() -> None:
    """Through the gateway a time arrives as JSON text (isoformat); the table shows it as the CLI shows times."""
    rows = [["2026-01-05T14:03:07.250000", "2026-01-05T16:03:07+02:00", "2026-01-05 14:03:07", "not a time"]]
    console = _console(200)
    render(QueryResult(["naive", "aware", "spaced", "text"], rows), OutputFormat.table, console)
    text = _text(console)
    assert "2026-01-05T14:03:07.250Z" in text
    assert "2026-01-05T14:03:07Z" in text
    assert "2026-01-05 14:03:07" in text  # not the gateway's shape: shown as it is
    assert "not a time" in text
