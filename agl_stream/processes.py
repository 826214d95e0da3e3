"""Start and stop agl-stream roles as child processes (the local stack, the demo, the Trainer, tests).

Concurrency model: plain functions, and :class:`RoleGroup`, which one thread uses to start and
stop the processes of one run.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

import httpx

from agl_stream.config import SECRETS_DIR_ENV, Settings

KEYLESS_ROLES = frozenset({"supervise", "processor", "gateway", "ingress", "triplets", "batcher", "sink", "otlp-kafka"})
"""Roles that call no outside service, so they get none of the caller's credentials: a role that
is tricked into reading its environment has nothing to give away."""

_CREDENTIAL = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH", re.IGNORECASE)


def write_secrets(settings: Settings) -> Path | None:
    """Write the secret settings as 0600 files for child processes; None when there are none."""
    secrets = settings.secrets()
    directory = settings.secrets_dir
    if not secrets:
        return None
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    for stale in directory.iterdir():
        if stale.name not in secrets:
            stale.unlink()
    for name, value in secrets.items():
        path = directory / name
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(descriptor, 0o600)  # also when the file was there before
        with os.fdopen(descriptor, "w") as file:
            file.write(value)
    return directory


def role_environment(settings: Settings, role: str | None = None) -> dict[str, str]:
    """The environment of a child agl-stream process: these settings, secrets only as files.

    ``role``: the command it runs; a role in ``KEYLESS_ROLES`` also loses the caller's
    credential-looking variables (``OPENAI_API_KEY``, ``HF_TOKEN``...).
    """
    keyless = role in KEYLESS_ROLES
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGL_") and not (keyless and _CREDENTIAL.search(k))}
    env.update(settings.as_env())
    secrets_dir = write_secrets(settings)
    if secrets_dir is not None:
        env[SECRETS_DIR_ENV] = str(secrets_dir)
    return env


def start_role(
    settings: Settings, *args: str, log_path: Path, env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start ``agl-stream <args>`` with these settings; its output goes to ``log_path``.

    ``env``: variables set on top of :func:`role_environment` (never secrets: see there).
    """
    base = role_environment(settings, args[0] if args else None)
    env = {**base, **(env or {})}
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


def log_tail(path: Path, chars: int = 3000) -> str:
    """The end of a role's log (empty when it wrote none)."""
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


class RoleExitedError(RuntimeError):
    """A role this group started exited while it was still needed."""


class RoleGroup:
    """The roles one run starts, stopped together on the way out (also on Ctrl-C or an error).

    Roles stop in the reverse order of their start, so the runners (started last) finish their
    attempts while what they call is still up; consecutive processes of one role (``n``
    runners) are signalled together, so they drain in parallel.
    """

    def __init__(self, settings: Settings, log_dir: Path) -> None:
        self.settings = settings
        self.log_dir = log_dir
        self.processes: dict[str, subprocess.Popen[bytes]] = {}  # by name, in start order
        self.roles: dict[str, str] = {}  # name -> role (the command)

    def start(self, *args: str, name: str, env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
        if name in self.processes:
            raise ValueError(f"a role named {name!r} was started already")
        process = start_role(self.settings, *args, log_path=self.log_path(name), env=env)
        self.processes[name] = process
        self.roles[name] = args[0] if args else ""
        return process

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def pids(self) -> dict[str, int]:
        return {name: process.pid for name, process in self.processes.items()}

    def exited(self) -> dict[str, int]:
        """The processes that have exited, with their exit codes."""
        codes = {name: process.poll() for name, process in self.processes.items()}
        return {name: code for name, code in codes.items() if code is not None}

    def wait_http(self, name: str, url: str, timeout: float = 120.0) -> None:
        """Return once ``url`` answers 200; RoleExitedError if the role exits first."""
        process = self.processes[name]
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=1).status_code == 200:
                    return
            if process.poll() is not None:
                raise RoleExitedError(
                    f"{name} exited with code {process.returncode}; its log ends with:\n{log_tail(self.log_path(name))}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} did not answer {url} within {timeout:.0f}s (log: {self.log_path(name)})")
            time.sleep(0.2)  # another process starting up: nothing to be notified by

    def stop(self, timeout: float = 30.0) -> dict[str, int]:
        """SIGTERM each role (newest first), SIGKILL what outlives ``timeout``; the exit codes."""
        names = list(reversed(self.processes))
        while names:
            role = self.roles[names[0]]
            batch = []
            while names and self.roles[names[0]] == role:
                batch.append(self.processes[names.pop(0)])
            for process in batch:
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for process in batch:
                try:
                    process.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        return {name: process.returncode for name, process in self.processes.items()}

    def __enter__(self) -> RoleGroup:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()
