"""The pure parts of /v1/sql: what a query tree says is read, what is refused, how results render."""

from __future__ import annotations

import json

from consumers.gateway_sql import SqlResult, objects_read, refusal, render, wrapped

TREE = [
    "QUERY id: 0",
    "  JOIN TREE",
    "    TABLE id: 3, alias: __table1, table_name: agl.rollouts, final: 1",
    "    QUERY id: 5, is_subquery: 1",
    "        TABLE id: 7, alias: __table2, table_name: system.tables",
    "    TABLE_FUNCTION id: 9, alias: __table3, table_function_name: Merge",
    "    TABLE id: 11, table_name: system.one",
]


def test_objects_read_lists_every_table_and_table_function() -> None:
    assert objects_read(TREE) == ({"agl.rollouts", "system.tables", "system.one"}, {"merge"})


def test_only_the_agl_database_system_one_and_harmless_table_functions_pass() -> None:
    assert refusal({"agl.rollouts", "system.one"}, {"numbers"}, "agl") is None
    reason = refusal({"agl.rollouts", "system.tables", "aglx.t"}, {"merge", "numbers"}, "agl")
    assert reason is not None
    assert "aglx.t, system.tables" in reason and "merge" in reason and "numbers" not in reason


def test_the_statement_is_checked_as_a_subquery() -> None:
    assert wrapped("SELECT 1") == "SELECT * FROM (\nSELECT 1\n)"


def test_formats() -> None:
    result = SqlResult(["a", "b"], ["UInt8", "Array(Float64)"], [[1, [0.5, float("nan")]], [None, []]], 2.5)
    body, media = render(result, "json")
    assert media == "application/json"
    assert json.loads(body)["rows"] == [[1, [0.5, "NaN"]], [None, []]]
    body, _ = render(result, "jsonl")
    assert [json.loads(line) for line in body.splitlines()] == [{"a": 1, "b": [0.5, "NaN"]}, {"a": None, "b": []}]
    body, media = render(result, "csv")
    assert media.startswith("text/csv") and body.decode().splitlines() == ["a,b", '1,"[0.5, ""NaN""]"', ",[]"]
    body, _ = render(result, "table")
    assert "NULL" in body.decode() and "2 row(s)" in body.decode()
