"""`agl-stream sql` against the real stack: table, CSV and JSON output; writes refused by ClickHouse."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from agl_stream import connect
from agl_stream.config import Settings
from agl_stream.local.processes import role_environment

pytestmark = pytest.mark.integration


def _sql(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    env = role_environment(settings)
    return subprocess.run(
        [sys.executable, "-m", "agl_stream", "sql", *args], env=env, capture_output=True, text=True, timeout=120
    )


async def test_sql_outputs_and_read_only(stack_settings: Settings) -> None:
    async with connect(**stack_settings.model_dump(exclude_none=True)) as store:
        rollout = await store.enqueue_rollout({"sql": True}, mode="val")
        assert await store.get_rollout_by_id(rollout.rollout_id) is not None  # fenced: the row is in ClickHouse
    db = stack_settings.clickhouse_database
    query = f"SELECT rollout_id, status, mode FROM {db}.rollouts FINAL WHERE rollout_id = '{rollout.rollout_id}'"
    as_json = _sql(stack_settings, "-o", "json", query)
    assert as_json.returncode == 0, as_json.stderr
    assert [json.loads(line) for line in as_json.stdout.splitlines()] == [
        {"rollout_id": rollout.rollout_id, "status": "queuing", "mode": "val"}
    ]
    as_csv = _sql(stack_settings, "--output", "csv", query)
    assert as_csv.stdout.splitlines() == ["rollout_id,status,mode", f"{rollout.rollout_id},queuing,val"]
    as_table = _sql(stack_settings, query)
    assert rollout.rollout_id in as_table.stdout and "1 row(s)" in as_table.stdout
    refused = _sql(stack_settings, f"INSERT INTO {db}.rollouts (rollout_id) VALUES ('x')")
    assert refused.returncode == 1 and "readonly" in refused.stderr.lower()
    bad = _sql(stack_settings, "SELECT * FROM no_such_table")
    assert bad.returncode == 1 and "error" in bad.stderr.lower()
