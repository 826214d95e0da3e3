"""The local stack: broker (unless AGL_KAFKA_BOOTSTRAP), topics, the rollout processor and the
gateway (sinks + query API), started as processes of their own and recorded in
``<data dir>/run/stack.json`` so ``status``, ``down`` and ``agl_stream.connect()`` find them.

The roles run under a supervisor (``agl_stream.local.supervisor``, a process of its own) that starts
a role again when it exits; ``stack.json`` holds the pids they started with, the supervisor's
``supervisor.json`` the ones running now.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlencode

import httpx
from pydantic import BaseModel

from agl_stream.auth import ensure_token, known_token
from agl_stream.config import Settings
from agl_stream.errors import AglError
from agl_stream.kafka import admin, broker
from agl_stream.local.processes import Progress, role_alive, start_role, wait_started
from agl_stream.local.supervisor import STATUS_FILE, read_status
from agl_stream.logs import get_logger

log = get_logger("agl.stack")

ROLES = ("processor", "gateway", "ingress")
"""The store and task ingress from external systems: always started."""
TRAINING_ROLES = ("triplets", "batcher")
"""Training data: the triplet builder and the batcher (``up(training=True)``)."""
READY_ROLES = frozenset({"processor", "ingress", "triplets", "batcher"})
"""Roles that write their ready file (:meth:`Settings.ready_file`) once they own partitions."""


class StackError(AglError):
    """The local stack could not be started, reached or stopped."""


class StackInfo(BaseModel):
    bootstrap: str
    topic_prefix: str
    gateway_url: str | None = None
    pids: dict[str, int] = {}
    started_broker: bool = False
    started_at: float = 0.0


def _stack_file(settings: Settings) -> Path:
    return settings.run_dir / "stack.json"


def read_stack(settings: Settings) -> StackInfo | None:
    path = _stack_file(settings)
    if not path.exists():
        return None
    return StackInfo.model_validate_json(path.read_text())


def local_stack_settings(settings: Settings) -> Settings:
    """Fill in what `agl-stream up` recorded (the bootstrap) where the settings leave it open.

    The gateway's URL is not pinned: clients find the gateway through ``<run dir>/gateway.json``
    on every retry, so a gateway the supervisor started again on another port is found.
    """
    stack = read_stack(settings)
    if stack is None or settings.kafka_bootstrap is not None:
        return settings
    return settings.model_copy(update={"kafka_bootstrap": stack.bootstrap})


def _running(stack: StackInfo) -> bool:
    supervisor = stack.pids.get("supervisor")
    if supervisor is not None:  # it keeps its roles running (their pids change when it restarts one)
        return role_alive(supervisor)
    return bool(stack.pids) and all(role_alive(pid) for pid in stack.pids.values())


def _all_started(settings: Settings, roles: tuple[str, ...]) -> dict[str, int] | None:
    running = read_status(settings.run_dir)
    pids = {role: running[role].pid for role in roles if role in running}
    return {r: p for r, p in pids.items() if p is not None} if len(pids) == len(roles) else None


def _ready_or_failed(settings: Settings, role: str, ready: Any) -> Any:
    """``ready`` once the role is ready; a StackError as soon as it exited before that (the
    supervisor would start it again, but a role that fails while starting needs a person)."""
    if ready:
        return ready
    state = read_status(settings.run_dir).get(role)
    if state is not None and state.last_exit_code is not None:
        log_path = settings.run_dir / f"{role}.log"
        tail = log_path.read_text(errors="replace")[-3000:] if log_path.exists() else ""
        raise StackError(
            f"the {role} role exited with code {state.last_exit_code} while starting; its log ({log_path}) "
            f"ends with:\n{tail}"
        )
    return None


DASHBOARD_PATH = "/dashboard/"


def dashboard_url(settings: Settings) -> str | None:
    """The web dashboard of the gateway this data dir's stack runs, or None when none answers.

    A gateway that requires its API token gets the token in the URL (``?token=``; the page keeps
    it for its tab and takes it out of the address bar): a browser has no other way to send it.
    """
    url = _gateway_ready(settings)
    if not url:
        return None
    page = f"{url}{DASHBOARD_PATH}"
    try:
        asks = httpx.get(f"{url}/v1/dashboard/cookbook", timeout=5.0).status_code == 401
    except httpx.HTTPError:
        asks = False
    token = known_token(settings) if asks else None
    return f"{page}?{urlencode({'token': token})}" if token else page


def _gateway_ready(settings: Settings) -> str | None:
    path = settings.run_dir / "gateway.json"
    if not path.exists():
        return None
    try:
        url = str(json.loads(path.read_text())["url"])
        response = httpx.get(f"{url}/v1/health", timeout=1.0)
    except (OSError, ValueError, KeyError, httpx.HTTPError):
        return None
    return url if response.status_code == 200 else None


def up(
    settings: Settings, *, timeout: float | None = None, training: bool = False, progress: Progress | None = None
) -> StackInfo:
    """Start what is not running yet and wait until every part answers.

    ``training``: also the triplet builder and the batcher (the RL data path). ``timeout``: the
    seconds the parts may take to start while they run (default ``start_timeout_s``; a part that
    exits fails at once); ``progress`` hears which part the wait is on. The supervisor and its
    roles run in a session of their own, so the stack outlives the terminal that started it.
    """
    budget = settings.start_timeout_s if timeout is None else timeout
    roles = ROLES + (TRAINING_ROLES if training else ())
    existing = read_stack(settings)
    if existing is not None and _running(existing):
        return existing
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    ensure_token(settings)  # before the roles start: they read it from the run dir
    started_broker = False
    if settings.uses_local_broker:
        if progress is not None:
            progress("starting the local Kafka broker ...")
        info = broker.start(settings, wait_timeout=budget)
        started_broker = info.started
        bootstrap = info.bootstrap  # the ports this data dir's broker was made with
    else:
        bootstrap = settings.bootstrap_servers
    running = settings.model_copy(update={"kafka_bootstrap": bootstrap})
    asyncio.run(admin.apply(running))
    (settings.run_dir / "gateway.json").unlink(missing_ok=True)
    for role in READY_ROLES:
        settings.ready_file(role).unlink(missing_ok=True)
    (settings.run_dir / STATUS_FILE).unlink(missing_ok=True)
    supervisor = start_role(running, "supervise", *roles, log_path=settings.run_dir / "supervisor.log", detached=True)
    stack = StackInfo(
        bootstrap=bootstrap,
        topic_prefix=settings.topic_prefix,
        pids={"supervisor": supervisor.pid},
        started_broker=started_broker,
        started_at=time.time(),
    )
    _stack_file(settings).write_text(stack.model_dump_json(indent=2))
    began = time.monotonic()

    def wait(what: str, ready: Any, log_name: str) -> Any:
        return wait_started(
            what,
            ready,
            budget_s=max(0.0, budget - (time.monotonic() - began)),  # one budget for the whole stack
            exit_code=supervisor.poll,
            log_path=settings.run_dir / log_name,
            progress=progress,
        )

    try:
        started = wait("the supervisor", lambda: _all_started(settings, roles), "supervisor.log")
        stack.pids.update(started)
        _stack_file(settings).write_text(stack.model_dump_json(indent=2))
        stack.gateway_url = wait(
            "the gateway", lambda: _ready_or_failed(settings, "gateway", _gateway_ready(settings)), "gateway.log"
        )
        for role in roles:
            if role in READY_ROLES:
                ready_file = settings.ready_file(role)
                wait(
                    f"the {role} role",
                    lambda role=role, ready_file=ready_file: _ready_or_failed(settings, role, ready_file.exists()),
                    f"{role}.log",
                )
    except BaseException:
        down(settings)
        raise
    _stack_file(settings).write_text(stack.model_dump_json(indent=2))
    return stack


def down(settings: Settings, *, timeout: float = 30.0) -> list[str]:
    """Stop the roles `up` started (gracefully, SIGKILL after ``timeout``) and its broker.

    The supervisor first (it stops the roles it runs), then any role still alive.
    """
    stack = read_stack(settings)
    stopped: list[str] = []
    if stack is None:
        return stopped
    running = {role: state.pid for role, state in read_status(settings.run_dir).items() if state.pid is not None}
    pids = {**stack.pids, **running}
    order = ["supervisor", *reversed([r for r in pids if r != "supervisor"])]
    for role in order:
        pid = pids.get(role)
        if pid is not None and role_alive(pid):
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout + (30.0 if role == "supervisor" else 0.0)
            while role_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)  # waiting for a non-child process to exit: no waitpid possible
            if role_alive(pid):
                os.kill(pid, signal.SIGKILL)
            stopped.append(role)
    if stack.started_broker and broker.stop(settings):
        stopped.append("broker")
    shutil.rmtree(settings.secrets_dir, ignore_errors=True)  # the roles that read them are gone
    _stack_file(settings).unlink(missing_ok=True)
    return stopped


def status(settings: Settings) -> dict[str, str]:
    """Each part of the stack and whether it runs (and answers)."""
    stack = read_stack(settings)
    if stack is None:
        return {}
    parts = {"kafka": f"{stack.bootstrap}" + (" (local broker)" if stack.started_broker else "")}
    supervised = read_status(settings.run_dir)
    for role, pid in stack.pids.items():
        state = supervised.get(role)
        if state is not None:
            restarts = f", {state.restarts} restart(s), last exit code {state.last_exit_code}" if state.restarts else ""
            now = state.pid
            parts[role] = (
                f"running (pid {now}{restarts})" if now is not None and role_alive(now) else f"not running{restarts}"
            )
        else:
            parts[role] = f"running (pid {pid})" if role_alive(pid) else f"not running (pid {pid} gone)"
    if stack.gateway_url:
        parts["gateway"] += f" at {stack.gateway_url}" if _gateway_ready(settings) else " but not answering"
    return parts


SessionMode = Literal["auto", "attach", "start"]


def session_plan(mode: SessionMode, *, stack_running: bool, gateway_configured: bool) -> Literal["attach", "start"]:
    """Whether a run attaches to a running cluster or starts (and later stops) the local stack.

    Attach: a stack ``up`` started for this data dir runs, or AGL_GATEWAY_URL names the read side
    of a deployed cluster (its processor and gateway run elsewhere). Start: otherwise; the
    broker too unless AGL_KAFKA_BOOTSTRAP names one (as ``up`` does). ``mode`` forces either.
    """
    if mode not in ("auto", "attach", "start"):
        raise StackError(f"stack mode {mode!r}: auto, attach or start")
    if mode == "start":
        if stack_running:
            raise StackError(
                "a stack `agl-stream up` started runs for this data dir: attach to it, or stop it (`agl-stream down`)"
            )
        return "start"
    if stack_running or gateway_configured:
        return "attach"
    if mode == "attach":
        raise StackError(
            "nothing to attach to: no stack runs for this data dir (`agl-stream up`) and AGL_GATEWAY_URL is not set"
        )
    return "start"


@dataclass
class StackSession:
    """The stack a run uses: ``settings`` reach it; ``owned`` when the run started it (and stops it)."""

    settings: Settings
    owned: bool
    pids: dict[str, int]  # what the run started (empty when attached); restarted roles added on close


def open_session(
    settings: Settings,
    *,
    mode: SessionMode = "auto",
    training: bool = False,
    timeout: float | None = None,
    progress: Progress | None = None,
) -> StackSession:
    """Attach to the running cluster, or start the local stack (see :func:`session_plan`)."""
    existing = read_stack(settings)
    plan = session_plan(
        mode, stack_running=existing is not None and _running(existing), gateway_configured=bool(settings.gateway_url)
    )
    if plan == "attach":
        return StackSession(local_stack_settings(settings), owned=False, pids={})
    info = up(settings, timeout=timeout, training=training, progress=progress)
    return StackSession(local_stack_settings(settings), owned=True, pids=dict(info.pids))


def close_session(session: StackSession, settings: Settings) -> list[str]:
    """Stop the stack if the session started it (``settings``: those it was opened with)."""
    if not session.owned:
        return []
    running = read_status(settings.run_dir)
    session.pids.update({f"{role} (now)": state.pid for role, state in running.items() if state.pid is not None})
    return down(settings)


@contextlib.contextmanager
def session(
    settings: Settings,
    *,
    mode: SessionMode = "auto",
    training: bool = False,
    timeout: float | None = None,
    progress: Progress | None = None,
) -> Iterator[StackSession]:
    """:func:`open_session` and, on the way out (also on Ctrl-C or an error), :func:`close_session`."""
    opened = open_session(settings, mode=mode, training=training, timeout=timeout, progress=progress)
    try:
        yield opened
    finally:
        close_session(opened, settings)
