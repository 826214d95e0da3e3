"""The read-only role the gateway's queries run under on a ClickHouse server.

chDB has no access control, so on the embedded engine the gateway's own checks and the
per-client settings are the whole story. A server has more: a settings profile whose limits are
constraints (a query cannot raise them, even under ``readonly=2``, which a client needs to set
its per-query limits), and a role that may read the agl database only. ``agl-stream clickhouse
migrate`` applies both when its user may manage access; the gateway's query clients use them
when ``AGL_CLICKHOUSE_READER_USER`` names a user that has the role.
"""

from __future__ import annotations

from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import DatabaseError

from agl_stream.config import Settings

MAX_RANGE_ELEMENTS = 10_000_000
"""Elements one ``range()`` call may make per block (ClickHouse allows 500M): the engine checks
its time limit between blocks, so one huge array expression could run far past it."""

QUERY_RESULT_BYTES_FACTOR = 4
"""The store's reads (``/v1/query``) may return this many times the analytics result bytes."""


def reader_name(database: str) -> str:
    """The role and settings profile of the readers of ``database``."""
    return f"{database}_reader"


def reader_statements(settings: Settings) -> list[str]:
    """The DDL of the reader profile and role, idempotent (OR REPLACE / IF NOT EXISTS)."""
    name = reader_name(settings.clickhouse_database)
    result_bytes = QUERY_RESULT_BYTES_FACTOR * settings.sql_max_result_bytes
    limits = {
        "max_execution_time": f"{settings.sql_time_limit_s:g}",
        "max_memory_usage": settings.sql_max_memory_bytes,
        "max_result_bytes": result_bytes,
        "function_range_max_elements_in_block": MAX_RANGE_ELEMENTS,
    }
    bounded = ", ".join(f"{key} = {value} MAX {value}" for key, value in limits.items())
    user = settings.clickhouse_reader_user
    grants = [f"GRANT {name} TO `{user}`", f"SET DEFAULT ROLE {name} TO `{user}`"] if user else []
    return [
        # readonly=2: reads only, and the client may set its own limits, up to each MAX.
        f"CREATE SETTINGS PROFILE OR REPLACE {name} SETTINGS readonly = 2 CONST, "
        f"allow_ddl = 0 CONST, allow_introspection_functions = 0 CONST, {bounded}",
        f"CREATE ROLE IF NOT EXISTS {name} SETTINGS PROFILE '{name}'",
        f"GRANT SELECT ON {settings.clickhouse_database}.* TO {name}",
        *grants,
    ]


def apply_reader_role(client: Client, settings: Settings) -> str | None:
    """Apply :func:`reader_statements`; None when done, else why not (a user without the rights
    to manage access, a server without access storage): the gateway's own limits still hold."""
    try:
        for statement in reader_statements(settings):
            client.command(statement)
    except DatabaseError as error:
        return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return None
