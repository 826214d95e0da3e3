"""The runner: claims queued rollouts from the rollout processor and runs an agent for each.

One runner process runs up to ``concurrency`` attempts at once (async agents as tasks on the
event loop, sync agents in threads). For each claimed attempt it:

1. resolves the rollout's resources from a local copy of the compacted ``agl.resources`` topic
   (no request per rollout once the snapshot is known; while it is not, e.g. while none was
   ever published, the copy first reads up to the topic's end);
2. reports the attempt ``running``, runs the agent inside the attempt's tracing context (every
   span made meanwhile is stamped with the rollout, attempt and sequence id and streamed to
   ``agl.spans``), turns the agent's return value into spans (a number is the final reward);
3. flushes the attempt's spans, then reports ``succeeded``, or ``failed`` if the agent raised
   (the exception is recorded as an exception span; retries follow the RolloutConfig).

No attempt is left ``running`` because the cluster failed under it (a broker failing over, a
network error). Marking the attempt running (with its resources lookup), exporting its spans
and reporting its outcome are each tried again with ``RunnerOptions.retry``
(:data:`agl_stream.retry.FAILOVER`: about 30 s of backoff). If marking it running or exporting
its spans still fails (the trace would be incomplete), or the outcome still cannot be sent, or
anything else in the attempt raises, the attempt is *released*: given back for a retry as on
SIGTERM below. A release first asks the processor for the attempt and its rollout (updates
that change nothing, answered with the state): an attempt finished already (the watchdog
closed it, or an outcome whose answer was lost went through) is left alone, and a rollout no
longer running (cancelled) is not requeued. Spans the agent returned that the store refuses
for what they are (``agl_stream.agent.tracing.RECORD_ERRORS``: too large, not convertible) fail the
attempt instead: another try would fail alike.

Every attempt a runner claims ends in exactly one of ``RunnerStats``' outcomes: ``succeeded``,
``failed`` (reported), ``released`` (given back), ``already_closed`` (the store had finished
it: the outcome was refused, or a release found it finished) or ``abandoned`` (not even a
release got through: the watchdog's ``unresponsive_seconds`` is then its only way out; logged
as an error). The counts are in the runner's summary line and
``agl_runner_attempts_total{status}``. Errors are logged with their type and message
(:func:`agl_stream.logs.describe`).

Every ``heartbeat_interval_s`` it writes one heartbeat per live attempt (so the watchdog does
not judge a slow agent unresponsive) and a worker record to ``agl.workers``; on a clean stop its
last worker record says it stopped (``WORKER_STOPPED`` in its heartbeat stats).

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
import socket
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from opentelemetry.context import Context
from opentelemetry.trace import Status, StatusCode, Tracer

from agl_stream import metrics
from agl_stream.agent.command_agent import CommandAgent, OtlpTarget
from agl_stream.agent.emitters import emit_exception, emit_reward, find_final_reward
from agl_stream.agent.litagent import FunctionalLitAgent, Hook, LitAgent
from agl_stream.agent.tracing import RECORD_ERRORS, AttemptTracer
from agl_stream.auth import auth_headers
from agl_stream.config import Settings
from agl_stream.local.processes import stop_on_signals
from agl_stream.logs import describe, get_logger, log_llm_requests
from agl_stream.models import ResourcesUpdate, Span
from agl_stream.models.base import RUNNING_STATUSES
from agl_stream.retry import FAILOVER, ONCE, Backoff, retrying
from agl_stream.store.client import AglStore
from agl_stream.store.readside import read_gateway_file
from agl_stream.store.resources_cache import ResourcesCache
from agl_stream.store.types import AttemptedRollout
from agl_stream.wire.semconv import AGL_ATTEMPT
from agl_stream.wire.spans import span_from_otel

log = get_logger("agl.runner")

SEQUENCE_BLOCK = 1 << 20
"""Sequence ids reserved per attempt for the runner's own spans: an attempt tracing more spans
than this (a million) could share ids with spans other writers add to it."""
Ending = Literal["succeeded", "failed", "released", "already_closed", "abandoned"]
"""How an attempt left the runner (a ``RunnerStats`` counter and a ``agl_runner_attempts_total``
status each): its outcome reported, given back for a retry, found finished by someone else, or
none of these because the cluster could not be reached."""


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
    # How store calls (marking an attempt running, exporting its spans, reporting or releasing
    # it) are tried again while the cluster cannot take them: long enough for a failover.
    retry: Backoff = FAILOVER


@dataclass
class RunnerStats:
    """Attempts claimed, and how each ended (see :data:`Ending`): once every attempt ended,
    ``claimed`` is the sum of the others."""

    claimed: int = 0
    succeeded: int = 0
    failed: int = 0
    released: int = 0
    already_closed: int = 0
    abandoned: int = 0
    claim_failures: int = 0  # claims that failed (no attempt: the cluster failing over) and were made again

    def count(self, ending: Ending) -> None:
        setattr(self, ending, getattr(self, ending) + 1)


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


def gateway_otlp(settings: Settings) -> OtlpTarget | None:
    """The OTLP/HTTP receiver of the stack's gateway (``gateway_url``, else the one this data
    dir's stack runs now), with the API token; None when there is none."""
    url = settings.gateway_url
    if url is None:
        record = read_gateway_file(settings.run_dir)
        url = record.url if record is not None else None
    if url is None:
        return None
    return OtlpTarget(f"{url.rstrip('/')}/v1/traces", auth_headers(settings))


class Runner:
    def __init__(
        self,
        agent: LitAgent[Any],
        settings: Settings,
        options: RunnerOptions | None = None,
        hooks: Sequence[Hook] = (),
        *,
        store: AglStore | None = None,
    ) -> None:
        """``store``: the store client to use (a new one on ``settings`` by default)."""
        self.agent = agent
        self.settings = settings
        self.options = options or RunnerOptions()
        self.hooks = list(hooks)
        self.stats = RunnerStats()
        self.live: dict[tuple[str, str], asyncio.Task[None]] = {}
        self.store = store if store is not None else AglStore(settings)
        self.resources = ResourcesCache(settings)
        self.tracer = AttemptTracer(self.store, export_backoff=self.options.retry)
        if isinstance(agent, CommandAgent) and agent.otlp is None:
            agent.otlp = functools.partial(gateway_otlp, settings)
        agent.set_runner(self)  # the seed's agent.runner / agent.tracer

    # -- the loop --------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> RunnerStats:
        await self.store.start()
        try:
            await self.resources.start()
            await self.tracer.start()
            started = time.time()
            beating = asyncio.create_task(self._beat(started), name="agl-runner-heartbeat")
            try:
                await self._claim_until(stop)
                await self._drain()
            finally:
                beating.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await beating
                await self.tracer.close()
            await self._last_beat(started)
        finally:
            await self.resources.stop()
            await self.store.close()
        log.info("runner stopped", worker=self.options.worker_id, **vars(self.stats))
        return self.stats

    async def _claim_until(self, stop: asyncio.Event) -> None:
        slots = asyncio.Semaphore(self.options.concurrency)
        limit = self.options.max_rollouts
        failures = 0
        while not stop.is_set() and (limit is None or self.stats.claimed < limit):
            if not await _acquire_unless(slots, stop):
                break
            # A long poll: the processor holds the claim up to a second until work arrives.
            try:
                claimed = await self.store.dequeue_rollout(worker_id=self.options.worker_id, wait=1.0)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the cluster failing over, a processor catching up: claim again
                slots.release()
                failures += 1
                delay = self.options.retry.after(failures)
                self.stats.claim_failures += 1
                log.warning("claim failed; claiming again", error=describe(error), retry_in_s=delay, failures=failures)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)  # the backoff, cut short by a stop
                continue
            failures = 0
            if claimed is None:
                slots.release()
                continue
            self.stats.claimed += 1
            key = (claimed.rollout_id, claimed.attempt.attempt_id)
            task = asyncio.create_task(self._attempt(claimed), name=f"attempt-{key[1]}")
            self.live[key] = task
            task.add_done_callback(functools.partial(self._ended, key, slots))

    @functools.cached_property
    def _root_tracer(self) -> Tracer:
        """What opens attempts' root spans (the tracer's provider: known once it started)."""
        return self.tracer.tracer_provider.get_tracer("agl_stream.runner")

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

    def _heartbeat_stats(self, started: float) -> dict[str, Any]:
        return {"live_attempts": len(self.live), "uptime_s": round(time.time() - started, 1)}

    async def _beat(self, started: float) -> None:
        while True:
            try:
                await self.store.beat(
                    list(self.live), worker_id=self.options.worker_id, heartbeat_stats=self._heartbeat_stats(started)
                )
            except asyncio.CancelledError:
                raise
            except Exception as error:  # a missed beat is retried next interval; the watchdog is lenient
                log.warning("heartbeat failed", error=describe(error))
            await asyncio.sleep(self.options.heartbeat_interval_s)  # the heartbeat's period, not a wait on state

    async def _last_beat(self, started: float) -> None:
        """A clean stop: the worker's last record says it stopped (the dashboard shows it gone)."""
        try:
            await self.store.last_beat(self.options.worker_id, self._heartbeat_stats(started))
        except Exception as error:  # bookkeeping: the dashboard shows it gone once its heartbeat is old
            log.warning("could not record the worker as stopped", error=describe(error))

    # -- one attempt -----------------------------------------------------------------------

    async def _attempt(self, rollout: AttemptedRollout) -> None:
        rid, aid = rollout.rollout_id, rollout.attempt.attempt_id
        try:
            ending = await self._run_attempt(rollout)
        except asyncio.CancelledError:
            # Shielded, counting included: a second cancel must not strand the attempt.
            await asyncio.shield(self._end(self._release(rollout, "the runner is stopping", ONCE)))
            raise
        except Exception as error:  # a bug of the runner's own: the attempt must still end
            log.exception("attempt broke off", rollout=rid, attempt=aid, error=describe(error))
            ending = await self._release(rollout, f"the runner failed: {describe(error)}")
        self._count(ending)

    async def _end(self, ending: Awaitable[Ending]) -> None:
        self._count(await ending)

    def _count(self, ending: Ending) -> None:
        self.stats.count(ending)
        metrics.RUNNER_ATTEMPTS.labels(metrics.role(), ending).inc()

    async def _run_attempt(self, rollout: AttemptedRollout) -> Ending:
        rid, aid = rollout.rollout_id, rollout.attempt.attempt_id
        await self._hooks("on_rollout_start", agent=self.agent, runner=self, rollout=rollout)
        try:
            snapshot, first_id = await retrying(
                lambda: self._start(rollout),
                backoff=self.options.retry,
                what="starting the attempt",
                final=(ValueError,),
                rollout=rid,
                attempt=aid,
            )
        except Exception as error:
            return await self._release(rollout, f"it could not be marked running: {describe(error)}")
        version = snapshot.policy_version if snapshot is not None else None
        status: Literal["succeeded", "failed"] = "succeeded"
        returned: list[Any] = []
        try:
            async with self.tracer.attempt(rid, aid, first_sequence_id=first_id, policy_version=version) as trace:
                # The attempt's root (a new trace whatever the caller's context): every span
                # made inside, and the LLM proxy's spans of calls carrying its traceparent, nest
                # under it. It ends before the block flushes, so it is exported with the rest.
                with self._root_tracer.start_as_current_span(
                    AGL_ATTEMPT, context=Context(), record_exception=False, set_status_on_exception=False
                ) as root:
                    await self._hooks(
                        "on_trace_start", agent=self.agent, runner=self, tracer=self.tracer, rollout=rollout
                    )
                    try:
                        result = await self._call_agent(rollout, snapshot)
                        check_result(result)
                        if _is_number(result):
                            emit_reward(float(result))
                        elif isinstance(result, list):
                            returned = result
                    except Exception as error:
                        status = "failed"
                        log.info("agent raised", rollout=rid, attempt=aid, error=describe(error))
                        emit_exception(error)
                        root.set_status(Status(StatusCode.ERROR, describe(error)))
                    await self._hooks(
                        "on_trace_end", agent=self.agent, runner=self, tracer=self.tracer, rollout=rollout
                    )
            # Leaving the block flushed the trace, each batch with the retries of options.retry.
            if trace.export_error is not None:
                return await self._release(rollout, f"its spans could not be exported: {trace.export_error}")
            spans = list(trace.spans)
            try:
                spans += await retrying(
                    lambda: self._export_returned(rollout, returned, trace.next_sequence_id),
                    backoff=self.options.retry,
                    what="exporting returned spans",
                    final=RECORD_ERRORS,
                    rollout=rid,
                    attempt=aid,
                )
            except RECORD_ERRORS as error:  # the agent's output, not the cluster: another try would fail alike
                status = "failed"
                log.warning(
                    "the spans the agent returned cannot be stored", rollout=rid, attempt=aid, error=describe(error)
                )
        except Exception as error:
            return await self._release(rollout, f"its spans could not be exported: {describe(error)}")
        await self._hooks("on_rollout_end", agent=self.agent, runner=self, rollout=rollout, spans=spans)
        log.debug("attempt done", rollout=rid, attempt=aid, spans=len(spans), reward=_final_reward(spans))
        return await self._report(rollout, status)

    async def _start(self, rollout: AttemptedRollout) -> tuple[ResourcesUpdate | None, int]:
        """The resources the attempt runs with, and the first of its sequence ids, once it is running."""
        rid, aid = rollout.rollout_id, rollout.attempt.attempt_id
        pinned = rollout.resources_id if self.options.resources == "pinned" else None
        snapshot = await self.resources.get(pinned)
        # The snapshot the attempt runs with is recorded on it: with resources="latest" (or a
        # rollout without resources) it is whatever is latest now, and training must know which
        # policy that was.
        metadata: dict[str, Any] | None = None
        if snapshot is not None:
            metadata = {"resources_id": snapshot.resources_id, "policy_version": snapshot.policy_version}
        # The tracer numbers this attempt's spans inside a reserved block, so spans other writers
        # add meanwhile (the LLM proxy, OTLP clients) take ids after it and never collide.
        _, first_id = await self.store.start_running(rid, aid, reserve_sequence_ids=SEQUENCE_BLOCK, metadata=metadata)
        return snapshot, first_id

    async def _report(self, rollout: AttemptedRollout, status: Literal["succeeded", "failed"]) -> Ending:
        """The attempt's outcome, sent again while the cluster cannot take it (a broker failing
        over): an attempt left running would hold its rollout until a timeout it may not have.
        A refusal (ValueError: e.g. the watchdog closed the attempt) is final; an outcome that
        cannot be sent at all ends in a release."""
        rid, aid = rollout.rollout_id, rollout.attempt.attempt_id
        try:
            await retrying(
                lambda: self.store.update_attempt(rid, aid, status=status),
                backoff=self.options.retry,
                what="reporting the attempt",
                final=(ValueError,),
                rollout=rid,
                attempt=aid,
            )
        except ValueError as error:
            log.warning(
                "the attempt's outcome was refused", rollout=rid, attempt=aid, status=status, error=describe(error)
            )
            return "already_closed"
        except Exception as error:
            return await self._release(rollout, f"its outcome ({status}) could not be reported: {describe(error)}")
        return status

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

    async def _release(self, rollout: AttemptedRollout, reason: str, backoff: Backoff | None = None) -> Ending:
        """Give an unfinished attempt back: the rollout is requeued, the attempt recorded failed.

        The processor is asked first (updates that change nothing, answered with the state): an
        attempt finished already (the watchdog closed it; an outcome whose answer was lost went
        through) is left as it is, and a rollout that is not running (cancelled meanwhile) is not
        requeued, only the attempt recorded failed.
        """
        rid, aid = rollout.rollout_id, rollout.attempt.attempt_id
        backoff = backoff or self.options.retry
        log.warning("releasing the attempt for a retry", rollout=rid, attempt=aid, reason=reason)
        try:
            ended = await retrying(
                lambda: self._give_back(rid, aid),
                backoff=backoff,
                what="releasing the attempt",
                final=(ValueError,),
                rollout=rid,
                attempt=aid,
            )
        except ValueError as error:  # e.g. the processor forgot the rollout: it finished long ago
            log.info("the attempt to release was finished already", rollout=rid, attempt=aid, error=describe(error))
            return "already_closed"
        except Exception as error:
            log.error(
                "attempt abandoned: it could be neither reported nor released; only the watchdog "
                "(the rollout's unresponsive_seconds) can end it now",
                rollout=rid,
                attempt=aid,
                reason=reason,
                error=describe(error),
            )
            return "abandoned"
        if ended is not None:
            log.info("the attempt to release was finished already", rollout=rid, attempt=aid, status=ended)
            return "already_closed"
        log.info("attempt released for a retry", rollout=rid, attempt=aid)
        return "released"

    async def _give_back(self, rid: str, aid: str) -> str | None:
        """Release the attempt unless it finished already: then its status (nothing was changed)."""
        attempt = await self.store.update_attempt(rid, aid)
        if attempt.status not in RUNNING_STATUSES:
            return attempt.status
        current = await self.store.update_rollout(rid)
        if current.status in RUNNING_STATUSES:  # still this attempt's: it alone turns it running
            await self.store.update_rollout(rid, status="requeuing")
        await self.store.update_attempt(rid, aid, status="failed")
        return None

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
    with stop_on_signals(stop.set):
        return await Runner(agent, settings, options, hooks).run(stop)


def main(settings: Settings, agent: str | LitAgent[Any], options: RunnerOptions, hooks: Sequence[Hook] = ()) -> None:
    """Run ``agent`` (a LitAgent, or its ``pkg.module:name``) with ``hooks`` until SIGTERM/SIGINT."""
    if isinstance(agent, str):
        agent = load_agent(agent)
    log_llm_requests()
    stats = asyncio.run(run_runner(agent, settings, options, hooks))
    print(
        f"runner {options.worker_id}: claimed {stats.claimed}, succeeded {stats.succeeded}, "
        f"failed {stats.failed}, released {stats.released}, already closed {stats.already_closed}, "
        f"abandoned {stats.abandoned}, claims failed and made again {stats.claim_failures}",
        flush=True,
    )
    # A sync agent still running in a thread after the grace period would hold the interpreter
    # open; its attempt was released, so leave without waiting for it.
    os._exit(0)
