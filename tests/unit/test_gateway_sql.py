"""The pure parts of /v1/sql: what a query tree says is read, what is refused, how results render,
and how long a caller waits."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from agl_stream.errors import QueryError
from consumers.gateway_sql import (
    FunctionPolicy,
    SqlResult,
    ast_refusal,
    objects_read,
    refusal,
    render,
    within,
    wrapped,
)

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


# (name, categories, alias_to, case_insensitive, is_aggregate): a slice of system.functions.
CATALOG = [
    ("file", "Other", "", 0, 0),
    ("FQDN", "Other", "", 1, 0),
    ("fullHostName", "", "FQDN", 0, 0),
    ("identity", "Other", "", 0, 0),
    ("dictGet", "Dictionary", "", 0, 0),
    ("plus", "Arithmetic", "", 0, 0),
    ("lower", "String", "", 1, 0),
    ("lcase", "", "lower", 1, 0),
    ("count", "Aggregate Functions", "", 1, 1),
    ("quantileExact", "Aggregate Functions", "", 0, 1),
    ("toDateTime", "Type Conversion, Dates and Times", "", 0, 0),
]
POLICY = FunctionPolicy.from_catalog(CATALOG)


def test_the_function_policy_allows_computing_and_refuses_reading_the_host() -> None:
    for name in ("plus", "lower", "LOWER", "lcase", "count", "COUNT", "toDateTime", "identity", "lambda"):
        assert POLICY.allows(name), name
    for name in ("file", "FQDN", "fullHostName", "fqdn", "dictGet", "Plus", "nosuchfunction", "fileIf"):
        assert not POLICY.allows(name), name


def test_aggregate_combinators_are_allowed_on_allowed_aggregates_only() -> None:
    for name in ("countIf", "countDistinctIf", "quantileExactIf", "countOrNull", "countArrayIf", "COUNTIf"):
        assert POLICY.allows(name), name
    for name in ("If", "plusIf", "fileState", "dictGetOrNull"):
        assert not POLICY.allows(name), name


AST = """SelectWithUnionQuery (children 1)
 ExpressionList (children 1)
  SelectQuery (children 2)
   ExpressionList (children 2)
    Function {function} (alias x) (children 1)
     ExpressionList (children 1)
      Literal '/etc/hostname'
    Identifier {identifier}
   TablesInSelectQuery (children 1)
    TablesInSelectQueryElement (children 1)
     TableExpression (children 1)
      TableIdentifier {table}"""


def _ast(function: str = "lower", identifier: str = "rollout_id", table: str = "agl.rollouts") -> list[str]:
    return AST.format(function=function, identifier=identifier, table=table).splitlines()


def test_the_syntax_tree_decides_before_anything_is_evaluated() -> None:
    assert ast_refusal(_ast(), POLICY, "agl") is None
    assert ast_refusal(_ast(table="rollouts"), POLICY, "agl") is None  # unqualified: resolved in agl
    assert ast_refusal(_ast(function="numbers"), POLICY, "agl") is None  # a harmless table function
    kind, message = ast_refusal(_ast(function="file"), POLICY, "agl") or ("", "")
    assert kind == "forbidden_function" and "file" in message and "/etc" not in message
    kind, message = ast_refusal(_ast(table="system.users"), POLICY, "agl") or ("", "")
    assert kind == "forbidden_table" and "system.users" in message
    kind, _ = ast_refusal(_ast(identifier="system.tables"), POLICY, "agl") or ("", "")
    assert kind == "forbidden_table"  # `x IN system.tables`
    kind, message = ast_refusal(_ast(function="dictGet", table="other.t"), POLICY, "agl") or ("", "")
    assert kind == "forbidden_table" and "dictGet" in message and "other.t" in message


def test_a_statement_that_is_not_a_select_is_refused_as_read_only_before_its_functions() -> None:
    create = ["CreateQuery agl mine (children 3)", " Storage definition (children 1)", "  Function Memory"]
    assert (ast_refusal(create, POLICY, "agl") or ("", ""))[0] == "read_only"


def test_what_the_parser_writes_for_casts_and_case_is_allowed() -> None:
    for name in ("_CAST", "caseWithExpression", "lambda", "exists"):
        assert POLICY.allows(name), name


async def test_a_query_past_its_time_limit_is_abandoned_and_keeps_its_slot_until_it_ends() -> None:
    release = threading.Event()
    slots = asyncio.Semaphore(1)
    await slots.acquire()
    work = asyncio.get_running_loop().run_in_executor(None, release.wait, 30)
    work.add_done_callback(lambda _: slots.release())
    with pytest.raises(QueryError, match=r"past its time limit of 0\.2 s") as caught:
        await within(work, 0.2)  # the work would take 30 s: the caller is answered at 0.2 s + grace
    assert caught.value.code == 159
    assert slots.locked()  # the engine is still at it: no new query takes its place yet
    release.set()
    await asyncio.wait_for(slots.acquire(), 5)  # freed once it really ended


async def test_a_query_within_its_time_limit_answers() -> None:
    work = asyncio.get_running_loop().run_in_executor(None, lambda: 42)
    assert await within(work, 5) == 42
