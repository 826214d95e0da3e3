"""Start and stop agl-stream roles as child processes (the local stack, the demo, tests)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from agl_stream.config import Settings


def start_role(settings: Settings, *args: str, log_path: Path, detach: bool = False) -> subprocess.Popen[bytes]:
    """Start ``agl-stream <args>`` with these settings; its output goes to ``log_path``.

    ``detach``: in a session of its own, so it outlives this process and its terminal.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGL_")}
    env.update(settings.as_env())
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "agl_stream", *args],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def stop_role(process: subprocess.Popen[bytes], timeout: float = 30.0) -> int:
    """SIGTERM, wait, SIGKILL after ``timeout``; returns the exit code."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


def role_alive(pid: int) -> bool:
    """Whether ``pid`` is a running agl-stream role (never a recycled pid of something else)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"agl_stream" in cmdline  # a zombie's cmdline is empty
