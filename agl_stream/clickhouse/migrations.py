"""Ordered, idempotent DDL migrations from ``infra/clickhouse/NNN_name.sql``.

Each file is a list of statements separated by lines that end with ``;``. ``{db}`` is replaced
by the configured database. Applied versions are recorded in ``{db}.schema_migrations`` with a
checksum, so a migration that was edited after it ran is reported instead of silently skipped.
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


def migrate(client: Client, database: str, migrations: list[Migration] | None = None) -> list[Migration]:
    """Apply pending migrations in order; return those applied now (empty when up to date)."""
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
            client.command(statement)
        client.insert(
            f"{database}.schema_migrations",
            [[migration.version, migration.name, migration.checksum, int(time.time() * 1000)]],
            column_names=["version", "name", "checksum", "applied_at"],
        )
        done.append(migration)
    return done
