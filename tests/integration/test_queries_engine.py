"""Every read-side SQL builder against the real embedded engine.

Rows go in the way the sinks put them there (TableSink._insert: the Avro container through the
Null tables and materialized views, or the Python rows of the resources sink), so the ingest
transforms are proven together with the queries. No Kafka needed.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import DatabaseError

from agl_stream.config import Settings
from agl_stream.kafka.io import Fetched
from agl_stream.models import (
    LLM,
    AglModel,
    Attempt,
    ModelCheckpoint,
    PromptTemplate,
    ProxyLLM,
    ResourcesUpdate,
    Rollout,
    RolloutConfig,
    RolloutState,
    Span,
    Worker,
)
from agl_stream.store.queries import (
    Query,
    StoreQueries,
    attempt_from_row,
    resources_from_row,
    rollout_from_row,
    span_from_row,
    statistics_from_row,
    worker_from_row,
)
from agl_stream.store.readside import ClickHouseReadSide
from agl_stream.wire.codec import Codec
from consumers.clickhouse_sink import TableSink
from consumers.sink_specs import REDACTED, RESOURCES, ROLLOUT_STATE, SPANS, WORKERS, SinkSpec
from tests.integration.helpers import clickhouse
from tests.unit.test_codec import span_dict

pytestmark = pytest.mark.integration

Q = StoreQueries("agl")


class Engine:
    """The embedded engine with the sinks' tables, fed record by record at increasing offsets."""

    def __init__(self, settings: Settings, client: Client) -> None:
        self.settings = settings
        self.client = client
        self.codec = Codec.default()
        self.sinks: dict[str, TableSink] = {}
        self.offset = 0

    def put(self, spec: SinkSpec, *records: AglModel, partition: int = 0) -> None:
        """One INSERT, as one sink batch would do it."""
        sink = self.sinks.get(spec.name)
        if sink is None:
            sink = self.sinks[spec.name] = TableSink(self.settings, self.client, spec)
            sink.prepare_tables()
        batch = []
        for record in records:
            raw = self.codec.encode(record)
            body = sink.bodies(raw)  # what the sink's consumer hands over (a span becomes a one-span batch)
            assert body is not None
            batch.append(Fetched(spec.topic, partition, self.offset, None, body, raw, 0))
            self.offset += 1
        sink._insert(batch, {})

    def rows(self, query: Query) -> list[dict[str, Any]]:
        result = self.client.query(query.sql, parameters=query.parameters or None)
        return [dict(zip(result.column_names, row, strict=True)) for row in result.result_rows]


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    settings = Settings(data_dir=tmp_path)
    with clickhouse(settings) as client:
        yield Engine(settings, client)


def rollout(rollout_id: str, start: float, status: str = "queuing", **fields: Any) -> Rollout:
    return Rollout.model_validate(
        {"rollout_id": rollout_id, "input": {"task": rollout_id}, "start_time": start, "status": status, **fields}
    )


def attempt(rollout_id: str, seq: int, status: str, worker: str | None = None, **fields: Any) -> Attempt:
    return Attempt.model_validate(
        {
            "rollout_id": rollout_id,
            "attempt_id": f"at-{rollout_id[3:]}{seq}",
            "sequence_id": seq,
            "start_time": 100.0 + seq,
            "status": status,
            "worker_id": worker,
            **fields,
        }
    )


def state(r: Rollout, version: int, *attempts: Attempt) -> RolloutState:
    return RolloutState(
        rollout=r, attempts=list(attempts), version=version, cause_event_id=f"ev-{version}", cause_time=1
    )


# -- rollouts and attempts -----------------------------------------------------------------


def test_rollouts_read_the_newest_version_and_filter_after_final(engine: Engine) -> None:
    first = rollout("ro-a1", 1.0)
    running = rollout(
        "ro-a1",
        1.0,
        "running",
        metadata={"k": [1, 2.5]},
        mode="train",
        config=RolloutConfig(timeout_seconds=30.0, retry_condition=["failed"]),
    )
    other = rollout("ro-b2", 2.0, "succeeded", end_time=5.5, resources_id="rs-1")
    third = rollout("ro-c3", 0.5)
    engine.put(ROLLOUT_STATE, state(first, 1))
    engine.put(ROLLOUT_STATE, state(running, 3, attempt("ro-a1", 1, "running", "w1")), state(other, 2))
    engine.put(ROLLOUT_STATE, state(third, 1))
    engine.put(ROLLOUT_STATE, state(first, 2))  # older than version 3, arriving later (a replay)

    def ids(query: Query) -> list[str]:
        return [rollout_from_row(r).rollout_id for r in engine.rows(query)]

    # Default order is enqueue order (start_time); every rollout once, at its newest version.
    assert [rollout_from_row(r) for r in engine.rows(Q.rollouts())] == [third, running, other]
    # WHERE applies after FINAL: ro-a1 was queuing once, it is running now.
    assert ids(Q.rollouts(status_in=["queuing"])) == ["ro-c3"]
    assert ids(Q.rollouts(status_in=["running", "succeeded"], rollout_id_in=["ro-b2", "ro-c3"])) == ["ro-b2"]
    assert ids(Q.rollouts(status_in=["running"], rollout_id_in=["ro-c3"], filter_logic="or")) == ["ro-c3", "ro-a1"]
    assert ids(Q.rollouts(rollout_id_contains="b")) == ["ro-b2"]
    assert ids(Q.rollouts(status_in=[])) == []
    assert ids(Q.rollouts(status_in=[], rollout_id_contains="a", filter_logic="or")) == ["ro-a1"]
    assert ids(Q.rollouts(sort_by="start_time", sort_order="desc")) == ["ro-b2", "ro-a1", "ro-c3"]
    assert ids(Q.rollouts(sort_by="status")) == ["ro-c3", "ro-a1", "ro-b2"]
    # NULLs last either way: only ro-b2 has an end_time.
    assert ids(Q.rollouts(sort_by="end_time", sort_order="desc")) == ["ro-b2", "ro-a1", "ro-c3"]
    assert ids(Q.rollouts(sort_by="rollout_id", limit=2)) == ["ro-a1", "ro-b2"]
    assert ids(Q.rollouts(sort_by="rollout_id", limit=1, offset=1)) == ["ro-b2"]
    assert ids(Q.rollouts(sort_by="rollout_id", offset=2)) == ["ro-c3"]
    assert ids(Q.rollouts(limit=0)) == []
    [row] = engine.rows(Q.rollout_by_id("ro-a1"))
    assert rollout_from_row(row) == running
    assert engine.rows(Q.rollout_by_id("ro-zz")) == []


def test_attempts_and_the_latest_attempt(engine: Engine) -> None:
    r = rollout("ro-a1", 1.0, "running")
    a1 = attempt("ro-a1", 1, "failed", "w1", end_time=150.0, metadata={"reason": "boom"})
    a2 = attempt("ro-a1", 2, "running", "w2", last_heartbeat_time=160.5)
    engine.put(ROLLOUT_STATE, state(r, 2, a1), state(r, 3, a1, a2))
    engine.put(ROLLOUT_STATE, state(rollout("ro-b2", 2.0), 1, attempt("ro-b2", 1, "preparing")))

    assert [attempt_from_row(x) for x in engine.rows(Q.attempts("ro-a1"))] == [a1, a2]
    assert [attempt_from_row(x) for x in engine.rows(Q.attempts("ro-a1", sort_order="desc"))] == [a2, a1]
    assert [attempt_from_row(x) for x in engine.rows(Q.attempts("ro-a1", sort_by="worker_id", limit=1))] == [a1]
    assert [attempt_from_row(x) for x in engine.rows(Q.attempts("ro-a1", offset=1))] == [a2]
    [latest] = engine.rows(Q.latest_attempts(["ro-a1"]))
    assert attempt_from_row(latest) == a2
    assert engine.rows(Q.latest_attempts(["ro-zz"])) == []
    assert engine.rows(Q.attempts("ro-zz")) == []


# -- spans -----------------------------------------------------------------------------------


def make_span(attempt_id: str, seq: int, name: str = "step", parent_id: str | None = None, **fields: Any) -> Span:
    data = span_dict()
    data.update(
        attempt_id=attempt_id,
        sequence_id=seq,
        span_id=f"{seq:016x}",
        trace_id=f"{seq % 2:032x}",
        parent_id=parent_id,
        name=name,
        start_time=1000.0 - seq,
        **fields,
    )
    return Span.model_validate(data)


def test_span_json_round_trips_typed_attribute_values(engine: Engine) -> None:
    tricky = make_span(
        "at-1",
        1,
        attributes={
            "float_one": 1.0,
            "int_one": 1,
            "true": True,
            "text": 'quote " slash / backslash \\ newline \n é 😀',
            "none": None,
            "big": 2**63 - 1,
            "small": -(2**63),
            "huge": 1e20,
            "tiny": 1e-7,
            "negative_zero": -0.0,
            "nan": float("nan"),
            "minus_inf": float("-inf"),
            "mixed": [True, 1, 1.0, "1", None],
            "floats": [1.0, 2.5],
            "empty": [],
        },
        end_time=None,
        context={"trace_id": "a" * 32, "span_id": "b" * 16, "is_remote": True, "trace_state": {"k": "v"}},
        parent={"trace_id": "a" * 32, "span_id": "c" * 16},
        status={"status_code": "ERROR", "description": "failed"},
    )
    engine.put(SPANS, tricky)
    [row] = engine.rows(Q.spans("ro-0123456789ab"))
    back = span_from_row(row)
    nan = back.attributes.pop("nan")
    assert isinstance(nan, float) and math.isnan(nan)  # NaN != NaN: compared apart
    expected = tricky.model_copy(deep=True)
    expected.attributes.pop("nan")
    assert back == expected
    for key, value in expected.attributes.items():  # == says 1 == 1.0 == True; types must hold too
        got = back.attributes[key]
        assert type(got) is type(value), key
        if isinstance(value, list) and isinstance(got, list):
            assert [type(v) for v in value] == [type(v) for v in got], key
    negative_zero = back.attributes["negative_zero"]
    assert isinstance(negative_zero, float) and math.copysign(1.0, negative_zero) == -1.0


def test_span_queries_filter_sort_and_page(engine: Engine) -> None:
    r = rollout("ro-0123456789ab", 1.0, "running")
    engine.put(ROLLOUT_STATE, state(r, 2, attempt(r.rollout_id, 1, "failed"), attempt(r.rollout_id, 2, "running")))
    old = [make_span("at-0123456789ab1", i) for i in (1, 2)]
    new = [
        make_span("at-0123456789ab2", 3, "llm.call", parent_id=f"{1:016x}"),
        make_span("at-0123456789ab2", 4, "reward"),
        make_span("at-0123456789ab2", 5, "llm.call", parent_id=f"{4:016x}"),
    ]
    engine.put(SPANS, *old, *new)
    engine.put(SPANS, make_span("at-other", 1, rollout_id="ro-other"))

    def seqs(query: Query) -> list[int]:
        return [span_from_row(x).sequence_id for x in engine.rows(query)]

    rid = r.rollout_id
    assert [span_from_row(x) for x in engine.rows(Q.spans(rid))] == [*old, *new]
    assert seqs(Q.spans(rid, "latest")) == [3, 4, 5]
    assert seqs(Q.spans(rid, "at-0123456789ab1")) == [1, 2]
    assert seqs(Q.spans(rid, "at-nope")) == []
    assert seqs(Q.spans(rid, name="llm.call")) == [3, 5]
    assert seqs(Q.spans(rid, name_contains="llm", parent_id=f"{4:016x}")) == [5]
    assert seqs(Q.spans(rid, name="reward", parent_id=f"{4:016x}", filter_logic="or")) == [4, 5]
    assert seqs(Q.spans(rid, "latest", name="reward", trace_id=f"{1:032x}", filter_logic="or")) == [3, 4, 5]
    assert seqs(Q.spans(rid, trace_id_contains="1", span_id_contains="3")) == [3]
    assert seqs(Q.spans(rid, span_id=f"{2:016x}")) == [2]
    assert seqs(Q.spans(rid, parent_id_contains="0004")) == [5]
    assert seqs(Q.spans(rid, sort_order="desc", limit=2)) == [5, 4]
    assert seqs(Q.spans(rid, limit=2, offset=1)) == [2, 3]
    assert seqs(Q.spans(rid, sort_by="start_time")) == [5, 4, 3, 2, 1]
    assert seqs(Q.spans(rid, sort_by="name", sort_order="desc", limit=1)) == [1]
    assert seqs(Q.spans("ro-none")) == []


# -- resources ---------------------------------------------------------------------------


def test_resources_by_id_latest_and_listing(engine: Engine) -> None:
    def update(resources_id: str, version: int, when: float) -> ResourcesUpdate:
        return ResourcesUpdate(
            resources_id=resources_id,
            create_time=when,
            update_time=when + version,
            version=version,
            resources={
                "llm": LLM(endpoint="http://x/v1", model="m", sampling_parameters={"temperature": 0.7}),
                "proxy": ProxyLLM(endpoint="http://proxy/v1", model="m", api_key="k"),
                "prompt": PromptTemplate(template="Hi {name}", engine="f-string"),
                "ckpt": ModelCheckpoint(uri="s3://c", model="m", policy_version=version, metadata={"step": 1.5}),
            },
        )

    def stored(written: ResourcesUpdate) -> ResourcesUpdate:  # every SQL reader may read the table
        keyless = {
            name: r.model_copy(update={"api_key": REDACTED}) if getattr(r, "api_key", None) else r
            for name, r in written.resources.items()
        }
        return written.model_copy(update={"resources": keyless})

    a1, b1, a2 = (stored(u) for u in (update("rs-a", 1, 10.0), update("rs-b", 1, 20.0), update("rs-a", 2, 10.0)))
    assert a1.resources["proxy"].api_key == REDACTED  # type: ignore[union-attr]
    engine.put(RESOURCES, update("rs-a", 1, 10.0), update("rs-b", 1, 20.0))
    assert resources_from_row(engine.rows(Q.latest_resources())[0]) == b1
    engine.put(RESOURCES, update("rs-a", 2, 10.0))  # update_resources: same id, written later, now the latest

    [row] = engine.rows(Q.resources_by_id("rs-a"))
    assert resources_from_row(row) == a2
    assert resources_from_row(engine.rows(Q.latest_resources())[0]) == a2
    assert [resources_from_row(x) for x in engine.rows(Q.resources())] == [a2, b1]
    assert [resources_from_row(x).resources_id for x in engine.rows(Q.resources(resources_id_contains="b"))] == ["rs-b"]
    assert engine.rows(Q.resources(resources_id="rs-a", resources_id_contains="b")) == []
    listed = engine.rows(Q.resources(sort_by="version", sort_order="desc", limit=1))
    assert [resources_from_row(x) for x in listed] == [a2]
    assert engine.rows(Q.resources_by_id("rs-zz")) == []


def test_no_resources_means_no_latest(engine: Engine) -> None:
    engine.put(ROLLOUT_STATE, state(rollout("ro-a1", 1.0), 1))  # creates every table
    assert engine.rows(Q.latest_resources()) == []


# -- workers -----------------------------------------------------------------------------


def test_worker_status_is_derived_from_attempts(engine: Engine) -> None:
    engine.put(
        WORKERS,
        Worker(worker_id="w-idle", status="busy", heartbeat_stats={"gpu": 0.5}, last_heartbeat_time=500.0),
        Worker(worker_id="w-quiet", status="idle", last_heartbeat_time=400.0, last_idle_time=390.0),
    )
    engine.put(
        WORKERS, Worker(worker_id="w-idle", status="busy", heartbeat_stats={"gpu": 0.9}, last_heartbeat_time=600.0)
    )
    r1, r2, r3 = (rollout(f"ro-{i}", float(i), "running") for i in (1, 2, 3))
    engine.put(
        ROLLOUT_STATE,
        # w-idle: its latest attempt succeeded -> idle, even though its heartbeat said busy
        state(
            r1,
            4,
            attempt("ro-1", 1, "failed", "w-idle", end_time=120.0),
            attempt("ro-1", 2, "succeeded", "w-idle", end_time=130.0, last_heartbeat_time=125.0),
        ),
        # w-busy: running -> busy, assigned to it
        state(r2, 2, attempt("ro-2", 1, "running", "w-busy", last_heartbeat_time=140.0)),
        # w-lost: unresponsive -> unknown
        state(r3, 2, attempt("ro-3", 1, "unresponsive", "w-lost")),
    )

    workers = {w.worker_id: w for w in (worker_from_row(x) for x in engine.rows(Q.workers()))}
    assert workers == {
        "w-busy": Worker(
            worker_id="w-busy",
            status="busy",
            last_dequeue_time=101.0,
            last_busy_time=140.0,
            current_rollout_id="ro-2",
            current_attempt_id="at-21",
        ),
        "w-idle": Worker(
            worker_id="w-idle",
            status="idle",
            heartbeat_stats={"gpu": 0.9},
            last_heartbeat_time=600.0,
            last_dequeue_time=102.0,
            last_busy_time=130.0,
            last_idle_time=130.0,
        ),
        "w-lost": Worker(worker_id="w-lost", status="unknown", last_dequeue_time=101.0, last_busy_time=101.0),
        # no attempts: what its heartbeat says
        "w-quiet": Worker(worker_id="w-quiet", status="idle", last_heartbeat_time=400.0, last_idle_time=390.0),
    }

    def ids(query: Query) -> list[str]:
        return [worker_from_row(x).worker_id for x in engine.rows(query)]

    assert ids(Q.workers()) == ["w-busy", "w-idle", "w-lost", "w-quiet"]
    assert ids(Q.workers(status_in=["idle"])) == ["w-idle", "w-quiet"]
    assert ids(Q.workers(status_in=["idle"], worker_id_contains="quiet")) == ["w-quiet"]
    assert ids(Q.workers(status_in=["unknown"], worker_id_contains="busy", filter_logic="or")) == ["w-busy", "w-lost"]
    assert ids(Q.workers(sort_by="last_heartbeat_time", sort_order="desc")) == ["w-idle", "w-quiet", "w-busy", "w-lost"]
    assert ids(Q.workers(sort_by="worker_id", sort_order="desc", limit=2, offset=1)) == ["w-lost", "w-idle"]
    [row] = engine.rows(Q.worker_by_id("w-busy"))
    assert worker_from_row(row) == workers["w-busy"]
    [row] = engine.rows(Q.worker_by_id("w-quiet"))
    assert worker_from_row(row) == workers["w-quiet"]
    assert engine.rows(Q.worker_by_id("w-none")) == []


# -- statistics and the read-only client -------------------------------------------------


def test_statistics(engine: Engine) -> None:
    r = rollout("ro-0123456789ab", 1.0, "running")
    engine.put(ROLLOUT_STATE, state(r, 1), state(r, 2, attempt(r.rollout_id, 1, "running", "w-1")))
    engine.put(ROLLOUT_STATE, state(rollout("ro-2", 2.0), 1))
    engine.put(SPANS, make_span("at-1", 1), make_span("at-1", 2))
    engine.put(WORKERS, Worker(worker_id="w-2"))
    engine.put(RESOURCES, ResourcesUpdate(resources_id="rs-1", create_time=1, update_time=1, version=1))
    [row] = engine.rows(Q.statistics())
    assert statistics_from_row(row) == {
        "total_rollouts": 2,
        "total_attempts": 1,
        "total_spans": 2,
        "total_resources": 1,
        "total_workers": 2,
    }


async def test_clickhouse_read_side_waits_on_sink_offsets_and_refuses_writes(tmp_path: Path) -> None:
    from agl_stream.errors import FenceTimeoutError, QueryError

    settings = Settings(data_dir=tmp_path)
    with clickhouse(settings) as client:
        Engine(settings, client).put(ROLLOUT_STATE, state(rollout("ro-a1", 1.0), 1))
        client.insert(
            "agl.sink_offsets",
            [["clickhouse-rollout-state", "agl.rollout-state", 0, 6, 0]],
            column_names=["Sink", "Topic", "Partition", "NextOffset", "AppliedAt"],
        )
    reads = ClickHouseReadSide(settings, poll_interval=0.01)
    try:
        query = Q.rollouts()
        result = await reads.query(query.sql, query.parameters, fence={"agl.rollout-state": {0: 5}}, timeout=120)
        assert [rollout_from_row(r).rollout_id for r in result.dicts()] == ["ro-a1"]
        with pytest.raises(FenceTimeoutError, match=r"agl\.rollout-state"):
            await reads.query("SELECT 1", fence={"agl.rollout-state": {0: 6}}, timeout=0.1)
        with pytest.raises(QueryError) as refused:
            await reads.query("DROP TABLE agl.rollouts")
        assert refused.value.code == 164  # READONLY
    finally:
        await reads.aclose()
    with clickhouse(settings) as client:
        assert int(str(client.command("SELECT count() FROM agl.rollouts"))) == 1


def test_engine_rejects_nothing_the_builders_make(engine: Engine) -> None:
    """Every builder, with every option at once, is valid SQL for the engine (empty tables)."""
    engine.put(ROLLOUT_STATE, state(rollout("ro-a1", 1.0), 1))
    queries = [
        Q.rollouts(
            status_in=["queuing"],
            rollout_id_in=["a"],
            rollout_id_contains="a",
            filter_logic="or",
            sort_by="mode",
            sort_order="desc",
            limit=3,
            offset=1,
        ),
        Q.attempts("ro-a1", sort_by="last_heartbeat_time", sort_order="desc", limit=1, offset=1),
        Q.spans(
            "ro-a1",
            "latest",
            trace_id="t",
            trace_id_contains="t",
            span_id="s",
            span_id_contains="s",
            parent_id="p",
            parent_id_contains="p",
            name="n",
            name_contains="n",
            filter_logic="or",
            limit=1,
            offset=1,
            sort_by="end_time",
            sort_order="desc",
        ),
        Q.resources(resources_id="r", resources_id_contains="r", sort_by="update_time", limit=1, offset=1),
        Q.workers(
            status_in=["busy"],
            worker_id_contains="w",
            filter_logic="or",
            sort_by="current_rollout_id",
            sort_order="desc",
            limit=1,
            offset=1,
        ),
    ]
    for query in queries:
        try:
            engine.rows(query)
        except DatabaseError as exc:  # pragma: no cover - the message is the point
            pytest.fail(f"{exc}\n{query.sql}")
