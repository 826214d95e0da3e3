"""The dashboard's pure core (consumers/dashboard_sql.py): filters, paging SQL, the waterfall
layout, throughput series, the schema statement and the cookbook parser. No I/O."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from consumers import dashboard_sql as dsql
from consumers.dashboard import STATIC, _static
from consumers.gateway_sql import SqlRefusedError, schema_statement

ROOT = Path(__file__).resolve().parents[2]


# -- filters and paging ---------------------------------------------------------------------------


def test_no_filter_pages_newest_first_with_bound_limit_and_offset() -> None:
    page, count = dsql.rollouts_page("agl", dsql.RolloutFilter())
    assert "WHERE" not in page.sql and "WHERE" not in count.sql
    assert "ORDER BY start_time DESC, rollout_id DESC LIMIT {limit:UInt32} OFFSET {offset:UInt64}" in page.sql
    assert page.parameters == {"limit": 50, "offset": 0}
    assert count.parameters == {}


def test_every_filter_is_a_bound_parameter_never_pasted_text() -> None:
    hostile = "x' OR 1=1 --"
    f = dsql.RolloutFilter(
        status="failed", mode=hostile, policy_version=3, group_id=hostile, since=10.5, until=20.0, limit=25, offset=75
    )
    page, count = dsql.rollouts_page("agl", f)
    assert hostile not in page.sql and hostile not in count.sql
    for fragment in (
        "status = {status:String}",
        "mode = {mode:String}",
        "policy_version = {policy_version:Int64}",
        "{group_id:String}",
        "start_time >= {since:Float64}",
        "start_time < {until:Float64}",
    ):
        assert fragment in page.sql and fragment in count.sql
    assert page.parameters == {
        "status": "failed", "mode": hostile, "policy_version": 3, "group_id": hostile,
        "since": 10.5, "until": 20.0, "limit": 25, "offset": 75,
    }  # fmt: skip
    assert count.parameters == {k: v for k, v in page.parameters.items() if k not in ("limit", "offset")}
    # the SQL names exactly the parameters it is given
    assert set(re.findall(r"\{(\w+):", page.sql)) == set(page.parameters)


def test_blank_form_fields_are_no_filter() -> None:
    f = dsql.RolloutFilter.model_validate({"status": "", "mode": "  ", "group_id": ""})
    assert (f.status, f.mode, f.group_id) == (None, None, None)


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ({"status": "exploded"}, "status"),
        ({"policy_version": "abc"}, "policy_version"),
        ({"limit": "100000"}, "limit"),
        ({"offset": "-1"}, "offset"),
        ({"since": "yesterday"}, "since"),
        ({"colour": "red"}, "colour"),
    ],
)
def test_bad_filters_are_refused_with_the_field_named(query: dict[str, str], field: str) -> None:
    with pytest.raises(ValidationError) as caught:
        dsql.RolloutFilter.model_validate(query)
    assert field in str(caught.value)


@pytest.mark.parametrize("order", ["asc", "desc"])
def test_a_sort_is_a_whitelisted_column_in_either_direction_ties_by_id(order: str) -> None:
    for sort in ("reward", "took", "status"):
        page, _ = dsql.rollouts_page("agl", dsql.RolloutFilter.model_validate({"sort": sort, "order": order}))
        direction = order.upper()
        expression = {"reward": "reward", "took": "end_time - start_time", "status": "status"}[sort]
        assert f"ORDER BY {expression} {direction}, rollout_id {direction} LIMIT" in page.sql
    # the reward column: the latest attempt's triplet record, joined whatever the sort
    assert "argMax(attempt_id, sequence_id)" in page.sql and "triplet_records FINAL" in page.sql


@pytest.mark.parametrize("query", [{"sort": "input"}, {"sort": "reward; DROP TABLE x"}, {"order": "sideways"}])
def test_an_unknown_sort_is_refused_by_name(query: dict[str, str]) -> None:
    with pytest.raises(ValidationError) as caught:
        dsql.RolloutFilter.model_validate(query)
    assert next(iter(query)) in str(caught.value)


def test_workers_bind_the_gone_threshold() -> None:
    query = dsql.workers("agl", dsql.WorkersParams.model_validate({"gone_after_s": "90"}).gone_after_s)
    assert query.parameters == {"gone_after_s": 90.0}
    assert "{gone_after_s:Float64}" in query.sql and "'stopped'" in query.sql
    with pytest.raises(ValidationError, match="gone_after_s"):
        dsql.WorkersParams.model_validate({"gone_after_s": "0"})


def test_only_an_identifier_is_pasted_as_the_database() -> None:
    with pytest.raises(ValueError, match="not a database name"):
        dsql.rollouts_page("agl; DROP TABLE x", dsql.RolloutFilter())


def test_a_rollouts_and_its_attempts_queries_bind_the_ids() -> None:
    hostile = "ro-1'; --"
    for query in dsql.rollout_detail("agl", hostile).values():
        assert hostile not in query.sql and query.parameters == {"rollout_id": hostile}
    spans = dsql.attempt_spans("agl", hostile, "at-1")
    assert hostile not in spans.sql and spans.parameters == {"rollout_id": hostile, "attempt_id": "at-1"}
    assert f"LIMIT {dsql.MAX_SPANS + 1}" in spans.sql  # one more than drawn: the page can say it was cut


# -- one policy version: its lineage ----------------------------------------------------------------


def test_the_version_page_binds_the_version_and_lists_one_more_span_than_it_shows() -> None:
    queries = dsql.version_lineage("agl", 7)
    assert set(queries) == {"steps", "batches", "attempts", "lineage"}
    for query in queries.values():
        assert query.parameters == {"version": 7} and "{version:Int64}" in query.sql
        assert re.search(r"policy_version = \d", query.sql) is None  # never pasted
    assert queries["lineage"].sql.endswith(f"LIMIT {dsql.MAX_LINEAGE + 1}")
    with pytest.raises(ValueError, match="not a database name"):
        dsql.version_lineage("agl; DROP TABLE x", 1)


@pytest.mark.parametrize("version", ["abc", "-1", "1.5", str(2**63)])
def test_a_bad_version_is_refused_with_the_field_named(version: str) -> None:
    with pytest.raises(ValidationError, match="version"):
        dsql.VersionParams.model_validate({"version": version})


def test_the_cookbooks_lineage_query_is_the_version_pages() -> None:
    """One query answers "which traces trained version N", in docs/sql.md and on the page."""
    [entry] = [q for q in dsql.cookbook((ROOT / "docs" / "sql.md").read_text()) if q["title"].startswith("Traces that")]
    assert entry["sql"] == dsql.trained_by_version("agl").replace("{version:Int64}", "1")


# -- the waterfall --------------------------------------------------------------------------------


def span(span_id: str, parent: str, start: int, duration: int, status: str = "OK") -> dsql.SpanRow:
    return dsql.SpanRow(span_id, parent, f"name-{span_id}", start, duration, status)


def test_waterfall_nests_children_under_parents_in_start_order() -> None:
    rows = [
        span("c2", "root", 600, 300),
        span("root", "", 0, 1000),
        span("c1", "root", 100, 400),
        span("g1", "c1", 150, 100, "ERROR"),
        span("other", "", 200, 100),
    ]
    laid = dsql.waterfall(rows)
    assert [(b["span_id"], b["depth"]) for b in laid] == [
        ("root", 0), ("c1", 1), ("g1", 2), ("c2", 1), ("other", 0),
    ]  # fmt: skip
    by_id = {b["span_id"]: b for b in laid}
    assert by_id["root"]["left"] == 0 and by_id["root"]["width"] == 1
    assert by_id["c2"]["left"] == pytest.approx(0.6) and by_id["c2"]["width"] == pytest.approx(0.3)
    assert by_id["g1"]["start_ms"] == pytest.approx(150 / 1e6) and by_id["g1"]["status"] == "ERROR"


def test_waterfall_roots_orphans_and_survives_cycles() -> None:
    rows = [
        span("a", "b", 0, 10),  # a <-> b: a cycle, neither reachable from a root
        span("b", "a", 5, 10),
        span("orphan", "missing", 20, 10),
        span("self", "self", 30, 10),
    ]
    laid = dsql.waterfall(rows)
    assert sorted(b["span_id"] for b in laid) == ["a", "b", "orphan", "self"]  # each once
    assert {b["span_id"]: b["depth"] for b in laid}["orphan"] == 0
    assert {b["span_id"]: b["depth"] for b in laid}["self"] == 0


def test_waterfall_of_nothing_and_of_instant_spans() -> None:
    assert dsql.waterfall([]) == []
    [bar] = dsql.waterfall([span("x", "", 5, 0)])
    assert (bar["left"], bar["width"]) == (0, 0)


# -- throughput, schema, cookbook -------------------------------------------------------------------


def test_series_fills_empty_buckets_and_gives_rates_per_second() -> None:
    step = dsql.bucket_seconds(600)
    assert step == 10
    xs, ys = dsql.series([(1000, 20), (1030, 5)], 600)
    assert xs == [1000.0, 1010.0, 1020.0, 1030.0]
    assert ys == [2.0, 0.0, 0.0, 0.5]
    assert dsql.series([], 600) == [[], []]


def test_the_schema_statement_is_bound_to_the_database() -> None:
    query = dsql.schema("agl")
    assert query.parameters == {"database": "agl"}
    assert "database = {database:String}" in query.sql
    assert dsql.schema_tables([("rollouts", "rollout_id", "String"), ("rollouts", "status", "String")]) == {
        "rollouts": [["rollout_id", "String"], ["status", "String"]]
    }


def test_the_cookbook_of_docs_sql_md_is_parsed_whole() -> None:
    text = (ROOT / "docs" / "sql.md").read_text()
    section = text[text.index("## The cookbook") : text.index("## Limits")]
    queries = dsql.cookbook(text)
    assert len(queries) == section.count("```sql") > 10
    first = queries[0]
    assert first["title"] == "Reward curve per policy version"
    assert first["sql"].startswith("SELECT policy_version") and "```" not in first["sql"]
    assert first["description"].startswith("The mean final reward")


# -- static files ---------------------------------------------------------------------------------


def test_static_files_are_served_from_their_folder_only() -> None:
    ok = _static("app.js")
    assert ok.status_code == 200 and ok.media_type == "text/javascript"
    assert "default-src 'self'" in ok.headers["content-security-policy"]
    for name in ("../dashboard.py", "/etc/passwd", "vendor/../../gateway.py", "missing.js"):
        assert _static(name).status_code == 404, name
    assert (STATIC / "vendor" / "uPlot.LICENSE.txt").is_file()  # the vendored library carries its licence


def test_span_rows_read_the_exporters_status_codes() -> None:
    row = {
        "SpanId": "s", "ParentSpanId": "", "SpanName": "n", "start_ns": 5, "Duration": 7,
        "StatusCode": "STATUS_CODE_ERROR",
    }  # fmt: skip
    assert dsql.span_rows([row]) == [dsql.SpanRow("s", "", "n", 5, 7, "ERROR")]


def test_lag_counts_records_behind_the_end_per_consumer_and_topic() -> None:
    ends = {("t", 0): 10, ("t", 1): 5, ("u", 0): 7}
    committed = {
        "proc": {("t", 0): 8},  # partition 1 never committed: all 5 of it wait
        "sink:spans": {("u", 0): 9},  # past the end (a recreated topic): nothing behind
    }
    assert dsql.lag_rows(committed, ends) == [
        {"consumer": "proc", "topic": "t", "applied": 8, "end": 15, "lag": 7},
        {"consumer": "sink:spans", "topic": "u", "applied": 7, "end": 7, "lag": 0},
    ]


# -- SHOW TABLES / DESCRIBE in /v1/sql (consumers/gateway_sql.py) ------------------------------------


def test_show_tables_and_describe_become_catalog_queries_bound_to_the_database() -> None:
    show = schema_statement("SHOW TABLES", "agl")
    assert show is not None and show[1] == {"database": "agl"} and "FROM system.tables" in show[0]
    assert schema_statement("SHOW TABLES FROM agl", "agl") == show
    described = schema_statement("DESCRIBE TABLE agl.rollouts", "agl")
    assert described is not None and described[1] == {"database": "agl", "table": "rollouts"}
    assert schema_statement("DESCRIBE TABLE rollouts", "agl") == described
    assert "{table:String}" in described[0] and "rollouts" not in described[0]  # bound, not pasted


@pytest.mark.parametrize("canonical", ["SHOW TABLES FROM system", "DESCRIBE TABLE system.tables"])
def test_show_and_describe_of_another_database_are_refused(canonical: str) -> None:
    with pytest.raises(SqlRefusedError) as caught:
        schema_statement(canonical, "agl")
    assert caught.value.kind == "forbidden_table" and "outside the database agl" in str(caught.value)


@pytest.mark.parametrize(
    "canonical",
    ["SHOW TABLES LIKE 'r%'", "DESCRIBE TABLE\n(\n    SELECT 1\n)", "SHOW CREATE TABLE agl.rollouts", "SELECT 1"],
)
def test_other_statements_take_the_ordinary_checks(canonical: str) -> None:
    assert schema_statement(canonical, "agl") is None
