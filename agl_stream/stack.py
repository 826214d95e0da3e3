"""The local stack: broker (unless AGL_KAFKA_BOOTSTRAP), topics, the rollout processor and the
gateway (sinks + query API), started as processes of their own and recorded in
``<data dir>/run/stack.json`` so ``status``, ``down`` and ``agl_stream.connect()`` find them.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel

from agl_stream.config import Settings
from agl_stream.errors import AglError
from agl_stream.kafka import admin, broker
from agl_stream.logs import get_logger
from agl_stream.processes import role_alive, start_role

log = get_logger("agl.stack")

ROLES = ("processor", "gateway", "ingress")
"""The store and task ingress from external systems: always started."""
TRAINING_ROLES = ("triplets", "batcher")
"""Training data: the triplet builder and the batcher (``up(training=True)``)."""
READY_FILES = {
    "processor": "processor.ready",
    "ingress": "ingress.ready",
    "triplets": "triplets.ready",
    "batcher": "batcher.ready",
}


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
    """Fill in what `agl-stream up` recorded (bootstrap, gateway) where the settings leave it open."""
    stack = read_stack(settings)
    if stack is None:
        return settings
    update: dict[str, Any] = {}
    if settings.kafka_bootstrap is None:
        update["kafka_bootstrap"] = stack.bootstrap
    if settings.gateway_url is None and settings.clickhouse_url is None and stack.gateway_url:
        update["gateway_url"] = stack.gateway_url
    return settings.model_copy(update=update) if update else settings


def _wait_for(
    condition: Any, timeout: float, what: str, process: subprocess.Popen[bytes] | None, log_path: Path
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if process is not None and process.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:] if log_path.exists() else ""
            raise StackError(f"{what} exited with code {process.returncode}; its log ({log_path}) ends with:\n{tail}")
        if time.monotonic() > deadline:
            raise StackError(f"{what} was not ready after {timeout:.0f}s; see {log_path}")
        time.sleep(0.05)  # polling a readiness file/endpoint of a child process


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


def up(settings: Settings, *, timeout: float = 120.0, training: bool = False) -> StackInfo:
    """Start what is not running yet and wait until every part answers.

    ``training``: also the triplet builder and the batcher (the RL data path).
    """
    roles = ROLES + (TRAINING_ROLES if training else ())
    existing = read_stack(settings)
    if existing is not None and all(role_alive(pid) for pid in existing.pids.values()):
        return existing
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    started_broker = False
    if settings.uses_local_broker:
        info = broker.start(settings)
        started_broker = info.started
    bootstrap = settings.bootstrap_servers
    running = settings.model_copy(update={"kafka_bootstrap": bootstrap})
    asyncio.run(admin.apply(running))
    for stale in ("gateway.json", *READY_FILES.values()):
        (settings.run_dir / stale).unlink(missing_ok=True)
    processes = {
        role: start_role(running, role, log_path=settings.run_dir / f"{role}.log", detach=True) for role in roles
    }
    stack = StackInfo(
        bootstrap=bootstrap,
        topic_prefix=settings.topic_prefix,
        pids={r: p.pid for r, p in processes.items()},
        started_broker=started_broker,
        started_at=time.time(),
    )
    _stack_file(settings).write_text(stack.model_dump_json(indent=2))
    try:
        stack.gateway_url = _wait_for(
            lambda: _gateway_ready(settings),
            timeout,
            "the gateway",
            processes["gateway"],
            settings.run_dir / "gateway.log",
        )
        for role in roles:
            if role in READY_FILES:
                ready_file = settings.run_dir / READY_FILES[role]
                _wait_for(
                    ready_file.exists, timeout, f"the {role} role", processes[role], settings.run_dir / f"{role}.log"
                )
    except BaseException:
        down(settings)
        raise
    _stack_file(settings).write_text(stack.model_dump_json(indent=2))
    return stack


def down(settings: Settings, *, timeout: float = 30.0) -> list[str]:
    """Stop the roles `up` started (gracefully, SIGKILL after ``timeout``) and its broker."""
    stack = read_stack(settings)
    stopped: list[str] = []
    if stack is None:
        return stopped
    for role in reversed(list(stack.pids)):
        pid = stack.pids.get(role)
        if pid is not None and role_alive(pid):
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while role_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)  # waiting for a non-child process to exit: no waitpid possible
            if role_alive(pid):
                os.kill(pid, signal.SIGKILL)
            stopped.append(role)
    if stack.started_broker and broker.stop(settings):
        stopped.append("broker")
    _stack_file(settings).unlink(missing_ok=True)
    return stopped


def status(settings: Settings) -> dict[str, str]:
    """Each part of the stack and whether it runs (and answers)."""
    stack = read_stack(settings)
    if stack is None:
        return {}
    parts = {"kafka": f"{stack.bootstrap}" + (" (local broker)" if stack.started_broker else "")}
    for role, pid in stack.pids.items():
        parts[role] = f"running (pid {pid})" if role_alive(pid) else f"not running (pid {pid} gone)"
    if stack.gateway_url:
        parts["gateway"] += f" at {stack.gateway_url}" if _gateway_ready(settings) else " but not answering"
    return parts
