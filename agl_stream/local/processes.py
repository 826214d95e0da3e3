"""Start and stop agl-stream roles as child processes (the local stack, the demo, the Trainer, tests),
and the role's half of a stop: SIGTERM or SIGINT ends its run (:func:`run_until_stopped`).

Concurrency model: plain functions, and :class:`RoleGroup`, which one thread uses to start and
stop the processes of one run. :func:`stop_on_signals` installs handlers on the running event
loop, so the stop runs on that loop's thread.

Waiting for a process to start (:func:`wait_started`) has no short fixed deadline: it waits as
long as the process lives, up to its start budget (``AGL_START_TIMEOUT_S``, or
``AGL_MODEL_START_TIMEOUT_S`` for a model server: a first vLLM load may take 15 minutes), and
reports its progress (the role, the seconds waited, the last line of its log) on the way. A role
that exits, or outlives its budget, is one :class:`RoleStartError`: a line that says what
happened and what to do, then the end of its log.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import TypeVar

import httpx

from agl_stream.auth import write_private
from agl_stream.config import SECRETS_DIR_ENV, Settings
from agl_stream.errors import AglError

T = TypeVar("T")
Progress = Callable[[str], None]
"""Told what a wait is waiting for, as one line (a spinner's text, a log line)."""

MODEL_ROLES = frozenset({"inference"})
"""Roles that load a model before they answer: they get ``model_start_timeout_s``."""
_POLL_S = 0.2  # another process starting up: nothing to be notified by

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
        write_private(directory / name, value)
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
    settings: Settings,
    *args: str,
    log_path: Path,
    env: Mapping[str, str] | None = None,
    detached: bool = False,
) -> subprocess.Popen[bytes]:
    """Start ``agl-stream <args>`` with these settings; its output goes to ``log_path``.

    ``env``: variables set on top of :func:`role_environment` (never secrets: see there).
    ``detached``: in a session of its own (and so are the processes it starts), so a terminal
    that closes (SIGHUP) or a Ctrl-C there stops nothing: what ``up --detach`` leaves running.
    """
    base = role_environment(settings, args[0] if args else None)
    env = {**base, **(env or {})}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "agl_stream", *args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=detached,
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


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""What :func:`stop_role` (SIGTERM) and a terminal (SIGINT) send a role to stop it."""


@contextlib.contextmanager
def stop_on_signals(stop: Callable[[], object]) -> Iterator[None]:
    """Call ``stop`` on the running loop when the process is told to stop, while in the block."""
    loop = asyncio.get_running_loop()
    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, stop)
    try:
        yield
    finally:
        for signum in STOP_SIGNALS:
            loop.remove_signal_handler(signum)


def run_until_stopped(main: Callable[[asyncio.Event], Awaitable[T]]) -> T:
    """A role's entry point: ``asyncio.run(main(stop))``, where SIGTERM/SIGINT set ``stop``."""

    async def run() -> T:
        stop = asyncio.Event()
        with stop_on_signals(stop.set):
            return await main(stop)

    return asyncio.run(run())


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


def last_line(path: Path) -> str:
    """The last non-empty line of a log, shortened for a progress line."""
    lines = [line for line in log_tail(path, 2000).splitlines() if line.strip()]
    text = lines[-1].strip() if lines else ""
    return text if len(text) <= 100 else text[:97] + "..."


def start_budget(settings: Settings, role: str) -> float:
    """Seconds ``role`` may take to start answering: longer for a model server."""
    return settings.model_start_timeout_s if role in MODEL_ROLES else settings.start_timeout_s


class RoleExitedError(AglError):
    """A role this group started exited while it was still needed."""


class RoleStartError(RoleExitedError):
    """A role exited while starting, or did not answer within its start budget."""


def wait_started(
    what: str,
    ready: Callable[[], T | None],
    *,
    budget_s: float,
    exit_code: Callable[[], int | None],
    log_path: Path,
    progress: Progress | None = None,
    budget_setting: str = "AGL_START_TIMEOUT_S",
) -> T:
    """``ready()``'s first truthy value, polled while the process lives, for up to ``budget_s``.

    ``exit_code``: None while the process runs. ``progress`` hears where the wait stands (what,
    seconds so far, the last line of the log) on every poll. RoleStartError when the process
    exits first or the budget runs out, saying what to do, with the end of its log.
    """
    began = time.monotonic()
    while True:
        value = ready()
        if value:
            return value
        waited = time.monotonic() - began
        code = exit_code()
        if code is not None:
            raise RoleStartError(
                f"{what} exited with code {code} while starting; see its log {log_path} for the cause "
                f"(fix it and start again). Its log ends with:\n{log_tail(log_path)}"
            )
        if waited > budget_s:
            raise RoleStartError(
                f"{what} was still starting after {waited:.0f} s (its budget: {budget_s:.0f} s); on a busy or "
                f"slow machine give it more with {budget_setting}, else see its log {log_path}. "
                f"Its log ends with:\n{log_tail(log_path)}"
            )
        if progress is not None:
            line = last_line(log_path)
            progress(f"waiting for {what} to start ({waited:.0f} s of {budget_s:.0f} s){': ' + line if line else ''}")
        time.sleep(_POLL_S)


def answers_http(url: str) -> bool:
    """Whether ``url`` answers 200 now."""
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url, timeout=5.0).status_code == 200
    return False


class RoleGroup:
    """The roles one run starts, stopped together on the way out (also on Ctrl-C or an error).

    Roles stop in the reverse order of their start, so the runners (started last) finish their
    attempts while what they call is still up; consecutive processes of one role (``n``
    runners) are signalled together, so they drain in parallel.
    """

    def __init__(self, settings: Settings, log_dir: Path, progress: Progress | None = None) -> None:
        self.settings = settings
        self.log_dir = log_dir
        self.progress = progress  # told where waits for a role to start stand
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

    def wait_http(self, name: str, url: str, budget_s: float | None = None) -> None:
        """Return once ``url`` answers 200, waiting while the role lives, for up to its start
        budget (:func:`start_budget`; ``budget_s`` overrides it); RoleStartError otherwise."""
        process, role = self.processes[name], self.roles[name]
        model = role in MODEL_ROLES
        wait_started(
            f"{name} ({url})" if name == role else f"{name} (the {role} role, {url})",
            lambda: answers_http(url),
            budget_s=budget_s if budget_s is not None else start_budget(self.settings, role),
            exit_code=process.poll,
            log_path=self.log_path(name),
            progress=self.progress,
            budget_setting="AGL_MODEL_START_TIMEOUT_S" if model else "AGL_START_TIMEOUT_S",
        )

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
