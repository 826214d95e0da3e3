"""The read side's pure parts: SQL builders, row mappers, fences, and picking a read side.

tests/integration/test_queries_engine.py runs the same builders against the engine; here the
shape of the SQL and the parameter handling are pinned down without one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from agl_stream.config import Settings
from agl_stream.errors import GatewayUnavailableError
from agl_stream.models import Attempt, ResourcesUpdate, Rollout, Span, Worker
from agl_stream.store.queries import (
    StoreQueries,
    resources_from_row,
    rollout_from_row,
    sortable_fields,
    statistics_from_row,
    worker_from_row,
)
from agl_stream.store.reads import StoreReads
from agl_stream.store.readside import (
    GATEWAY_FILE,
    ClickHouseReadSide,
    GatewayReadSide,
    KeyFences,
    QueryResult,
    fence_behind,
    fence_of,
    read_gateway_file,
    read_side_for,
)

Q = StoreQueries("agl")
HOSTILE = "x' OR 1=1 --"


def squash(sql: str) -> str:
    return " ".join(sql.split())


# -- sorting -----------------------------------------------------------------------------------


def test_sortable_fields_are_the_number_and_string_fields() -> None:
    assert sortable_fields(Rollout) == {"rollout_id", "start_time", "end_time", "mode", "resources_id", "status"}
    assert sortable_fields(Attempt) == {
        "rollout_id",
        "attempt_id",
        "sequence_id",
        "start_time",
        "end_time",
        "status",
        "worker_id",
        "last_heartbeat_time",
    }
    assert sortable_fields(Span) == {
        "rollout_id",
        "attempt_id",
        "sequence_id",
        "trace_id",
        "span_id",
        "parent_id",
        "name",
        "kind",
        "start_time",
        "end_time",
        "scope_name",
        "scope_version",
    }
    assert sortable_fields(ResourcesUpdate) == {"resources_id", "create_time", "update_time", "version"}
    assert sortable_fields(Worker) == set(Worker.model_fields) - {"heartbeat_stats"}


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda f: Q.rollouts(sort_by=f), "input"),
        (lambda f: Q.rollouts(sort_by=f), "config"),
        (lambda f: Q.rollouts(sort_by=f), "rollout_id; DROP TABLE x"),
        (lambda f: Q.attempts("ro-1", sort_by=f), "metadata"),
        (lambda f: Q.spans("ro-1", sort_by=f), "attributes"),
        (lambda f: Q.resources(sort_by=f), "resources"),
        (lambda f: Q.workers(sort_by=f), "heartbeat_stats"),
    ],
)
def test_sort_by_rejects_fields_that_are_not_numbers_or_strings(build: Any, field: str) -> None:
    with pytest.raises(ValueError, match="cannot sort"):
        build(field)


def test_sort_and_default_orders() -> None:
    assert "ORDER BY start_time ASC NULLS LAST, rollout_id" not in Q.rollouts().sql
    assert squash(Q.rollouts().sql).endswith("ORDER BY start_time, rollout_id")
    assert "ORDER BY end_time DESC NULLS LAST, rollout_id" in Q.rollouts(sort_by="end_time", sort_order="desc").sql
    assert "ORDER BY rollout_id ASC NULLS LAST" in squash(Q.rollouts(sort_by="rollout_id").sql)
    assert "ORDER BY sequence_id ASC NULLS LAST" in Q.attempts("ro-1").sql
    assert "ORDER BY SequenceId ASC NULLS LAST, AttemptId, SpanId" in Q.spans("ro-1").sql
    assert (
        "JSONExtract(SpanJson, 'end_time', 'Nullable(Float64)') DESC"
        in Q.spans("ro-1", sort_by="end_time", sort_order="desc").sql
    )
    assert squash(Q.resources().sql).endswith("ORDER BY create_time, resources_id")
    assert squash(Q.workers().sql).endswith("ORDER BY worker_id")
    with pytest.raises(ValueError, match="sort_order"):
        Q.rollouts(sort_order="up")  # type: ignore[arg-type]


# -- filters and paging ------------------------------------------------------------------------


def test_values_are_bound_never_spliced() -> None:
    queries = [
        Q.rollouts(status_in=[HOSTILE], rollout_id_in=[HOSTILE], rollout_id_contains=HOSTILE),
        Q.rollout_by_id(HOSTILE),
        Q.attempts(HOSTILE),
        Q.latest_attempts([HOSTILE]),
        Q.spans(HOSTILE, HOSTILE, trace_id=HOSTILE, span_id_contains=HOSTILE, name=HOSTILE),
        Q.spans(HOSTILE, "latest"),
        Q.resources(resources_id=HOSTILE, resources_id_contains=HOSTILE),
        Q.resources_by_id(HOSTILE),
        Q.workers(status_in=[HOSTILE], worker_id_contains=HOSTILE),
        Q.worker_by_id(HOSTILE),
    ]
    for query in queries:
        assert HOSTILE not in query.sql
        assert HOSTILE in json.dumps(query.parameters)
        for name in query.parameters:
            assert f"{{{name}:" in query.sql


def test_rollout_filters_combine_with_filter_logic() -> None:
    both = Q.rollouts(status_in=["running"], rollout_id_contains="ab")
    assert "WHERE (status IN {status_in:Array(String)} AND position(rollout_id, {rollout_id_contains:String}) > 0)" in (
        squash(both.sql)
    )
    assert both.parameters == {"status_in": ["running"], "rollout_id_contains": "ab"}
    either = Q.rollouts(rollout_id_in=("ro-1", "ro-2"), rollout_id_contains="ab", filter_logic="or")
    assert "(rollout_id IN {rollout_id_in:Array(String)} OR position(" in either.sql
    assert either.parameters["rollout_id_in"] == ["ro-1", "ro-2"]
    assert "WHERE" not in Q.rollouts().sql
    # An empty whitelist matches nothing, under AND and as one side of an OR.
    assert "WHERE (0)" in Q.rollouts(status_in=[]).sql
    assert "(0 OR position(" in Q.rollouts(status_in=[], rollout_id_contains="a", filter_logic="or").sql
    with pytest.raises(ValueError, match="filter_logic"):
        Q.rollouts(status_in=["running"], filter_logic="xor")  # type: ignore[arg-type]


def test_limit_and_offset() -> None:
    assert "LIMIT" not in Q.rollouts().sql and "OFFSET" not in Q.rollouts().sql
    page = Q.rollouts(limit=10, offset=20)
    assert page.sql.endswith("LIMIT {limit:UInt64} OFFSET {offset:UInt64}")
    assert page.parameters == {"limit": 10, "offset": 20}
    assert Q.rollouts(offset=5).sql.endswith("OFFSET {offset:UInt64}")
    assert Q.rollouts(limit=0).parameters == {"limit": 0}
    with pytest.raises(ValueError, match="limit"):
        Q.rollouts(limit=-2)
    with pytest.raises(ValueError, match="offset"):
        Q.spans("ro-1", offset=-1)


def test_span_attempt_scope_and_filters() -> None:
    every = Q.spans("ro-1")
    assert "AttemptId" not in every.sql.split("ORDER BY")[0]
    one = Q.spans("ro-1", "at-1")
    assert "AttemptId = {attempt_id:String}" in one.sql and one.parameters["attempt_id"] == "at-1"
    latest = Q.spans("ro-1", "latest")
    assert "argMax(attempt_id, sequence_id)" in latest.sql and "attempt_id" not in latest.parameters
    ored = Q.spans("ro-1", "latest", name="a", parent_id_contains="b", filter_logic="or")
    where = squash(ored.sql.split("ORDER BY")[0])
    # rollout and attempt always apply; the optional filters are one OR group next to them
    assert where.endswith(
        "WHERE RolloutId = {rollout_id:String} AND AttemptId = (SELECT argMax(attempt_id, sequence_id) FROM "
        "agl.attempts FINAL WHERE rollout_id = {rollout_id:String}) AND "
        "(position(ParentSpanId, {parent_id_contains:String}) > 0 OR SpanName = {name:String})"
    )


def test_state_tables_are_read_with_final() -> None:
    for query in (
        Q.rollouts(),
        Q.rollout_by_id("r"),
        Q.attempts("r"),
        Q.latest_attempts(["r"]),
        Q.spans("r"),
        Q.resources(),
        Q.resources_by_id("r"),
        Q.latest_resources(),
        Q.workers(),
        Q.statistics(),
    ):
        for table in ("rollouts", "attempts", "otel_traces", "resources", "workers"):
            assert f"agl.{table} " not in query.sql.replace(f"agl.{table} FINAL", "")


def test_database_name_is_checked() -> None:
    assert "FROM other.rollouts FINAL" in StoreQueries("other").rollouts().sql
    with pytest.raises(ValueError, match="database"):
        StoreQueries("agl; DROP")


# -- mappers -----------------------------------------------------------------------------------


def test_rows_map_back_to_models() -> None:
    rollout = rollout_from_row(
        {
            "rollout_id": "ro-1",
            "input": '{"q":[1,2.5]}',
            "start_time": 1.0,
            "end_time": None,
            "mode": None,
            "resources_id": None,
            "status": "running",
            "config": '{"max_attempts":2,"timeout_seconds":30}',
            "metadata": None,
        }
    )
    assert rollout.input == {"q": [1, 2.5]} and rollout.config.max_attempts == 2 and rollout.metadata is None
    assert rollout.config.timeout_seconds == 30.0
    resources = resources_from_row(
        {
            "resources_id": "rs-1",
            "create_time": 1.0,
            "update_time": 2.0,
            "version": 3,
            "resources": '{"p":{"resource_type":"prompt_template","template":"t","engine":"jinja"}}',
        }
    )
    assert resources.resources["p"].resource_type == "prompt_template"
    worker = worker_from_row(
        {**dict.fromkeys(Worker.model_fields), "worker_id": "w", "status": "idle", "heartbeat_stats": '{"gpu":1}'}
    )
    assert worker.heartbeat_stats == {"gpu": 1}
    stats = statistics_from_row(
        {"total_rollouts": 1, "total_attempts": 2, "total_spans": "3", "total_resources": 0, "total_workers": 4}
    )
    assert stats["total_spans"] == 3
    assert QueryResult(["a", "b"], [[1, 2], [3, 4]]).dicts() == [{"a": 1, "b": 2}, {"a": 3, "b": 4}]


# -- fences ------------------------------------------------------------------------------------


class Position:
    def __init__(self, topic: str, partition: int, offset: int) -> None:
        self.topic, self.partition, self.offset = topic, partition, offset


def test_fence_of_keeps_the_highest_offset_per_partition() -> None:
    written = [Position("a", 0, 5), Position("a", 0, 3), Position("a", 1, 0), Position("b", 2, 9)]
    assert fence_of(written) == {"a": {0: 5, 1: 0}, "b": {2: 9}}
    assert fence_of([]) == {}


def test_a_fence_holds_once_next_offsets_pass_the_records() -> None:
    fence = {"a": {0: 5, 1: 0}}
    assert fence_behind({"a": {0: 5, 1: 1}}, fence) == {"a": {0: 5}}  # next offset 5: record 5 not applied
    assert fence_behind({"a": {0: 6}}, fence) == {"a": {1: 0}}  # partition never seen: next offset 0
    assert fence_behind({"a": {0: 6, 1: 1}, "b": {0: 0}}, fence) == {}
    assert fence_behind({}, {}) == {}


def test_a_key_fence_waits_for_that_keys_records_only() -> None:
    fences = KeyFences(memory=10)
    fences.note("spans", "ro-a", 0, 5)
    fences.note("spans", "ro-b", 0, 9)
    fences.note("spans", "ro-a", 0, 3)  # an older record of ro-a: its fence stays at 5
    assert fences.of("spans", "ro-a") == {0: 5}
    assert fences.of("spans", "ro-b") == {0: 9}
    assert fences.of("spans", "ro-c") == {}  # nothing written about it: nothing to wait for
    assert fences.of("rollout-state", "ro-a") == {}


def test_forgotten_keys_and_keyless_records_raise_every_keys_fence() -> None:
    fences = KeyFences(memory=2)
    fences.note("spans", "ro-a", 0, 5)
    fences.note("spans", "ro-b", 1, 2)
    fences.note("spans", "ro-a", 0, 6)  # ro-a noted again: ro-b is now the least recent
    fences.note("spans", "ro-c", 0, 7)  # over the memory: ro-b is forgotten into the floor
    assert fences.of("spans", "ro-b") == {1: 2}  # still covered, through the floor
    assert fences.of("spans", "ro-x") == {1: 2}  # any key read waits for what was forgotten
    assert fences.of("spans", "ro-a") == {0: 6, 1: 2}
    fences.note("spans", None, 2, 4)  # a record whose key is not known
    assert fences.of("spans", "ro-a") == {0: 6, 1: 2, 2: 4}
    assert fences.of("workers", "ro-a") == {}


def test_a_worker_read_waits_for_that_workers_records_and_the_states_of_its_attempts_only() -> None:
    reads = StoreReads(Settings())
    state, workers, spans = (reads.topics[name] for name in ("rollout-state", "workers", "spans"))
    reads._note(workers, 0, 4, None, ("w1",))  # w1's heartbeat
    reads._note(workers, 0, 5, None, ("w2",))
    reads._note(state, 1, 7, "ro-a", {"w1"})  # a state of a rollout w1 has an attempt on
    reads._note(state, 1, 9, "ro-b", {"w2"})
    reads._note(state, 0, 3, "ro-c", set())  # no attempt: nobody's
    reads._note(spans, 0, 11, "ro-a", ())
    sources = ("workers", "rollout-state")
    assert reads._fence_for(sources, None, "w1") == {workers: {0: 4}, state: {1: 7}}
    assert reads._fence_for(sources, None, "w3") == {}  # nothing written about it
    assert reads._fence_for(sources, None) == {workers: {0: 5}, state: {0: 3, 1: 9}}  # every worker's read
    reads._note(state, 2, 1, None, ())  # a state whose rollout is not known: may be anyone's
    assert reads._fence_for(sources, None, "w3") == {state: {2: 1}}
    assert reads._fence_for(("rollout-state",), "ro-a") == {state: {1: 7, 2: 1}}


# -- choosing a read side ----------------------------------------------------------------------


def test_read_side_for_prefers_gateway_url_then_clickhouse_url_then_the_recorded_gateway(tmp_path: Path) -> None:
    side = read_side_for(Settings(data_dir=tmp_path, gateway_url="http://g:1/", clickhouse_url="http://c:2"))
    assert isinstance(side, GatewayReadSide) and side.url == "http://g:1"
    assert isinstance(read_side_for(Settings(data_dir=tmp_path, clickhouse_url="http://c:2")), ClickHouseReadSide)

    settings = Settings(data_dir=tmp_path)
    with pytest.raises(GatewayUnavailableError, match="agl-stream up"):
        read_side_for(settings)
    settings.run_dir.mkdir(parents=True)
    record = settings.run_dir / GATEWAY_FILE
    record.write_text(json.dumps({"url": "http://127.0.0.1:9", "pid": os.getpid()}))
    side = read_side_for(settings)
    assert isinstance(side, GatewayReadSide) and side.url == "http://127.0.0.1:9"


def test_a_gateway_record_of_a_dead_process_or_garbage_is_ignored(tmp_path: Path) -> None:
    record = tmp_path / GATEWAY_FILE
    assert read_gateway_file(tmp_path) is None
    record.write_text("{not json")
    assert read_gateway_file(tmp_path) is None
    record.write_text(
        json.dumps({"url": "http://127.0.0.1:9", "pid": 2**22 + 12345})
    )  # beyond pid_max: no such process
    assert read_gateway_file(tmp_path) is None
    record.write_text(json.dumps({"url": "http://127.0.0.1:9", "pid": os.getpid()}))
    found = read_gateway_file(tmp_path)
    assert found is not None and found.pid == os.getpid()
