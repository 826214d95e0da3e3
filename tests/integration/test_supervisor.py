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

from agl_stream import connect
from agl_stream.config import Settings
from agl_stream.local import stack
from agl_stream.local.processes import role_alive
from agl_stream.local.supervisor import backoff, read_status

pytestmark = pytest.mark.integration


def test_backoff_doubles_to_a_ceiling() -> None:
    for n, base in ((1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (50, 30.0)):
        assert base <= backoff(n) <= 1.5 * base  # doubling to 30 s, each wait jittered upwards


async def test_a_killed_gateway_runs_again_and_reads_wait_for_it(kafka_bootstrap: str, tmp_path: Path) -> None:
    settings = Settings(
        kafka_bootstrap=kafka_bootstrap, data_dir=tmp_path, topic_prefix=f"s{uuid4().hex[:10]}", gateway_port=0
    )
    info = await asyncio.to_thread(stack.up, settings, training=False)
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
    deadline = time.monotonic() + 120
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


def test_a_detached_stack_outlives_the_terminal_that_started_it(kafka_bootstrap: str, tmp_path: Path) -> None:
    """`up --detach` in a terminal that then closes: the hang-up (SIGHUP to the terminal's
    session and its foreground process group) stops nothing of the stack."""
    import pty

    settings = Settings(
        kafka_bootstrap=kafka_bootstrap, data_dir=tmp_path, topic_prefix=f"d{uuid4().hex[:10]}", gateway_port=0
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGL_")}
    env |= {k: v for k, v in settings.as_env().items() if k in ("AGL_KAFKA_BOOTSTRAP", "AGL_TOPIC_PREFIX")}
    env |= {"AGL_GATEWAY_PORT": "0", "AGL_DATA_DIR": str(tmp_path)}
    marker = tmp_path / "up.done"
    # A shell without job control, as a script or a terminal multiplexer's command runs: what it
    # starts shares its process group, the terminal's foreground group. `sleep` (a control)
    # must die of the hang-up; the stack must not.
    script = (
        f"{sys.executable} -m agl_stream up --detach --no-training && touch {marker}; "
        f"sleep 900 & echo $! > {tmp_path / 'control.pid'}; wait"
    )
    shell, terminal = pty.fork()
    if shell == 0:  # the child: the session leader, the pty its controlling terminal
        # A terminal's shell starts with the hang-up's default action. A test run under nohup
        # (or any parent ignoring SIGHUP) would hand its SIG_IGN down through exec, and then
        # neither the shell nor the control would die when the terminal closes.
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        os.execve("/bin/bash", ["/bin/bash", "--norc", "--noprofile", "-c", script], env)
    try:
        deadline = time.monotonic() + 900
        while not (tmp_path / "control.pid").exists():
            with_output = _drain(terminal)
            assert time.monotonic() < deadline, f"`up --detach` did not finish; its terminal showed:\n{with_output}"
            assert os.waitpid(shell, os.WNOHANG) == (0, 0), "the shell exited before `up` finished"
            time.sleep(0.1)  # polling a file another process writes
        assert marker.exists(), "`up --detach` failed"
        control = int((tmp_path / "control.pid").read_text())
        supervisor = stack.read_stack(settings)
        assert supervisor is not None
        os.close(terminal)  # the terminal closes
        terminal = -1
        deadline = time.monotonic() + 120
        while os.waitpid(shell, os.WNOHANG) == (0, 0):
            assert time.monotonic() < deadline, "the shell did not end when its terminal closed"
            time.sleep(0.05)  # waiting for the hang-up to end the shell
        while os.path.exists(f"/proc/{control}") and "Z" not in _state(control):
            assert time.monotonic() < deadline, "the control process did not get the hang-up"
            time.sleep(0.05)  # waiting for a process that is not our child to exit
        assert role_alive(supervisor.pids["supervisor"])
        parts = stack.status(settings)
        assert all(state.startswith("running") for role, state in parts.items() if role != "kafka"), parts
        assert "at http://" in parts["gateway"] and "not answering" not in parts["gateway"], parts
    finally:
        if terminal >= 0:
            os.close(terminal)
        stack.down(settings)


def _drain(terminal: int) -> str:
    import select

    chunks = []
    while select.select([terminal], [], [], 0)[0]:
        try:
            chunk = os.read(terminal, 65536)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk.decode(errors="replace"))
    return "".join(chunks)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
