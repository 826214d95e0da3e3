"""Upgrading a data dir in place on the real engine (chDB), no Kafka: the times migration turns the
Float64 seconds of a data dir made with the old schema into DateTime64, keeping every value to
the microsecond and readable through the store's queries; retention (clickhouse_ttl_days) is set,
changed and removed, deleting what is older."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from clickhouse_connect.driver.client import Client

from agl_stream.clickhouse import times
from agl_stream.clickhouse.client import get_client
from agl_stream.clickhouse.migrations import RETENTION, apply_retention, load_migrations, migrate
from agl_stream.config import Settings
from agl_stream.store.queries import (
    StoreQueries,
    attempt_from_row,
    resources_from_row,
    rollout_from_row,
    worker_from_row,
)

pytestmark = pytest.mark.integration

DB = "agl"
TIMES_VERSION = 11
# Fractions that a float cannot hold exactly, an instant before 1970 + 1 s, and today.
NOW = time.time()
START, END, CAUSE, FINISHED = 1767225600.123456, 1767225661.000001, 1767225661.654321, NOW
HEARTBEAT, DEQUEUE = NOW - 0.5, NOW - 10.999999


@pytest.fixture
def client(tmp_path: Any) -> Iterator[Client]:
    client = get_client(Settings(data_dir=tmp_path))
    try:
        yield client
    finally:
        client.close()


def _old_schema_with_rows(client: Client) -> None:
    """The schema before the times migration, and rows in it as its sinks wrote them."""
    old = [m for m in load_migrations() if m.version < TIMES_VERSION]
    migrate(client, DB, old)
    client.command(
        f"INSERT INTO {DB}.rollouts (rollout_id, input, start_time, end_time, status, config, version, "
        f"cause_event_id, cause_time, finished_time, kafka_partition, kafka_offset) VALUES "
        f"('ro-1', '{{}}', {START!r}, {END!r}, 'succeeded', '{{}}', 3, 'ev', {CAUSE!r}, {FINISHED!r}, 0, 7), "
        f"('ro-2', '{{}}', {NOW!r}, NULL, 'running', '{{}}', 1, 'ev', {NOW!r}, NULL, 0, 8)"
    )
    client.command(
        f"INSERT INTO {DB}.attempts (rollout_id, attempt_id, sequence_id, start_time, end_time, status, "
        f"worker_id, last_heartbeat_time, version, kafka_partition, kafka_offset) VALUES "
        f"('ro-1', 'at-1', 1, {START!r}, {END!r}, 'succeeded', 'w-1', {HEARTBEAT!r}, 3, 0, 7)"
    )
    client.command(
        f"INSERT INTO {DB}.resources (resources_id, create_time, update_time, version, resources, "
        f"kafka_partition, kafka_offset) VALUES ('rs-1', {START!r}, {CAUSE!r}, 2, '{{}}', 0, 1)"
    )
    client.command(
        f"INSERT INTO {DB}.workers (worker_id, status, last_heartbeat_time, last_dequeue_time, "
        f"kafka_partition, kafka_offset) VALUES ('w-2', 'idle', {HEARTBEAT!r}, {DEQUEUE!r}, 0, 1)"
    )
    client.command(
        f"INSERT INTO {DB}.triplet_records (rollout_id, attempt_id, group_id, n_triplets, finish_time, "
        f"kafka_partition, kafka_offset) VALUES ('ro-1', 'at-1', 'g', 1, {FINISHED!r}, 0, 1)"
    )
    client.command(
        f"INSERT INTO {DB}.dead_letters (source_topic, kafka_partition, kafka_offset, time, source_partition, "
        f"source_offset, reason, error_type, processor, value_size, value_kept, value_sha256) VALUES "
        f"('agl.spans', 0, 1, {CAUSE!r}, 0, 5, 'bad', 'CodecError', 'sink', 3, 3, '')"
    )
    # An ingest view made before the migration (named after an older writer schema): it still
    # selects Float64 seconds after it.
    client.command(f"CREATE TABLE {DB}.steps_ingest_old (t Float64, o UInt64) ENGINE = Null")
    client.command(
        f"CREATE MATERIALIZED VIEW {DB}.steps_ingest_old_mv TO {DB}.trainer_steps AS "
        "SELECT 'b-' || toString(o) AS batch_id, 'm' AS model, 1 AS policy_version, t AS step_time, "
        "1.0 AS step_seconds, 0.0 AS idle_seconds, toUInt64(o) AS kafka_offset FROM "
        f"{DB}.steps_ingest_old"
    )
    client.command(f"INSERT INTO {DB}.steps_ingest_old VALUES ({START!r}, 1)")


def _rows(client: Client, query: Any) -> list[dict[str, Any]]:
    result = client.query(query.sql, parameters=query.parameters)
    return [dict(zip(result.column_names, row, strict=True)) for row in result.result_rows]


def _cast_micros(value: float) -> int:
    """The microseconds the engine's cast of Float64 seconds keeps (it truncates): what the
    migration and an old ingest view make of a stored value. New rows are rounded to the nearest
    microsecond instead (the ingest SQL, times.micros, the models' StoredSeconds)."""
    return int(value * 1_000_000)


def _close(read: float | None, written: float) -> None:
    """Read back to the microsecond: the engine keeps the written value's whole microseconds."""
    assert read is not None
    assert read == _cast_micros(written) / 1e6
    assert abs(read - written) < 1e-6


def test_times_migrate_in_place_to_the_microsecond(client: Client) -> None:
    _old_schema_with_rows(client)

    applied = migrate(client, DB)

    assert [m.version for m in applied] == [TIMES_VERSION]
    types = {
        str(name): str(kind)
        for name, kind in client.query(
            "SELECT concat(table, '.', name), type FROM system.columns WHERE database = {db:String}",
            parameters={"db": DB},
        ).result_rows
    }
    for column in ("rollouts.start_time", "rollouts.cause_time", "attempts.start_time", "resources.create_time"):
        assert types[column] == times.TYPE
    for column in ("rollouts.end_time", "rollouts.finished_time", "workers.last_heartbeat_time"):
        assert types[column] == f"Nullable({times.TYPE})"
    for column in ("triplet_records.finish_time", "triplets.finish_time", "batches.created_time"):
        assert types[column] == times.TYPE
    assert types["trainer_steps.step_time"] == types["dead_letters.time"] == times.TYPE
    assert types["reward_by_policy_version.first_finish_time"] == times.TYPE  # the view, made again

    # The exact microseconds, in SQL.
    micros = client.query(
        f"SELECT toUnixTimestamp64Micro(start_time), toUnixTimestamp64Micro(end_time), "
        f"toUnixTimestamp64Micro(cause_time), toUnixTimestamp64Micro(finished_time) FROM {DB}.rollouts FINAL "
        "WHERE rollout_id = 'ro-1'"
    ).result_rows
    assert micros == [(_cast_micros(START), _cast_micros(END), _cast_micros(CAUSE), _cast_micros(FINISHED))]
    # Readable as times: the engine's time functions apply.
    (minute,) = client.query(
        f"SELECT toUnixTimestamp(toStartOfMinute(start_time)) FROM {DB}.rollouts FINAL WHERE rollout_id = 'ro-1'"
    ).result_rows
    assert minute == (int(START) // 60 * 60,)

    # Through the store: float seconds, as the models hold them.
    queries = StoreQueries(DB)
    (rollout,) = [rollout_from_row(r) for r in _rows(client, queries.rollout_by_id("ro-1"))]
    _close(rollout.start_time, START)
    _close(rollout.end_time, END)
    (running,) = [rollout_from_row(r) for r in _rows(client, queries.rollout_by_id("ro-2"))]
    _close(running.start_time, NOW)
    assert running.end_time is None
    assert [r.rollout_id for r in map(rollout_from_row, _rows(client, queries.rollouts(sort_by="start_time")))] == [
        "ro-1",
        "ro-2",
    ]
    (attempt,) = [attempt_from_row(r) for r in _rows(client, queries.attempts("ro-1"))]
    _close(attempt.start_time, START)
    _close(attempt.last_heartbeat_time, HEARTBEAT)
    (resources,) = [resources_from_row(r) for r in _rows(client, queries.resources_by_id("rs-1"))]
    _close(resources.create_time, START)
    _close(resources.update_time, CAUSE)
    workers = {w.worker_id: w for w in map(worker_from_row, _rows(client, queries.workers()))}
    _close(workers["w-2"].last_heartbeat_time, HEARTBEAT)
    _close(workers["w-2"].last_dequeue_time, DEQUEUE)
    _close(workers["w-1"].last_dequeue_time, START)  # from its attempt
    _close(workers["w-1"].last_busy_time, HEARTBEAT)

    # The old ingest view still writes: Float64 seconds become the same microseconds.
    client.command(f"INSERT INTO {DB}.steps_ingest_old VALUES ({CAUSE!r}, 2)")
    steps = client.query(
        f"SELECT batch_id, toUnixTimestamp64Micro(step_time) FROM {DB}.trainer_steps FINAL ORDER BY batch_id"
    ).result_rows
    assert steps == [("b-1", _cast_micros(START)), ("b-2", _cast_micros(CAUSE))]
    (dead,) = client.query(f"SELECT toUnixTimestamp64Micro(time) FROM {DB}.dead_letters FINAL").result_rows
    assert dead == (_cast_micros(CAUSE),)

    # Up to date: nothing more to do, and nothing changed by running again.
    assert migrate(client, DB) == []
    assert client.query(
        f"SELECT toUnixTimestamp64Micro(start_time) FROM {DB}.rollouts FINAL WHERE rollout_id = 'ro-1'"
    ).result_rows == [(_cast_micros(START),)]


def _ttl(client: Client) -> dict[str, str]:
    rows = client.query(
        "SELECT name, engine_full FROM system.tables WHERE database = {db:String}", parameters={"db": DB}
    ).result_rows
    return {str(name): str(engine) for name, engine in rows if name in {t for t, _ in RETENTION}}


def test_retention_is_applied_changed_and_removed(client: Client) -> None:
    migrate(client, DB)
    day = 86400
    client.command(
        f"INSERT INTO {DB}.rollouts (rollout_id, input, start_time, status, config, version, cause_event_id, "
        f"cause_time, kafka_partition, kafka_offset) VALUES "
        f"('old', '{{}}', {NOW - 40 * day!r}, 'succeeded', '{{}}', 1, 'ev', {NOW!r}, 0, 1), "
        f"('new', '{{}}', {NOW - 1 * day!r}, 'succeeded', '{{}}', 1, 'ev', {NOW!r}, 0, 2)"
    )
    client.command(
        f"INSERT INTO {DB}.otel_traces (Timestamp, TraceId, SpanId, RolloutId, AttemptId, SequenceId, KafkaOffset) "
        f"VALUES (toDateTime64({NOW - 40 * day}, 9), 't', 's-old', 'old', 'a', 1, 1), "
        f"(toDateTime64({NOW}, 9), 't', 's-new', 'new', 'a', 1, 2)"
    )
    assert all(" TTL " not in engine for engine in _ttl(client).values())

    assert migrate(client, DB, ttl_days=30) == []
    assert all("toIntervalDay(30)" in engine for engine in _ttl(client).values())
    assert set(_ttl(client)) == {table for table, _ in RETENTION}
    # Rows past the TTL are gone (the ALTER rewrote the parts that held them), the others stay.
    client.command(f"OPTIMIZE TABLE {DB}.rollouts FINAL")
    client.command(f"OPTIMIZE TABLE {DB}.otel_traces FINAL")
    assert client.query(f"SELECT rollout_id FROM {DB}.rollouts FINAL").result_rows == [("new",)]
    assert client.query(f"SELECT SpanId FROM {DB}.otel_traces FINAL").result_rows == [("s-new",)]

    # Idempotent: the same setting again changes nothing; a new one replaces it.
    assert apply_retention(client, DB, 30) == []
    assert len(apply_retention(client, DB, 90)) == len(RETENTION)
    assert all("toIntervalDay(90)" in engine for engine in _ttl(client).values())
    # 0 keeps everything again.
    assert len(apply_retention(client, DB, 0)) == len(RETENTION)
    assert all(" TTL " not in engine for engine in _ttl(client).values())
    assert apply_retention(client, DB, 0) == []
    # Training data is not expired.
    apply_retention(client, DB, 30)
    engines = {
        str(name): str(engine)
        for name, engine in client.query(
            "SELECT name, engine_full FROM system.tables WHERE database = {db:String}", parameters={"db": DB}
        ).result_rows
    }
    assert " TTL " in str(engines["rollouts"])
    assert " TTL " not in str(engines["triplets"]) and " TTL " not in str(engines["batch_samples"])
