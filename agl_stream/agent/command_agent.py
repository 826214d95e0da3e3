"""Agents as commands: one process per attempt, in any language, captured through the LLM proxy.

``CommandAgent("node agent.js")`` (``agl-stream runner --command "node agent.js"``, or the agent
given to ``Trainer.fit``) runs the command once per attempt with ``/bin/sh -c`` in a fresh,
empty working directory, in a process group of its own. What the process gets (environment):

=====================  ==============================================================================
``OPENAI_BASE_URL``    an OpenAI-compatible base URL (``.../v1``). With a ``ProxyLLM`` resource it is
                       this attempt's route through the LLM proxy, so every call the process makes is
                       recorded token-exactly as this attempt's training data; with an ``LLM`` it is
                       that endpoint as it is.
``OPENAI_API_KEY``     the resource's key (``agl-stream`` when it has none: clients demand one)
``AGL_MODEL``          the model name to ask for
``AGL_TASK_FILE``      ``task.json`` in the working directory: the rollout's input as JSON
``AGL_TASK``           the same JSON text, when it is under 64 KiB (else read the file)
``AGL_ROLLOUT_ID``,    the ids and mode (``train``, ``val``, ``test``) of the attempt
``AGL_ATTEMPT_ID``,
``AGL_MODE``
``AGL_REWARD_FILE``    where the process may write its reward
``TRACEPARENT``        the W3C trace context of the attempt (OpenTelemetry SDKs that read it join the
                       attempt's trace)
``OTEL_RESOURCE_``     ``agentlightning.rollout_id=...,agentlightning.attempt_id=...`` (after what
``ATTRIBUTES``         the runner's environment had), so spans an OpenTelemetry SDK exports belong to
                       the attempt
``OTEL_EXPORTER_``     under a runner that knows the stack's gateway: its OTLP/HTTP receiver
``OTLP_TRACES_``       (``ENDPOINT``, ``HEADERS`` with the API token, ``PROTOCOL`` ``http/protobuf``),
``*``                  so a program whose SDK is configured from the environment exports its spans
                       into the attempt; with ``TRACEPARENT`` as their parent they join its tree
=====================  ==============================================================================

The reward comes back through one of two channels, the first that has one:

1. the file ``$AGL_REWARD_FILE``: a JSON number, ``null``, or an object ``{"reward": ...}``;
2. the last non-blank line of stdout: the same forms (a line that is not JSON means no reward).

A missing reward is ``None`` (the attempt succeeds without one, as an agent returning ``None``).
A reward that is present but not a finite number, a non-zero exit status, a kill by a signal and
a run past ``timeout_s`` fail the attempt with :class:`CommandError`, whose message holds the tail
of the process's stderr. A timeout, and the runner's cancellation (SIGTERM, a lost attempt), stop
the whole process group: SIGTERM, then SIGKILL after ``stop_grace_s``. Only the last 64 KiB of
stdout and of stderr are kept, whatever the process writes. The working directory is removed
after the attempt. Concurrency is the runner's ``--concurrency``.

Concurrency model: one asyncio task per attempt (the runner's); each owns its process, its
directory and its output buffers; nothing is shared between attempts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from opentelemetry import propagate

from agl_stream.agent.litagent import LitAgent, NamedResources
from agl_stream.models import LLM, ProxyLLM, Rollout
from agl_stream.wire.semconv import ATTEMPT_ID_KEY, ROLLOUT_ID_KEY

OUTPUT_TAIL_BYTES = 64 * 1024
"""How much of a process's stdout and of its stderr is kept (the end of each)."""
TASK_ENV_LIMIT = 64 * 1024
"""``AGL_TASK`` is set when the task's JSON is shorter than this; the file always holds it."""
PLACEHOLDER_KEY = "agl-stream"


class CommandError(RuntimeError):
    """The agent command failed: its exit status, a signal, a timeout, or a malformed reward."""


@dataclass(frozen=True)
class Endpoint:
    base_url: str
    model: str
    api_key: str


# -- the pure core --------------------------------------------------------------------------------


def endpoint_of(resources: NamedResources, rollout_id: str, attempt_id: str) -> Endpoint | None:
    """The first LLM resource as the process sees it: a ProxyLLM becomes this attempt's route."""
    for resource in resources.values():
        if isinstance(resource, ProxyLLM):
            url = resource.get_base_url(rollout_id, attempt_id)
        elif isinstance(resource, LLM):
            url = resource.endpoint
        else:
            continue
        return Endpoint(url, resource.model, resource.api_key or PLACEHOLDER_KEY)
    return None


@dataclass(frozen=True)
class OtlpTarget:
    """Where a command's OpenTelemetry SDK sends its spans: an OTLP/HTTP traces endpoint (the
    gateway's ``/v1/traces``) and the headers it asks for."""

    traces_endpoint: str
    headers: Mapping[str, str] = field(default_factory=dict)


def _otel_pairs(pairs: Mapping[str, str]) -> str:
    """``key=value,...`` as OTEL_RESOURCE_ATTRIBUTES and OTEL_EXPORTER_OTLP_HEADERS take them
    (values percent-encoded)."""
    return ",".join(f"{key}={quote(value, safe='')}" for key, value in pairs.items())


def command_environment(
    *,
    task_json: str,
    task_file: Path,
    reward_file: Path,
    rollout_id: str,
    attempt_id: str,
    mode: str | None,
    endpoint: Endpoint | None,
    trace_context: Mapping[str, str],
    base: Mapping[str, str],
    otlp: OtlpTarget | None = None,
) -> dict[str, str]:
    """The process's environment: ``base`` (the runner's) plus what the module docstring lists."""
    env = dict(base)
    ids = _otel_pairs({ROLLOUT_ID_KEY: rollout_id, ATTEMPT_ID_KEY: attempt_id})
    env["OTEL_RESOURCE_ATTRIBUTES"] = ",".join(filter(None, (base.get("OTEL_RESOURCE_ATTRIBUTES"), ids)))
    if otlp is not None:
        env.update(
            OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=otlp.traces_endpoint,
            OTEL_EXPORTER_OTLP_TRACES_HEADERS=_otel_pairs(otlp.headers),
            OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf",
        )
    env.update(
        AGL_TASK_FILE=str(task_file),
        AGL_REWARD_FILE=str(reward_file),
        AGL_ROLLOUT_ID=rollout_id,
        AGL_ATTEMPT_ID=attempt_id,
        AGL_MODE=mode or "",
    )
    if len(task_json.encode()) < TASK_ENV_LIMIT:
        env["AGL_TASK"] = task_json
    else:
        env.pop("AGL_TASK", None)
    if endpoint is not None:
        env.update(OPENAI_BASE_URL=endpoint.base_url, OPENAI_API_KEY=endpoint.api_key, AGL_MODEL=endpoint.model)
    if "traceparent" in trace_context:
        env["TRACEPARENT"] = trace_context["traceparent"]
        if "tracestate" in trace_context:
            env["TRACESTATE"] = trace_context["tracestate"]
    return env


def _reward_value(value: Any, where: str) -> float | None:
    if isinstance(value, dict):
        if "reward" not in value:
            raise CommandError(f"{where}: a JSON object without a 'reward' key")
        value = value["reward"]
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise CommandError(f"{where}: the reward must be a finite number or null, not {value!r}"[:300])
    return float(value)


def parse_reward(stdout_tail: str, reward_file_text: str | None) -> float | None:
    """The reward the process gave (see the module docstring), ``None`` when it gave none.

    CommandError for a reward file that is not one of the forms, or a last stdout line that is a
    JSON number or object but no valid reward."""
    if reward_file_text is not None:
        try:
            value = json.loads(reward_file_text)
        except ValueError as error:
            raise CommandError(f"the reward file is not JSON: {error}") from None
        return _reward_value(value, "the reward file")
    lines = [line.strip() for line in stdout_tail.splitlines() if line.strip()]
    if not lines:
        return None
    try:
        value = json.loads(lines[-1])
    except ValueError:
        return None  # ordinary output: no reward on stdout
    if not isinstance(value, dict | int | float) and value is not None:
        return None  # a JSON string or list is output, not a reward
    return _reward_value(value, "the last line of stdout")


def failure_message(returncode: int, stderr_tail: str) -> str:
    """What a failed process says: its status (or signal) and the end of its stderr."""
    how = f"was killed by signal {-returncode}" if returncode < 0 else f"exited with status {returncode}"
    tail = stderr_tail.strip()[-2000:]
    return f"the agent command {how}" + (f"; the end of its stderr:\n{tail}" if tail else " (no stderr)")


# -- the shell: one process ----------------------------------------------------------------------


class _Protocol(asyncio.subprocess.SubprocessStreamProtocol):
    """asyncio's streams, plus ``exited``: done when the shell exits. ``Process.wait()`` returns
    only once every pipe is closed too, which a process the command left running (holding its
    stdout) may never do; the agent's run ends with the shell, then its group is stopped."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=65536, loop=loop)
        self.exited: asyncio.Future[None] = loop.create_future()

    def process_exited(self) -> None:
        super().process_exited()
        if not self.exited.done():
            self.exited.set_result(None)


async def _spawn(
    command: str, *, cwd: Path, env: Mapping[str, str], stop_grace_s: float
) -> tuple[asyncio.subprocess.Process, _Protocol]:
    """``/bin/sh -c command`` leading a process group of its own, with its output piped.

    A cancellation while it starts lets it start, stops its group, then goes on: asyncio's own
    clean-up of a half-started process kills the shell alone and waits for its pipes, which a
    child of the shell holds open (a run cancelled there waited for ``sleep 600`` to end).
    """
    loop = asyncio.get_running_loop()

    async def start() -> tuple[asyncio.subprocess.Process, _Protocol]:
        transport, protocol = await loop.subprocess_exec(
            lambda: _Protocol(loop),
            *("/bin/sh", "-c", command),
            cwd=cwd,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        return asyncio.subprocess.Process(transport, protocol, loop), protocol

    starting = asyncio.ensure_future(start())
    try:
        return await asyncio.shield(starting)
    except asyncio.CancelledError:
        process, _ = await starting
        await _stop_group(process, stop_grace_s)
        raise


async def _keep_tail(stream: asyncio.StreamReader, into: bytearray) -> None:
    while chunk := await stream.read(65536):
        into += chunk
        if len(into) > OUTPUT_TAIL_BYTES:
            del into[: len(into) - OUTPUT_TAIL_BYTES]


async def _settle(readers: asyncio.Future[Any]) -> None:
    """The output readers, once the process group is gone (bounded: a pipe a stray process holds
    open is cut)."""
    try:
        await asyncio.wait_for(readers, 10.0)
    except (TimeoutError, OSError):
        pass


def _signal_group(process: asyncio.subprocess.Process, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signum)  # the shell leads its own group: every child it started too


async def _stop_group(process: asyncio.subprocess.Process, grace_s: float) -> None:
    _signal_group(process, signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), grace_s)
    except TimeoutError:
        pass
    _signal_group(process, signal.SIGKILL)  # also children the shell left behind
    await process.wait()


class CommandAgent(LitAgent[Any]):
    """Run ``command`` (a shell command line) once per attempt; see the module docstring.

    ``timeout_s``: most seconds one run may take (None: no limit); ``workdir_root``: where the
    per-attempt directories are made (default: the system's temporary folder); ``env``: more
    environment variables for every run; ``stop_grace_s``: seconds between SIGTERM and SIGKILL."""

    def __init__(
        self,
        command: str,
        *,
        timeout_s: float | None = None,
        workdir_root: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        stop_grace_s: float = 10.0,
        otlp: Callable[[], OtlpTarget | None] | None = None,
    ) -> None:
        if not command.strip():
            raise ValueError("the agent command is empty")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, not {timeout_s}")
        self.command = command
        self.timeout_s = timeout_s
        self.workdir_root = Path(workdir_root) if workdir_root is not None else None
        self.env = dict(env or {})
        self.stop_grace_s = stop_grace_s
        self.otlp = otlp
        """Where the process's OTLP exports go, asked per attempt (the runner sets it: the stack's
        gateway, wherever it runs now); None: no exporter settings."""

    def __repr__(self) -> str:
        return f"CommandAgent({self.command!r})"

    def is_async(self) -> bool:
        return True

    async def rollout_async(self, task: Any, resources: NamedResources, rollout: Rollout) -> float | None:
        attempt = getattr(rollout, "attempt", None)
        attempt_id = attempt.attempt_id if attempt is not None else ""
        if self.workdir_root is not None:
            self.workdir_root.mkdir(parents=True, exist_ok=True)
        workdir = Path(tempfile.mkdtemp(prefix=f"agl-{rollout.rollout_id}-", dir=self.workdir_root))
        try:
            return await self._run(task, resources, rollout, attempt_id, workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    async def _run(
        self, task: Any, resources: NamedResources, rollout: Rollout, attempt_id: str, workdir: Path
    ) -> float | None:
        task_json = json.dumps(task)
        task_file, reward_file = workdir / "task.json", workdir / "reward.json"
        task_file.write_text(task_json)
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        env = command_environment(
            task_json=task_json,
            task_file=task_file,
            reward_file=reward_file,
            rollout_id=rollout.rollout_id,
            attempt_id=attempt_id,
            mode=rollout.mode,
            endpoint=endpoint_of(resources, rollout.rollout_id, attempt_id),
            trace_context=carrier,
            base={**os.environ, **self.env},
            otlp=self.otlp() if self.otlp is not None else None,
        )
        process, protocol = await _spawn(self.command, cwd=workdir, env=env, stop_grace_s=self.stop_grace_s)
        assert process.stdout is not None and process.stderr is not None
        out, err = bytearray(), bytearray()
        readers = asyncio.gather(_keep_tail(process.stdout, out), _keep_tail(process.stderr, err))
        try:
            await asyncio.wait_for(asyncio.shield(protocol.exited), self.timeout_s)
        except TimeoutError:
            await _stop_group(process, self.stop_grace_s)
            await _settle(readers)
            tail = err.decode(errors="replace").strip()[-2000:]
            raise CommandError(
                f"the agent command ran past its timeout ({self.timeout_s:g} s) and was stopped"
                + (f"; the end of its stderr:\n{tail}" if tail else "")
            ) from None
        except BaseException:  # cancelled (the runner stopping, the attempt given back): stop it all
            await asyncio.shield(_stop_group(process, self.stop_grace_s))
            await _settle(readers)
            raise
        _signal_group(process, signal.SIGKILL)  # what the command left running in its group
        await process.wait()  # its pipes close with the group
        await _settle(readers)
        stderr = err.decode(errors="replace")
        if process.returncode != 0:
            raise CommandError(failure_message(process.returncode or 0, stderr))
        reward_text = reward_file.read_text() if reward_file.is_file() else None
        return parse_reward(out.decode(errors="replace"), reward_text)
