"""Migration files: naming, statement splitting, and idempotent application on the real engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from agl_stream.clickhouse.migrations import Migration, MigrationError, load_migrations


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
