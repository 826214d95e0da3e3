"""Migration files: naming, statement splitting, and idempotent application on the real engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from agl_stream.clickhouse import times
from agl_stream.clickhouse.migrations import (
    RETENTION,
    Migration,
    MigrationError,
    load_migrations,
    retention_statements,
    ttl_of,
)


def test_shipped_migrations_are_ordered_and_named() -> None:
    migrations = load_migrations()
    assert [m.version for m in migrations] == sorted(m.version for m in migrations)
    assert migrations[0].name == "otel_traces"


def test_statements_substitute_the_database_and_drop_comments() -> None:
    m = Migration(
        1,
        "x",
        "-- a comment;\nCREATE TABLE {db}.a (x UInt8) ENGINE=Memory;\n\nCREATE TABLE {db}.b (y UInt8) ENGINE=Memory;\n",
    )
    assert m.statements("d1") == [
        "CREATE TABLE d1.a (x UInt8) ENGINE=Memory",
        "CREATE TABLE d1.b (y UInt8) ENGINE=Memory",
    ]


def test_badly_named_file_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "create.sql").write_text("SELECT 1")
    with pytest.raises(MigrationError, match="NNN_snake_name"):
        load_migrations(tmp_path)


def test_retention_statements_set_change_and_remove_the_ttl() -> None:
    plain = {table: "ReplacingMergeTree ORDER BY x SETTINGS index_granularity = 8192" for table, _ in RETENTION}
    set_30 = retention_statements("d", 30, plain)
    assert set_30 == [f"ALTER TABLE d.{t} MODIFY TTL {c} + INTERVAL 30 DAY" for t, c in RETENTION]
    with_30 = {t: f"ReplacingMergeTree ORDER BY x TTL {c} + toIntervalDay(30) SETTINGS a = 1" for t, c in RETENTION}
    assert retention_statements("d", 30, with_30) == []  # already so: no rewrite
    assert retention_statements("d", 7, with_30) == [s.replace("30", "7") for s in set_30]
    assert retention_statements("d", 0, with_30) == [f"ALTER TABLE d.{t} REMOVE TTL" for t, _ in RETENTION]
    assert retention_statements("d", 0, plain) == []
    assert retention_statements("d", 30, {}) == []  # tables not there are left alone
    with pytest.raises(MigrationError, match="keep forever"):
        retention_statements("d", -1, plain)


def test_ttl_of_reads_the_engine_clause() -> None:
    assert ttl_of("MergeTree ORDER BY id TTL start_time + toIntervalDay(14) SETTINGS x = 1") == ("start_time", 14)
    assert ttl_of("MergeTree ORDER BY id SETTINGS x = 1") is None


def test_time_columns_are_selected_as_float_seconds() -> None:
    assert times.select(("rollout_id", "start_time")) == (
        "rollout_id, toUnixTimestamp64Micro(start_time) / 1e6 AS start_time"
    )
    assert times.select(("rollout_id", "end_time"), "r") == (
        "r.rollout_id AS rollout_id, toUnixTimestamp64Micro(r.end_time) / 1e6 AS end_time"
    )
    assert times.micros(1767225600.123456) == 1767225600123456
