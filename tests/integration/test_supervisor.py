"""The local stack's supervisor: a role killed with -9 runs again, clients ride through it, and
`down` leaves no process behind."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from uuid import uuid4

import pytest

from agl_stream import connect, stack
from agl_stream.config import Settings
from agl_stream.processes import role_alive
from agl_stream.supervisor import backoff, read_status

pytestmark = pytest.mark.integration


def test_backoff_doubles_to_a_ceiling() -> None:
    assert [backoff(n) for n in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 4.0]
    assert backoff(50) == 30.0


async def test_a_killed_gateway_runs_again_and_reads_wait_for_it(kafka_bootstrap: str, tmp_path: Path) -> None:
    settings = Settings(
        kafka_bootstrap=kafka_bootstrap, data_dir=tmp_path, topic_prefix=f"s{uuid4().hex[:10]}", gateway_port=0
    )
    info = await asyncio.to_thread(stack.up, settings, timeout=120, training=False)
    pids: set[int] = set()
    try:
        running = stack.local_stack_settings(settings)
        async with connect(**running.model_dump(exclude_none=True)) as store:
            rollout = await store.enqueue_rollout({"before": "the kill"})
            first = read_status(settings.run_dir)["gateway"].pid
            assert first is not None
            os.kill(first, signal.SIGKILL)
            # A read while the gateway is gone: it waits for the new one (at its new port).
            seen = await store.get_rollout_by_id(rollout.rollout_id)
            assert seen is not None and seen.rollout_id == rollout.rollout_id
        state = read_status(settings.run_dir)["gateway"]
        assert state.restarts == 1 and state.pid not in (None, first) and state.last_exit_code == -signal.SIGKILL
        assert "1 restart(s)" in stack.status(settings)["gateway"]
        pids = {p for p in info.pids.values()} | {s.pid for s in read_status(settings.run_dir).values() if s.pid}
    finally:
        await asyncio.to_thread(stack.down, settings)
    deadline = time.monotonic() + 30
    while any(role_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"still running after down: {[p for p in pids if role_alive(p)]}"
        await asyncio.sleep(0.05)  # waiting for processes that are not our children to exit


def test_supervise_refuses_a_role_it_does_not_know(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGL_")} | {"COLUMNS": "200"}
    result = subprocess.run(
        [sys.executable, "-m", "agl_stream", "--data-dir", str(tmp_path), "supervise", "processor", "procesor"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "unknown role(s) procesor" in result.stderr, result.stderr
    assert not (tmp_path / "run" / "supervisor.json").exists()  # nothing was started
