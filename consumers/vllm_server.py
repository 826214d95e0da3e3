"""The vLLM inference role: vLLM's OpenAI server as a managed child process that serves every
policy version the trainer publishes (``agl-stream inference --engine vllm``).

Concurrency model: one asyncio event loop. The ResourcesCache callback (on the loop) only records
the newest eligible checkpoint and sets an event; one task, :meth:`VllmManager.run`, does every
start and stop of the child, so two restarts never overlap and the child is never started twice.
The child runs in a process group of its own (vLLM's API server starts engine-core and worker
processes); it is stopped through its PID's group: SIGTERM, then SIGKILL after ``stop_timeout_s``.

How a new version reaches vLLM: a **managed restart**. The child is stopped and started again
with ``--model <the new checkpoint folder>`` (the trainer writes each version as an HF folder),
then the manager waits for its ``/health``. vLLM's in-place paths (sleep/wake, ``collective_rpc``
``reload_weights``, the weight-transfer API) change from release to release, reload from the
path given at start, or stream weights from the trainer's GPUs over NCCL; a restart works with
every vLLM release and with the checkpoints already on disk (docs/design-notes.md, "vLLM: how a
policy version reaches the server").

A restart drops no call: the role's port is the hand-off gate's (``consumers/switch_gate.py``),
and the child listens on a private loopback port behind it. A switch pauses the gate (new calls
wait there), drains the calls in flight (up to ``drain_timeout_s``; a call cut before any output
is sent again to the new server), restarts the child and resumes the gate once the new server is
healthy (a call held past ``hold_timeout_s`` gets a 503 with Retry-After). Every answer names the
version that served it (``x-agl-policy-version``), which the LLM proxy records on the call's span.

A version that does not come up healthy (a bad folder, the server exits) is marked failed and
never retried, and the previous folder is served again; a child that exits on its own is started
again on the folder it served. The command is vLLM's OpenAI server by default; anything that takes
``--model``, ``--served-model-name``, ``--host`` and ``--port`` and answers ``GET /health`` can
stand in for it (tests use ``agl-stream inference --no-follow``).

The API token: the child requires it whenever an agl-stream listener on the same host would
(``agl_stream.auth.listener_token``: always beyond loopback, on loopback with
``AGL_REQUIRE_TOKEN``; a host beyond loopback without a token is refused before anything starts).
vLLM takes it as its ``api-key`` from a YAML options file (``--config``; created 0600 in a private
0700 directory, removed at exit), never on its command line or in its environment, where other
users of the machine could read it. vLLM then asks every ``/v1`` request for
``Authorization: Bearer <token>``; its ``/health`` stays open, which is what the manager polls.
A stand-in command must take ``--config`` too when a token applies.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx

from agl_stream.auth import write_private
from agl_stream.config import Settings
from agl_stream.domain.checkpoints import choose_checkpoint, local_checkpoint_path
from agl_stream.http_serving import QuietServer, bind, listen, server_config
from agl_stream.local.processes import stop_on_signals
from agl_stream.logs import get_logger
from agl_stream.models import ModelCheckpoint, ResourcesUpdate
from agl_stream.store.resources_cache import ResourcesCache
from consumers.switch_gate import HandoffOptions, SwitchGate

log = get_logger("agl.inference.vllm")

VLLM_MODULE = "vllm.entrypoints.openai.api_server"


def default_command() -> list[str]:
    """vLLM's OpenAI-compatible server, run by this interpreter (vLLM installed beside agl-stream)."""
    return [sys.executable, "-m", VLLM_MODULE]


@dataclass(frozen=True)
class VllmOptions:
    model_name: str  # --served-model-name: what clients (the LLM proxy) ask for
    model: Path | None = None  # the folder served until a checkpoint is published
    host: str = "127.0.0.1"
    port: int = 8000
    follow: bool = True  # follow agl.resources for new checkpoints
    policy_version: int = 0  # the version of ``model``
    command: tuple[str, ...] = field(default_factory=lambda: tuple(default_command()))
    extra_args: tuple[str, ...] = ()  # passed to the server as they are (--gpu-memory-utilization 0.8 ...)
    ready_timeout_s: float = 900.0  # a large model's first load, CUDA graphs included
    stop_timeout_s: float = 60.0
    poll_s: float = 0.5  # between looks at /health while the child starts
    options_file: Path | None = None  # a YAML file of more server options (the api-key): --config
    child_port: int = 0  # the child's private loopback port behind the gate (0: a free one)
    handoff: HandoffOptions = field(default_factory=HandoffOptions)  # the gate's hold and drain deadlines


def server_command(options: VllmOptions, model: Path) -> list[str]:
    """The child's command line for serving ``model`` (vLLM's OpenAI server flags)."""
    return [
        *options.command,
        "--model",
        str(model),
        "--served-model-name",
        options.model_name,
        "--host",
        options.host,
        "--port",
        str(options.port),
        *(("--config", str(options.options_file)) if options.options_file is not None else ()),
        *options.extra_args,
    ]


API_KEY_FILE = "vllm-options.yaml"


def api_key_options(token: str) -> str:
    """The YAML options file that makes vLLM require ``token`` (its ``--api-key``)."""
    return f"api-key: {json.dumps(token)}\n"  # a JSON string is a YAML scalar, quoted


def write_api_key_options(directory: Path, token: str) -> Path:
    """Write :func:`api_key_options` to ``directory`` (0600); returns the file's path."""
    path = directory / API_KEY_FILE
    write_private(path, api_key_options(token))
    return path


def parse_command(text: str | None) -> tuple[str, ...]:
    """A ``--vllm-command`` value split like a shell would; empty or None: vLLM's server."""
    parts = shlex.split(text or "")
    return tuple(parts) if parts else tuple(default_command())


def health_url(options: VllmOptions) -> str:
    host = "127.0.0.1" if options.host in ("0.0.0.0", "::", "") else options.host
    return f"http://[{host}]:{options.port}/health" if ":" in host else f"http://{host}:{options.port}/health"


class ServerFailedError(RuntimeError):
    """The child exited, or did not answer /health in time."""


class ManagedServer:
    """One child server process: started on a folder, waited for, stopped by its PID's group."""

    def __init__(self, options: VllmOptions) -> None:
        self.options = options
        self.process: asyncio.subprocess.Process | None = None
        self.model: Path | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    async def start(self, model: Path) -> None:
        assert not self.running(), "stop the running child first"
        argv = server_command(self.options, model)
        log.info("starting the model server", model=str(model), command=shlex.join(argv))
        # A session of its own: SIGTERM to the group reaches vLLM's engine and worker processes too.
        self.process = await asyncio.create_subprocess_exec(
            *argv, start_new_session=True, stdin=asyncio.subprocess.DEVNULL
        )
        self.model = model

    async def exited(self) -> None:
        """Until the child exits (at once when there is none)."""
        if self.process is not None:
            await self.process.wait()

    async def wait_ready(self, client: httpx.AsyncClient) -> None:
        """Until ``/health`` answers 200; ServerFailedError when the child exits or time runs out."""
        deadline = time.monotonic() + self.options.ready_timeout_s
        url = health_url(self.options)
        while True:
            if not self.running():
                code = self.process.returncode if self.process is not None else None
                raise ServerFailedError(f"the model server exited with status {code} before it was ready")
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(url, timeout=5.0)).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise ServerFailedError(
                    f"the model server did not answer {url} within {self.options.ready_timeout_s} s"
                )
            await asyncio.sleep(self.options.poll_s)  # polling another process's readiness

    async def stop(self) -> None:
        """SIGTERM to the child's process group, SIGKILL after ``stop_timeout_s``; waits for it."""
        process = self.process
        if process is None:
            return
        if process.returncode is None:
            _signal_group(process.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), self.options.stop_timeout_s)
            except asyncio.TimeoutError:
                log.warning("the model server did not stop in time: killing it", pid=process.pid)
                _signal_group(process.pid, signal.SIGKILL)
                await process.wait()
        # The group may outlive its leader (an engine process still exiting): make sure it is gone.
        _signal_group(process.pid, signal.SIGKILL)
        self.process = None


def _signal_group(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)  # the child leads its own session: its pid is the group id


def child_options(options: VllmOptions) -> VllmOptions:
    """The child's options: the role's, on a private loopback port (the gate holds the role's port)."""
    port = options.child_port
    if port == 0:
        probe = bind("127.0.0.1", 0)
        port = probe.getsockname()[1]
        probe.close()
    return replace(options, host="127.0.0.1", port=port, child_port=port)


def child_url(options: VllmOptions) -> str:
    return f"http://127.0.0.1:{options.port}"


class VllmManager:
    """Serves the newest published policy version through a managed child server behind a gate."""

    def __init__(self, settings: Settings | None, options: VllmOptions) -> None:
        if options.follow and settings is None:
            raise ValueError("following checkpoints needs Kafka settings (or follow=False)")
        self.settings = settings
        self.options = options
        self.server = ManagedServer(child_options(options))
        self.gate = SwitchGate(options.handoff)
        self.version: int | None = None  # the policy version the child serves (None: none yet)
        self.failed: set[int] = set()
        self.restarts = 0
        self._wanted: ModelCheckpoint | None = None
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._served = asyncio.Condition()
        self._cache: ResourcesCache | None = None
        self._loading: int | None = None  # the version a restart is bringing up

    # -- which version ------------------------------------------------------------------------

    def _on_resources(self, update: ResourcesUpdate) -> None:
        """ResourcesCache callback (event loop): remember the newest checkpoint of our model."""
        self._consider(update.resources.values())

    def _consider(self, resources: Iterable[object]) -> None:
        # Versions at or below the one served, or the one a restart is bringing up, are not news
        # (the trainer publishes its last version again when it starts). Before the first start,
        # --model is --policy-version (the trainer's v0 of the same folder is not news either).
        served = self.version
        if served is None:
            served = self.options.policy_version if self.options.model is not None else -1
        choice = choose_checkpoint(
            resources,
            model=self.options.model_name,
            loaded_version=max(served, self._loading if self._loading is not None else -1),
            chosen=self._wanted,
            failed=self.failed,
        )
        for refused, why in choice.refused:
            log.warning("checkpoint not served", version=refused.policy_version, reason=why)
        if choice.checkpoint is not None and choice.checkpoint is not self._wanted:
            self._wanted = choice.checkpoint
            self._wake.set()

    def offer(self, checkpoint: ModelCheckpoint) -> None:
        """Serve ``checkpoint`` when it is newer than what is served (what the resources follower does
        with each snapshot; callable directly when nothing follows agl.resources)."""
        self._consider([checkpoint])

    async def wait_for_version(self, version: int, timeout: float) -> None:
        async with self._served:
            await asyncio.wait_for(
                self._served.wait_for(lambda: self.version is not None and self.version >= version), timeout
            )

    def stop(self) -> None:
        self._stop.set()

    # -- the loop -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until :meth:`stop`; a stop also interrupts a start that is still loading."""
        sock = listen(self.options.host, self.options.port)  # calls queue at the gate from now on
        front = QuietServer(server_config(self.gate))
        serving = asyncio.create_task(front.serve(sockets=[sock]), name="vllm:gate")
        async with httpx.AsyncClient(trust_env=False) as client:
            try:
                work = asyncio.create_task(self._work(client), name="vllm:work")
                stopping = asyncio.create_task(self._stop.wait(), name="vllm:stopping")
                await asyncio.wait({work, stopping}, return_when=asyncio.FIRST_COMPLETED)
                for task in (work, stopping):
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task  # a failure of the work (the first start) is the role's failure
            finally:
                await self.gate.close()
                front.should_exit = True
                with contextlib.suppress(Exception):
                    await serving
                sock.close()
                await self.server.stop()
                if self._cache is not None:
                    await self._cache.stop()
        log.info("model server manager stopped", version=self.version, restarts=self.restarts)

    async def _work(self, client: httpx.AsyncClient) -> None:
        if self.options.follow:
            assert self.settings is not None
            self._cache = ResourcesCache(self.settings)
            self._cache.on_update.append(self._on_resources)
            await self._cache.start()  # caught up: the first start serves the newest published version
        await self._serve_first(client)
        while True:
            await self._wait_for_work()
            if self._wanted is not None:
                await self._switch(client, self._wanted)
            elif not self.server.running():
                await self._revive(client)

    async def _wait_for_work(self) -> None:
        """Until a new checkpoint is wanted or the child exits."""
        exited = asyncio.create_task(self.server.exited(), name="vllm:child")
        woken = asyncio.create_task(self._wake.wait(), name="vllm:wake")
        try:
            await asyncio.wait({exited, woken}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (exited, woken):
                task.cancel()
            self._wake.clear()

    async def _serve_first(self, client: httpx.AsyncClient) -> None:
        wanted = self._wanted
        if wanted is not None:
            await self._switch(client, wanted)
            if self.version is not None:
                return
        if self.options.model is None:
            raise ServerFailedError("no checkpoint is published for this model yet: give --model <HF folder>")
        await self.server.start(self.options.model)
        await self.server.wait_ready(client)  # the configured model must come up: else the role fails
        await self._served_now(self.options.policy_version)

    async def _switch(self, client: httpx.AsyncClient, checkpoint: ModelCheckpoint) -> None:
        """Restart the child on ``checkpoint``'s folder; on failure, serve the previous one again."""
        self._wanted = None
        self._loading = checkpoint.policy_version
        try:
            served = await self._restart_on(client, checkpoint)
        finally:
            self._loading = None
        if served:
            await self._served_now(checkpoint.policy_version)
        elif not self.gate.serving() and self.version is not None and self.server.running():
            await self.gate.resume(child_url(self.server.options), self.version)  # the previous folder again

    async def _restart_on(self, client: httpx.AsyncClient, checkpoint: ModelCheckpoint) -> bool:
        previous = self.server.model
        try:
            folder = local_checkpoint_path(checkpoint.uri)
            if not (folder / "config.json").is_file():
                raise ServerFailedError(f"{folder} is not a Hugging Face model folder (no config.json)")
            await self._pause_and_drain(checkpoint.policy_version)
            await self.server.stop()
            self.restarts += 1
            await self.server.start(folder)
            await self.server.wait_ready(client)
        except (ServerFailedError, ValueError, OSError) as error:
            self.failed.add(checkpoint.policy_version)
            log.warning(
                "checkpoint not served", version=checkpoint.policy_version, uri=checkpoint.uri, error=str(error)
            )
            if not self.server.running() and previous is not None:
                await self.server.stop()
                await self.server.start(previous)
                await self.server.wait_ready(client)  # the folder that served before: it must come back
            return False
        log.info("policy version served", version=checkpoint.policy_version, model=str(folder))
        return True

    async def _revive(self, client: httpx.AsyncClient) -> None:
        code = self.server.process.returncode if self.server.process is not None else None
        model = self.server.model
        log.warning("the model server exited: starting it again", status=code, model=str(model))
        self.gate.pause()  # no drain: the calls in flight died with the child (the gate resends them)
        await self.server.stop()
        if model is None:
            raise ServerFailedError("the model server exited and there is no folder to serve")
        self.restarts += 1
        await self.server.start(model)
        await self.server.wait_ready(client)
        if self.version is not None:
            await self.gate.resume(child_url(self.server.options), self.version)

    async def _pause_and_drain(self, version: int) -> None:
        """Hold new calls at the gate and let the ones in flight finish (up to the drain deadline)."""
        self.gate.pause()
        started = time.monotonic()
        left = await self.gate.drain()
        log.info(
            "calls drained for a switch",
            version=version,
            drain_s=round(time.monotonic() - started, 3),
            cut=left,  # still in flight at the deadline: resent when they had produced no output
        )

    async def _served_now(self, version: int) -> None:
        """``version`` is served: the gate sends calls (the held ones first) to the child."""
        await self.gate.resume(child_url(self.server.options), version)
        async with self._served:
            self.version = version
            self._served.notify_all()


async def run_vllm(settings: Settings | None, options: VllmOptions) -> None:
    manager = VllmManager(settings, options)
    with stop_on_signals(manager.stop):
        await manager.run()


def main(settings: Settings | None, options: VllmOptions, token: str | None = None) -> None:
    """Serve until SIGTERM/SIGINT (``agl-stream inference --engine vllm``). ``token``: the API
    token the server requires (``listener_token`` of the settings and host), None for none."""
    if token is None:
        asyncio.run(run_vllm(settings, options))
        return
    private = Path(tempfile.mkdtemp(prefix="agl-vllm-"))  # 0700
    try:
        options = replace(options, options_file=write_api_key_options(private, token))
        asyncio.run(run_vllm(settings, options))
    finally:
        shutil.rmtree(private, ignore_errors=True)
