"""The runner: claims queued rollouts from the rollout processor and runs an agent for each.

One runner process runs up to ``concurrency`` attempts at once (async agents as tasks on the
event loop, sync agents in threads). For each claimed attempt it:

1. resolves the rollout's resources from a local copy of the compacted ``agl.resources`` topic
   (no request per rollout);
2. reports the attempt ``running``, runs the agent inside the attempt's tracing context (every
   span made meanwhile is stamped with the rollout, attempt and sequence id and streamed to
   ``agl.spans``), turns the agent's return value into spans (a number is the final reward);
3. flushes the attempt's spans, then reports ``succeeded``, or ``failed`` if the agent raised
   (the exception is recorded as an exception span; retries follow the RolloutConfig).

Every ``heartbeat_interval_s`` it writes one heartbeat per live attempt (so the watchdog does
not judge a slow agent unresponsive) and a worker record to ``agl.workers``.

SIGTERM/SIGINT: stop claiming, let live attempts finish for ``grace_s``, then release the rest:
the rollout goes back to the queue (``requeuing``) and the attempt is recorded ``failed``, so
the rollout is retried whatever its RolloutConfig says (the runner, not the agent, gave up).
A runner killed outright is the watchdog's business (``unresponsive_seconds``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import os
import pickle
import signal
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from agl_stream import metrics
from agl_stream.config import Settings
from agl_stream.emitters import emit_exception, emit_reward, find_final_reward
from agl_stream.litagent import FunctionalLitAgent, Hook, LitAgent
from agl_stream.logs import get_logger, log_llm_requests
from agl_stream.models import ResourcesUpdate, Span
from agl_stream.models.base import AttemptStatus
from agl_stream.spans import span_from_otel
from agl_stream.store.client import AglStore
from agl_stream.store.resources_cache import ResourcesCache
from agl_stream.store.types import AttemptedRollout
from agl_stream.tracing import AttemptTracer

log = get_logger("agl.runner")

SEQUENCE_BLOCK = 1 << 20
"""Sequence ids reserved per attempt for the runner's own spans: an attempt tracing more spans
than this (a million) could share ids with spans other writers add to it."""
REPORT_TRIES = 6
"""Sends of an attempt's outcome before the runner gives up on it (backoff 1 s doubling to 15 s)."""


@dataclass
class RunnerOptions:
    concurrency: int = 4
    grace_s: float = 30.0
    heartbeat_interval_s: float = 5.0
    worker_id: str = field(default_factory=lambda: f"runner-{socket.gethostname()}-{os.getpid()}")
    max_rollouts: int | None = None  # stop claiming after this many (tests, scripted runs)
    # "pinned": the resources the rollout names (pinned at enqueue, as the seed's runner does);
    # "latest": the latest at claim time, whatever it names: streaming RL, where every attempt
    # should run the newest policy (the version it ran with is recorded on the attempt).
    resources: Literal["pinned", "latest"] = "pinned"


@dataclass
class RunnerStats:
    claimed: int = 0
    succeeded: int = 0
    failed: int = 0
    released: int = 0


def load_agent(spec: str) -> LitAgent[Any]:
    """``pkg.module:name`` -> the agent (a LitAgent instance, a LitAgent subclass, or a function)."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"--agent wants 'pkg.module:name', got {spec!r}")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"cannot import {module_name!r} for --agent {spec}: {error}") from error
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ValueError(f"{module_name} has no attribute {attribute!r} (--agent {spec})")
        target = getattr(target, part)
    if isinstance(target, LitAgent):
        return target
    if isinstance(target, type) and issubclass(target, LitAgent):
        return target()
    if callable(target):
        return FunctionalLitAgent(target)
    raise ValueError(f"--agent {spec} is a {type(target).__name__}, not a LitAgent, LitAgent class or function")


AGENT_FILE_FORMAT = 1
"""The layout of an agent file (``agl-stream runner --agent-file``), written by the Trainer
(:mod:`agl_stream.trainer.shipping`): a pickled dict ``{"format": 1, "agent": LitAgent | None,
"agent_spec": "pkg.module:name" | None, "hooks": [Hook, ...]}``."""


def load_agent_file(path: Path) -> tuple[LitAgent[Any], list[Hook]]:
    """The agent and runner hooks a Trainer wrote to ``path`` (ValueError says what is wrong).

    Unpickling runs code named by the file, so a runner loads only the file its command line
    names: one its own user's Trainer wrote (0600, in the data dir).
    """
    try:
        with open(path, "rb") as file:
            payload = pickle.load(file)
    except OSError as error:
        raise ValueError(f"cannot read the agent file {path}: {error}") from error
    except Exception as error:  # unpickling imports modules and calls constructors: anything may fail
        raise ValueError(
            f"cannot load the agent from {path}: {type(error).__name__}: {error} (the runner imports what the "
            "agent's code imports: run it from the same project and virtualenv as the Trainer)"
        ) from error
    if not isinstance(payload, dict) or payload.get("format") != AGENT_FILE_FORMAT:
        raise ValueError(f"{path} is not an agent file of format {AGENT_FILE_FORMAT}")
    hooks = list(payload.get("hooks") or [])
    odd = [type(hook).__name__ for hook in hooks if not isinstance(hook, Hook)]
    if odd:
        raise ValueError(f"{path}: hooks must be agl_stream.Hook instances, got {odd}")
    agent = payload.get("agent")
    if agent is None:
        spec = payload.get("agent_spec")
        if not isinstance(spec, str):
            raise ValueError(f"{path} names no agent")
        return load_agent(spec), hooks
    if not isinstance(agent, LitAgent):
        raise ValueError(f"{path} holds a {type(agent).__name__}, not a LitAgent")
    return agent, hooks


def _final_reward(spans: list[Span]) -> float | str | None:
    try:
        return find_final_reward(spans)
    except ValueError as error:  # a malformed reward span is the agent's bug, not the attempt's end
        return f"unreadable: {error}"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_result(result: Any) -> None:
    """Refuse return values the runner cannot turn into spans (TypeError says what is allowed)."""
    if result is None or _is_number(result):
        return
    if isinstance(result, list):
        from opentelemetry.sdk.trace import ReadableSpan

        odd = [type(item).__name__ for item in result if not isinstance(item, (Span, ReadableSpan))]
        if not odd:
            return
        raise TypeError(f"an agent may return a list of spans (agl Span or ReadableSpan), got items of {odd[:5]}")
    raise TypeError(
        f"an agent returns None, a number (the final reward) or a list of spans, not {type(result).__name__}"
    )


class Runner:
    def __init__(
        self,
        agent: LitAgent[Any],
        settings: Settings,
        options: RunnerOptions | None = None,
        hooks: Sequence[Hook] = (),
    ) -> None:
        self.agent = agent
        self.settings = settings
        self.options = options or RunnerOptions()
        self.hooks = list(hooks)
        self.stats = RunnerStats()
        self.live: dict[tuple[str, str], asyncio.Task[None]] = {}
        self.store = AglStore(settings)
        self.resources = ResourcesCache(settings)
        self.tracer = AttemptTracer(self.store)
        agent.set_runner(self)  # the seed's agent.runner / agent.tracer

    # -- the loop --------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> RunnerStats:
        await self.store.start()
        try:
            await self.resources.start()
            await self.tracer.start()
            beating = asyncio.create_task(self._beat(stop), name="agl-runner-heartbeat")
            try:
                await self._claim_until(stop)
                await self._drain()
            finally:
                beating.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await beating
                await self.tracer.close()
        finally:
            await self.resources.stop()
            await self.store.close()
        log.info("runner stopped", worker=self.options.worker_id, **vars(self.stats))
        return self.stats

    async def _claim_until(self, stop: asyncio.Event) -> None:
        slots = asyncio.Semaphore(self.options.concurrency)
        limit = self.options.max_rollouts
        while not stop.is_set() and (limit is None or self.stats.claimed < limit):
            if not await _acquire_unless(slots, stop):
                break
            # A long poll: the processor holds the claim up to a second until work arrives.
            claimed = await self.store.dequeue_rollout(worker_id=self.options.worker_id, wait=1.0)
            if claimed is None:
                slots.release()
                continue
            self.stats.claimed += 1
            key = (claimed.rollout_id, claimed.attempt.attempt_id)
            task = asyncio.create_task(self._attempt(claimed), name=f"attempt-{key[1]}")
            self.live[key] = task
            task.add_done_callback(functools.partial(self._ended, key, slots))

    def _ended(self, key: tuple[str, str], slots: asyncio.Semaphore, _task: asyncio.Task[None]) -> None:
        self.live.pop(key, None)
        slots.release()

    async def _drain(self) -> None:
        """Let live attempts finish within the grace period; release the rest for a retry."""
        if not self.live:
            return
        log.info("finishing live attempts", count=len(self.live), grace_s=self.options.grace_s)
        _, pending = await asyncio.wait(list(self.live.values()), timeout=self.options.grace_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    async def _beat(self, stop: asyncio.Event) -> None:
        started = time.time()
        while True:
            try:
                await self.store.beat(
                    list(self.live),
                    worker_id=self.options.worker_id,
                    heartbeat_stats={"live_attempts": len(self.live), "uptime_s": round(time.time() - started, 1)},
                )
            except asyncio.CancelledError:
                raise
            except Exception as error:  # a missed beat is retried next interval; the watchdog is lenient
                log.warning("heartbeat failed", error=str(error))
            await asyncio.sleep(self.options.heartbeat_interval_s)  # the heartbeat's period, not a wait on state

    # -- one attempt -----------------------------------------------------------------------

    async def _attempt(self, rollout: AttemptedRollout) -> None:
        rid, aid = rollout.rollout_id, rollout.attempt.attempt_id
        try:
            status = await self._run_attempt(rollout)
        except asyncio.CancelledError:
            await asyncio.shield(self._release(rollout))
            raise
        except Exception as error:  # the store refused a report (e.g. the watchdog closed the attempt)
            log.warning("attempt could not be reported", rollout=rid, attempt=aid, error=str(error))
            return
        if status == "succeeded":
            self.stats.succeeded += 1
        else:
            self.stats.failed += 1
        metrics.RUNNER_ATTEMPTS.labels(metrics.role(), status).inc()

    async def _run_attempt(self, rollout: AttemptedRollout) -> AttemptStatus:
        rid, aid = rollout.rollout_id, rollout.attempt.attempt_id
        await self._hooks("on_rollout_start", agent=self.agent, runner=self, rollout=rollout)
        # The tracer numbers this attempt's spans inside a reserved block, so spans other writers
        # add meanwhile (the LLM proxy, OTLP clients) take ids after it and never collide.
        pinned = rollout.resources_id if self.options.resources == "pinned" else None
        snapshot = await self.resources.get(pinned)
        # The snapshot the attempt runs with is recorded on it: with resources="latest" (or a
        # rollout without resources) it is whatever is latest now, and training must know which
        # policy that was.
        version = snapshot.policy_version if snapshot is not None else None
        metadata: dict[str, Any] | None = None
        if snapshot is not None:
            metadata = {"resources_id": snapshot.resources_id, "policy_version": version}
        _, first_id = await self.store.start_running(rid, aid, reserve_sequence_ids=SEQUENCE_BLOCK, metadata=metadata)
        status: AttemptStatus = "succeeded"
        returned: list[Any] = []
        async with self.tracer.attempt(rid, aid, first_sequence_id=first_id, policy_version=version) as trace:
            await self._hooks("on_trace_start", agent=self.agent, runner=self, tracer=self.tracer, rollout=rollout)
            try:
                result = await self._call_agent(rollout, snapshot)
                check_result(result)
                if _is_number(result):
                    emit_reward(float(result))
                elif isinstance(result, list):
                    returned = result
            except Exception as error:
                status = "failed"
                log.info("agent raised", rollout=rid, attempt=aid, error=repr(error))
                emit_exception(error)
            await self._hooks("on_trace_end", agent=self.agent, runner=self, tracer=self.tracer, rollout=rollout)
        spans = list(trace.spans) + await self._export_returned(rollout, returned, trace.next_sequence_id)
        await self._hooks("on_rollout_end", agent=self.agent, runner=self, rollout=rollout, spans=spans)
        log.debug("attempt done", rollout=rid, attempt=aid, spans=len(spans), reward=_final_reward(spans))
        await self._report(rid, aid, status)
        return status

    async def _report(self, rid: str, aid: str, status: AttemptStatus) -> None:
        """The attempt's outcome, sent again while the cluster cannot take it (a broker failing
        over): an attempt left running would hold its rollout until a timeout it may not have.
        A refusal (ValueError: e.g. the watchdog closed the attempt) is final."""
        delay = 1.0
        for tries_left in range(REPORT_TRIES - 1, -1, -1):
            try:
                await self.store.update_attempt(rid, aid, status=status)
                return
            except ValueError:
                raise
            except Exception as error:
                if tries_left == 0:
                    raise
                log.warning("reporting the attempt failed; trying again", rollout=rid, attempt=aid, error=repr(error))
                await asyncio.sleep(delay)  # backoff while the cluster recovers
                delay = min(delay * 2, 15.0)

    async def _call_agent(self, rollout: AttemptedRollout, snapshot: ResourcesUpdate | None) -> Any:
        if snapshot is None and rollout.resources_id is not None:
            raise LookupError(f"resources {rollout.resources_id} of rollout {rollout.rollout_id} were never published")
        resources = dict(snapshot.resources) if snapshot is not None else {}
        train = rollout.mode == "train"
        if self.agent.is_async():
            method = self.agent.training_rollout_async if train else self.agent.validation_rollout_async
            return await method(rollout.input, resources, rollout)
        sync = self.agent.training_rollout if train else self.agent.validation_rollout
        # In a thread, so concurrent attempts overlap; to_thread copies the tracing context.
        return await asyncio.to_thread(sync, rollout.input, resources, rollout)

    async def _export_returned(self, rollout: AttemptedRollout, returned: list[Any], next_id: int) -> list[Span]:
        """Spans the agent returned: agl Spans as they are, OTel spans numbered after the traced ones."""
        if not returned:
            return []
        aid = rollout.attempt.attempt_id
        spans = [
            item if isinstance(item, Span) else span_from_otel(item, rollout.rollout_id, aid, next_id + index)
            for index, item in enumerate(returned)
        ]
        await self.store.export_spans(spans)
        return spans

    async def _release(self, rollout: AttemptedRollout) -> None:
        """Give an unfinished attempt back: the rollout is requeued, the attempt recorded failed."""
        rid, aid = rollout.rollout_id, rollout.attempt.attempt_id
        try:
            await self.store.update_rollout(rid, status="requeuing")
            await self.store.update_attempt(rid, aid, status="failed")
            self.stats.released += 1
            log.info("attempt released for a retry", rollout=rid, attempt=aid)
        except Exception as error:  # e.g. it finished meanwhile: nothing to give back
            log.warning("could not release attempt", rollout=rid, attempt=aid, error=str(error))

    async def _hooks(self, name: str, **arguments: Any) -> None:
        for hook in self.hooks:
            try:
                await getattr(hook, name)(**arguments)
            except Exception:
                log.exception("hook failed", hook=type(hook).__name__, stage=name)
        agent_hook = {"on_rollout_start": self.agent.on_rollout_start, "on_rollout_end": self.agent.on_rollout_end}
        if name in agent_hook:
            rollout = arguments["rollout"]
            try:
                if name == "on_rollout_start":
                    self.agent.on_rollout_start(rollout.input, rollout)
                else:
                    self.agent.on_rollout_end(rollout.input, rollout, arguments["spans"])
            except Exception:
                log.exception("agent hook failed", stage=name)


async def _acquire_unless(slots: asyncio.Semaphore, stop: asyncio.Event) -> bool:
    """Take a slot, or give up when ``stop`` is set first (all slots busy must not delay a stop)."""
    if not slots.locked():
        await slots.acquire()
        return not _give_back_if(stop, slots)
    acquiring = asyncio.ensure_future(slots.acquire())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({acquiring, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not acquiring.done():
        acquiring.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await acquiring
        return False
    return not _give_back_if(stop, slots)


def _give_back_if(stop: asyncio.Event, slots: asyncio.Semaphore) -> bool:
    if stop.is_set():
        slots.release()
        return True
    return False


async def run_runner(
    agent: LitAgent[Any], settings: Settings, options: RunnerOptions, hooks: Sequence[Hook] = ()
) -> RunnerStats:
    """Run until SIGTERM/SIGINT (or ``max_rollouts``), then drain and stop."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        return await Runner(agent, settings, options, hooks).run(stop)
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)


def main(settings: Settings, agent: str | LitAgent[Any], options: RunnerOptions, hooks: Sequence[Hook] = ()) -> None:
    """Run ``agent`` (a LitAgent, or its ``pkg.module:name``) with ``hooks`` until SIGTERM/SIGINT."""
    if isinstance(agent, str):
        agent = load_agent(agent)
    log_llm_requests()
    stats = asyncio.run(run_runner(agent, settings, options, hooks))
    print(
        f"runner {options.worker_id}: claimed {stats.claimed}, succeeded {stats.succeeded}, "
        f"failed {stats.failed}, released {stats.released}",
        flush=True,
    )
    # A sync agent still running in a thread after the grace period would hold the interpreter
    # open; its attempt was released, so leave without waiting for it.
    os._exit(0)
