"""``agl_stream.Trainer``: the seed's ``Trainer(algorithm=..., n_runners=...).fit(agent, train, val)``
over the event-sourced pipeline.

A run (``fit`` or ``dev``):

1. attaches to the running cluster (a stack ``agl-stream up`` started for the data dir, or a
   deployed one named by AGL_GATEWAY_URL), or else starts the local stack (the broker too
   unless AGL_KAFKA_BOOTSTRAP names one) and stops it at the end (:func:`agl_stream.local.stack.session_plan`);
2. hands the algorithm its components and starts the processes it asks for
   (:meth:`Algorithm.roles`), then ``n_runners`` runner processes (``agl-stream runner``) with
   the agent (:mod:`agl_stream.trainer.shipping` says how it gets there, and its limits);
3. runs the algorithm with a store of its own (:class:`RunStore`) on an event loop of its own,
   showing a live line (rollouts, reward, policy version), and watches the processes it
   started: one that exits while needed ends the run with its log's tail;
4. reads the run's summary with SQL (rollouts and mean reward per mode), stops everything it
   started (runners first, then the algorithm's roles, then the stack if it started it), also
   on Ctrl-C or an error; processes are stopped by their PIDs, none is left behind.

Concurrency model: one run at a time per Trainer, driven from the calling thread, which must not
be running an event loop (the run has its own). An async algorithm runs on the run's loop; a
synchronous one in a daemon thread, calling the store through a blocking facade.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from pydantic import ValidationError
from rich.console import Console

from agl_stream.agent.litagent import Hook, LitAgent
from agl_stream.algorithm.base import Algorithm, FastAlgorithm
from agl_stream.algorithm.baseline import Baseline
from agl_stream.algorithm.blocking import BlockingStore
from agl_stream.algorithm.datasets import load_dataset
from agl_stream.algorithm.registry import make_algorithm
from agl_stream.algorithm.report import ModeReport, rewards_by_mode
from agl_stream.config import Settings, load_settings
from agl_stream.domain.adapter import AdapterConfig
from agl_stream.errors import AlgorithmError, ConfigError, TrainerError
from agl_stream.local import stack
from agl_stream.local.processes import Progress, RoleGroup, log_tail
from agl_stream.logs import get_logger
from agl_stream.store.client import AglStore
from agl_stream.trainer.progress import FitResult, RunProgress, show_summary
from agl_stream.trainer.run_store import RunStore
from agl_stream.trainer.shipping import AGENT_FILE, as_agent, child_environment, ship

log = get_logger("agl.trainer")

WATCH_INTERVAL_S = 0.5
"""Seconds between two looks at the run's processes (child exit status cannot be awaited here)."""


class Trainer:
    """Train (or just run) an agent: ``Trainer(algorithm=Baseline(), n_runners=4).fit(agent, train, val)``.

    Args:
        algorithm: an :class:`Algorithm` (``Baseline()``, an ``@algo`` function), its class, a
            registered name (``"baseline"``) or ``{"name": ..., **arguments}``. None: ``fit``
            only runs the runners, serving rollouts others enqueue, until Ctrl-C.
        n_runners: runner processes, each running ``runner_concurrency`` attempts at once.
        max_rollouts: a runner exits after claiming this many (the seed's option; None: no limit).
        initial_resources: named resources handed to the algorithm (Baseline publishes them and
            pins its rollouts to them).
        adapter: the trace adapter's settings (``AdapterConfig`` or a mapping of its fields),
            for algorithms that build triplets.
        llm_proxy: base URL of a running ``agl-stream llm-proxy``, handed to the algorithm.
        store: a store whose settings name the cluster (the run opens its own client on them:
            a client belongs to one event loop).
        hooks: runner hooks (``Hook`` instances), run in every runner process.
        settings: the settings of the run (default: the environment, ``AGL_*``).
        cluster: "auto" (attach when a cluster runs, else start the local stack), "attach" or
            "start" (see :func:`agl_stream.local.stack.session_plan`).
        runner_concurrency: attempts one runner process runs at once (1, as the seed's runner).
        runner_grace_s: on stop, seconds live attempts may finish before they are released.
        progress: show the live line and the summary on ``console``.
    """

    def __init__(
        self,
        *,
        algorithm: Any = None,
        n_runners: int = 1,
        max_rollouts: int | None = None,
        initial_resources: Mapping[str, Any] | None = None,
        adapter: AdapterConfig | Mapping[str, Any] | None = None,
        llm_proxy: str | None = None,
        store: AglStore | None = None,
        hooks: Hook | Sequence[Hook] | None = None,
        settings: Settings | None = None,
        cluster: stack.SessionMode = "auto",
        runner_concurrency: int = 1,
        runner_grace_s: float = 10.0,
        progress: bool = True,
        console: Console | None = None,
    ) -> None:
        if not isinstance(n_runners, int) or n_runners < 1:
            raise ConfigError(f"n_runners must be a positive integer, got {n_runners!r}")
        if max_rollouts is not None and (not isinstance(max_rollouts, int) or max_rollouts < 1):
            raise ConfigError(f"max_rollouts must be a positive integer or None, got {max_rollouts!r}")
        if not isinstance(runner_concurrency, int) or runner_concurrency < 1:
            raise ConfigError(f"runner_concurrency must be a positive integer, got {runner_concurrency!r}")
        if runner_grace_s < 0:
            raise ConfigError(f"runner_grace_s must not be negative, got {runner_grace_s}")
        if cluster not in ("auto", "attach", "start"):
            raise ConfigError(f"cluster={cluster!r}: auto, attach or start")
        self.algorithm: Algorithm | None = make_algorithm(algorithm)
        self.n_runners = n_runners
        self.max_rollouts = max_rollouts
        self.initial_resources = dict(initial_resources) if initial_resources is not None else None
        self.adapter = _adapter(adapter)
        self.llm_proxy = llm_proxy
        self.store = store
        self.hooks: tuple[Hook, ...] = _hooks(hooks)
        if settings is None:
            settings = store.settings if store is not None else load_settings()
        self.settings = settings
        self.cluster: stack.SessionMode = cluster
        self.runner_concurrency = runner_concurrency
        self.runner_grace_s = runner_grace_s
        self.progress = progress
        self.console = console or Console()
        self.last_result: FitResult | None = None
        self.started_pids: dict[str, int] = {}  # every process the latest run started (stopped by its end)

    # -- the seed's entry points ----------------------------------------------------------------

    def fit(self, agent: Any, train_dataset: Any = None, val_dataset: Any = None) -> FitResult:
        """Run the algorithm over the datasets with ``agent`` in ``n_runners`` runner processes.

        ``agent``: a LitAgent, a ``@rollout`` function or ``"pkg.module:name"``. Datasets: a list
        of JSON-able tasks, a Hugging Face dataset, or a .jsonl/.json/.parquet path
        (:func:`agl_stream.algorithm.load_dataset`). Returns the run's summary (also printed).
        """
        return self._run(agent, self.algorithm, train_dataset, val_dataset)

    def dev(self, agent: Any, train_dataset: Any = None, val_dataset: Any = None) -> FitResult:
        """A quick run through the whole pipeline: the configured algorithm if it is a
        :class:`FastAlgorithm` (as in the seed), else AlgorithmError; ``Baseline()`` when none is set."""
        algorithm = self.algorithm if self.algorithm is not None else Baseline()
        if not isinstance(algorithm, FastAlgorithm):
            raise AlgorithmError(
                f"Trainer.dev() runs a FastAlgorithm (such as Baseline), not {type(algorithm).__name__}; use fit()"
            )
        return self._run(agent, algorithm, train_dataset, val_dataset)

    # -- a run ----------------------------------------------------------------------------------

    def _run(self, agent: Any, algorithm: Algorithm | None, train_dataset: Any, val_dataset: Any) -> FitResult:
        _refuse_inside_event_loop()
        shipped = as_agent(agent)
        if isinstance(shipped, LitAgent):
            shipped.set_trainer(self)  # the seed's agent.trainer (in this process: runners get a copy)
        train = load_dataset(train_dataset, name="train_dataset")
        val = load_dataset(val_dataset, name="val_dataset")
        run_id = f"fit-{uuid.uuid4().hex[:8]}"
        log_dir = self.settings.data_dir / "logs" / f"trainer-{run_id}"
        began = time.monotonic()
        self.started_pids = {}
        session: stack.StackSession | None = None
        roles: RoleGroup | None = None
        try:
            with self._status("starting the local stack or attaching to the running one ...") as progress:
                session = stack.open_session(self.settings, mode=self.cluster, progress=progress)
            log.info("stack ready", run=run_id, started=session.owned, seconds=round(time.monotonic() - began, 1))
            roles = RoleGroup(session.settings, log_dir)
            self._start_processes(roles, session.settings, algorithm, shipped, run_id)
            log.info("runners started", run=run_id, runners=self.n_runners, logs=str(log_dir))
            modes, ids, version = asyncio.run(self._drive(session.settings, algorithm, train, val, roles))
            log.info("run finished", run=run_id, rollouts=len(ids), seconds=round(time.monotonic() - began, 1))
        finally:
            with _sigint_deferred(self.console), self._status("stopping everything the run started ..."):
                if roles is not None:
                    self.started_pids.update(roles.pids())
                    roles.stop(timeout=self.runner_grace_s + 10.0)
                if session is not None:
                    stack.close_session(session, self.settings)
                    self.started_pids.update(session.pids)
                (log_dir / AGENT_FILE).unlink(missing_ok=True)
        assert session is not None  # the run got this far: the session opened
        result = FitResult(
            run_id=run_id,
            seconds=time.monotonic() - began,
            modes=modes,
            rollout_ids=ids,
            policy_version=version,
            stack_started=session.owned,
            log_dir=log_dir,
            pids=dict(self.started_pids),
        )
        self.last_result = result
        if self.progress:
            show_summary(self.console, result)
        return result

    def _start_processes(
        self,
        roles: RoleGroup,
        settings: Settings,
        algorithm: Algorithm | None,
        agent: LitAgent[Any] | str,
        run_id: str,
    ) -> None:
        """The algorithm's roles (each ready before the next), then the runners."""
        with self._status("starting the algorithm's processes and the runners ...") as progress:
            roles.progress = progress
            if algorithm is not None:
                self._configure(algorithm)  # roles() may depend on them (VERL: the adapter's options)
            for spec in algorithm.roles(settings) if algorithm is not None else ():
                roles.start(*spec.args, name=spec.name)
                if spec.health_url is not None:
                    roles.wait_http(spec.name, spec.health_url)
            agent_args = ship(agent, self.hooks, roles.log_dir)
            resources = algorithm.runner_resources if algorithm is not None else "pinned"
            options = ["--concurrency", str(self.runner_concurrency), "--grace", str(self.runner_grace_s)]
            options += ["--resources", resources]
            options += ["--max-rollouts", str(self.max_rollouts)] if self.max_rollouts is not None else []
            environment = child_environment()
            for index in range(self.n_runners):
                roles.start(
                    "runner",
                    *agent_args,
                    *options,
                    "--worker-id",
                    f"{run_id}-runner-{index}",
                    name=f"runner-{index}",
                    env=environment,
                )

    async def _drive(
        self,
        settings: Settings,
        algorithm: Algorithm | None,
        train: list[Any] | None,
        val: list[Any] | None,
        roles: RoleGroup,
    ) -> tuple[dict[str, ModeReport], list[str], int | None]:
        store = RunStore(settings)
        await store.start()
        try:
            with RunProgress(self.console, enabled=self.progress) as progress:
                follow = asyncio.create_task(progress.follow(store), name="agl-trainer-progress")
                watch = asyncio.create_task(_watch(roles), name="agl-trainer-watch")
                work = asyncio.create_task(self._algorithm(algorithm, store, train, val), name="agl-algorithm")
                try:
                    await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
                    if watch.done():
                        watch.result()  # raises: a process the run needs has exited
                    work.result()
                finally:
                    for task in (follow, watch, work):
                        task.cancel()
                    await asyncio.gather(follow, watch, work, return_exceptions=True)
                ids = store.run_rollout_ids
                log.info("algorithm finished; reading the summary", rollouts=len(ids))
                modes = await rewards_by_mode(store, ids)  # behind a fence: every rollout of the run
                latest = await store.get_latest_resources()
                version = latest.policy_version if latest is not None else None
                progress.update(enqueued=len(ids), modes=modes, version=version)
        finally:
            await store.close()
        return modes, ids, version

    async def _algorithm(
        self, algorithm: Algorithm | None, store: RunStore, train: list[Any] | None, val: list[Any] | None
    ) -> None:
        if algorithm is None:
            log.info("no algorithm: the runners serve rollouts enqueued elsewhere until Ctrl-C")
            await asyncio.Event().wait()
            return
        self._configure(algorithm)
        if algorithm.is_async():
            algorithm.set_store(store)
            await algorithm.run(train_dataset=train, val_dataset=val)
            return
        algorithm.set_store(BlockingStore(store, asyncio.get_running_loop()))
        await _in_thread(lambda: algorithm.run(train_dataset=train, val_dataset=val))

    def _configure(self, algorithm: Algorithm) -> None:
        """Hand the algorithm the run's components (all but the store, which the run opens later)."""
        algorithm.set_trainer(self)
        algorithm.set_adapter(self.adapter)
        algorithm.set_llm_proxy(self.llm_proxy)
        if self.initial_resources is not None:
            algorithm.set_initial_resources(self.initial_resources)

    @contextlib.contextmanager
    def _status(self, message: str) -> Iterator[Progress]:
        """A spinner showing ``message`` (when progress is shown); yields what updates its text
        (a starting role's wait reports to it; without a spinner, to the log at debug level)."""
        if not self.progress:
            yield lambda line: log.debug(line)
            return
        with self.console.status(message) as spinner:
            yield spinner.update


async def _watch(roles: RoleGroup) -> None:
    """Raise TrainerError as soon as a process the run needs has exited (checked every
    WATCH_INTERVAL_S: a child's exit cannot be awaited on this loop)."""
    runners = [name for name, role in roles.roles.items() if role == "runner"]
    while True:
        exited = roles.exited()
        for name, code in exited.items():
            if roles.roles[name] != "runner" or code != 0:
                raise TrainerError(
                    f"{name} exited with code {code} while the run needed it; its log "
                    f"({roles.log_path(name)}) ends with:\n{log_tail(roles.log_path(name))}"
                )
        if runners and all(name in exited for name in runners):
            raise TrainerError("every runner exited (max_rollouts reached) before the algorithm finished")
        await asyncio.sleep(WATCH_INTERVAL_S)


async def _in_thread(call: Any) -> None:
    """Run a synchronous algorithm in a daemon thread and await its end.

    Not the loop's default executor: ``asyncio.run`` joins that on exit, so an algorithm
    blocked on something other than the store would hold a Ctrl-C'd run open forever.
    """
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[None] = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if ended.done():
            return
        if error is None:
            ended.set_result(None)
        else:
            ended.set_exception(error)

    def target() -> None:
        error: BaseException | None = None
        try:
            call()
        except BaseException as caught:  # handed to the loop, re-raised there
            error = caught
        with contextlib.suppress(RuntimeError):  # the run's loop is gone (Ctrl-C): nobody awaits
            loop.call_soon_threadsafe(settle, error)

    threading.Thread(target=target, name="agl-algorithm", daemon=True).start()
    await ended


def _refuse_inside_event_loop() -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise TrainerError(
        "fit() and dev() run an event loop of their own and cannot be called inside a running one (async code, a "
        "notebook cell): call them from synchronous code, or `await asyncio.to_thread(trainer.fit, agent, data)`"
    )


@contextlib.contextmanager
def _sigint_deferred(console: Console) -> Iterator[None]:
    """While the run stops what it started, Ctrl-C only says so: an interrupted stop would leave
    processes behind. The stop is bounded (grace periods, then SIGKILL)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def note(_signum: int, _frame: object) -> None:
        console.print("[yellow]stopping the processes this run started; please wait (this is bounded)")

    previous = signal.signal(signal.SIGINT, note)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _adapter(adapter: AdapterConfig | Mapping[str, Any] | None) -> AdapterConfig:
    if adapter is None:
        return AdapterConfig()
    if isinstance(adapter, AdapterConfig):
        return adapter
    if isinstance(adapter, Mapping):
        try:
            return AdapterConfig(**adapter)
        except ValidationError as error:
            raise ConfigError(f"adapter: {error}") from error
    raise ConfigError(f"adapter: an AdapterConfig or a mapping of its fields, not a {type(adapter).__name__}")


def _hooks(hooks: Hook | Sequence[Hook] | None) -> tuple[Hook, ...]:
    if hooks is None:
        return ()
    if isinstance(hooks, Hook):
        return (hooks,)
    found = tuple(hooks)
    odd = [type(hook).__name__ for hook in found if not isinstance(hook, Hook)]
    if odd:
        raise ConfigError(f"hooks must be agl_stream.Hook instances, got {odd}")
    return found
