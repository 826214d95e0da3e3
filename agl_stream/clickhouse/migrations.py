"""Ordered, idempotent DDL migrations from ``infra/clickhouse/NNN_name.sql``.

Each file is a list of statements separated by lines that end with ``;``. ``{db}`` is replaced
by the configured database. Applied versions are recorded in ``{db}.schema_migrations`` with a
checksum, so a migration that was edited after it ran is reported instead of silently skipped.
A statement that changes data (``ALTER ... MODIFY COLUMN``) is waited for: when ``migrate``
returns, the rows already there are converted.

Retention (``Settings.clickhouse_ttl_days``) is not a numbered migration but a setting that
``migrate`` applies after them, to the tables in :data:`RETENTION` (docs/retention.md): a TTL
that deletes rows older than so many days, or none. It is re-applied only when it differs from
the table's current TTL, since changing a TTL rewrites the parts that hold expired rows.
"""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass
from pathlib import Path

from clickhouse_connect.driver.client import Client

from agl_stream.errors import AglError
from agl_stream.resources import resource_path

_FILE = re.compile(r"^(\d{3,})_([a-z0-9_]+)\.sql$")
_WAIT_FOR_MUTATIONS = {"mutations_sync": 2}

RETENTION: tuple[tuple[str, str], ...] = (
    ("otel_traces", "Timestamp"),
    ("span_facts", "Timestamp"),
    ("rollouts", "start_time"),
    ("attempts", "start_time"),
)
"""(table, time column) that ``clickhouse_ttl_days`` expires rows of: spans and the store's
rollouts and attempts. Resources and workers are a handful of rows (and the latest resources
must stay); training data and dead letters are kept (offline RL, lineage, audits)."""
_TTL = re.compile(r"\bTTL\s+(\w+)\s*\+\s*toIntervalDay\((\d+)\)")


class MigrationError(AglError):
    """A migration file is malformed, or one that already ran was changed afterwards."""


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()

    def statements(self, database: str) -> list[str]:
        text = "\n".join(
            line for line in self.sql.replace("{db}", database).splitlines() if not line.lstrip().startswith("--")
        )
        statements = (s.strip().rstrip(";").strip() for s in text.split(";\n"))
        return [s for s in statements if s]


def load_migrations(folder: Path | None = None) -> list[Migration]:
    folder = folder or resource_path("infra/clickhouse")
    migrations = []
    for path in sorted(folder.glob("*.sql")):
        match = _FILE.match(path.name)
        if not match:
            raise MigrationError(f"{path.name}: migration files are named NNN_snake_name.sql")
        migrations.append(Migration(int(match.group(1)), match.group(2), path.read_text()))
    versions = [m.version for m in migrations]
    if len(set(versions)) != len(versions):
        raise MigrationError(f"duplicate migration versions in {folder}")
    return migrations


def migrate(
    client: Client, database: str, migrations: list[Migration] | None = None, *, ttl_days: int | None = None
) -> list[Migration]:
    """Apply pending migrations in order; return those applied now (empty when up to date).

    ``ttl_days``: then apply retention (:func:`apply_retention`); None leaves it as it is.
    """
    migrations = migrations if migrations is not None else load_migrations()
    client.command(f"CREATE DATABASE IF NOT EXISTS {database}")
    client.command(
        f"CREATE TABLE IF NOT EXISTS {database}.schema_migrations "
        "(version UInt32, name String, checksum String, applied_at DateTime64(3)) "
        "ENGINE = ReplacingMergeTree ORDER BY version"
    )
    rows = client.query(f"SELECT version, checksum FROM {database}.schema_migrations FINAL").result_rows
    applied = {int(v): str(c) for v, c in rows}
    done = []
    for migration in migrations:
        if migration.version in applied:
            if applied[migration.version] != migration.checksum:
                raise MigrationError(
                    f"migration {migration.version:03d}_{migration.name} changed after it was applied; "
                    "add a new migration instead of editing an applied one"
                )
            continue
        # Statements use IF NOT EXISTS, so a crash half-way through a file is safe to rerun.
        for statement in migration.statements(database):
            client.command(statement, settings=_WAIT_FOR_MUTATIONS)
        client.insert(
            f"{database}.schema_migrations",
            [[migration.version, migration.name, migration.checksum, int(time.time() * 1000)]],
            column_names=["version", "name", "checksum", "applied_at"],
        )
        done.append(migration)
    if ttl_days is not None:
        apply_retention(client, database, ttl_days)
    return done


def ttl_of(engine_full: str) -> tuple[str, int] | None:
    """The (column, days) of a table TTL this module set, from ``system.tables.engine_full``."""
    match = _TTL.search(engine_full)
    return (match.group(1), int(match.group(2))) if match else None


def retention_statements(database: str, ttl_days: int, current: dict[str, str]) -> list[str]:
    """The ALTERs that make each :data:`RETENTION` table's TTL ``ttl_days`` (0: none).

    ``current``: table -> its ``engine_full``; a table missing from it is left alone.
    """
    if ttl_days < 0:
        raise MigrationError(f"clickhouse_ttl_days must be 0 (keep forever) or a number of days, not {ttl_days}")
    statements = []
    for table, column in RETENTION:
        if table not in current:
            continue
        has_ttl = " TTL " in f" {current[table]} "
        if ttl_days == 0:
            if has_ttl:
                statements.append(f"ALTER TABLE {database}.{table} REMOVE TTL")
        elif ttl_of(current[table]) != (column, ttl_days):
            statements.append(f"ALTER TABLE {database}.{table} MODIFY TTL {column} + INTERVAL {ttl_days} DAY")
    return statements


def apply_retention(client: Client, database: str, ttl_days: int) -> list[str]:
    """Set the retention tables' TTL to ``ttl_days`` (0: keep forever); return the ALTERs run
    (none when it already is)."""
    rows = client.query(
        "SELECT name, engine_full FROM system.tables WHERE database = {db:String} AND name IN {names:Array(String)}",
        parameters={"db": database, "names": [table for table, _ in RETENTION]},
    ).result_rows
    statements = retention_statements(database, ttl_days, {str(name): str(engine) for name, engine in rows})
    for statement in statements:
        client.command(statement, settings=_WAIT_FOR_MUTATIONS)
    return statements
