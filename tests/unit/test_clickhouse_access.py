"""The reader role and profile `clickhouse migrate` applies on a ClickHouse server."""

from __future__ import annotations

from pydantic import SecretStr

from agl_stream.clickhouse.access import MAX_RANGE_ELEMENTS, reader_statements
from agl_stream.config import Settings


def test_the_profile_makes_every_limit_a_constraint_and_the_role_reads_one_database() -> None:
    settings = Settings(clickhouse_database="rl", sql_time_limit_s=12, sql_max_memory_bytes=1 << 30)
    profile, role, grant = reader_statements(settings)
    assert profile.startswith("CREATE SETTINGS PROFILE OR REPLACE rl_reader SETTINGS readonly = 2 CONST")
    for key, value in {
        "max_execution_time": 12,
        "max_memory_usage": 1 << 30,
        "max_result_bytes": 4 * settings.sql_max_result_bytes,
        "function_range_max_elements_in_block": MAX_RANGE_ELEMENTS,
    }.items():
        assert f"{key} = {value} MAX {value}" in profile
    assert "allow_ddl = 0 CONST" in profile and "allow_introspection_functions = 0 CONST" in profile
    assert role == "CREATE ROLE IF NOT EXISTS rl_reader SETTINGS PROFILE 'rl_reader'"
    assert grant == "GRANT SELECT ON rl.* TO rl_reader"


def test_a_configured_reader_user_gets_the_role_by_default() -> None:
    settings = Settings(clickhouse_reader_user="agl-gateway", clickhouse_reader_password=SecretStr("x"))
    assert reader_statements(settings)[-2:] == [
        "GRANT agl_reader TO `agl-gateway`",
        "SET DEFAULT ROLE agl_reader TO `agl-gateway`",
    ]
