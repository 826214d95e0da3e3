"""The runner when the store fails under an attempt (a broker failing over): the attempt always ends.

A stand-in for the store client (the processor's answers, in memory) fails chosen calls with
the errors a failover brings, ``TimeoutError()`` among them (its message is empty). The
runner is the real one, with its real tracer over the stand-in, and short retry waits. At the
end: the trace an attempt makes (one root span around the agent).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator, Sequence
from typing import Any, cast

from opentelemetry import trace

from agl_stream.agent.litagent import FunctionalLitAgent
from agl_stream.config import Settings
from agl_stream.models import Attempt, Rollout, Span
from agl_stream.models.base import AttemptStatus, RolloutStatus
from agl_stream.retry import Backoff
from agl_stream.store.client import AglStore
from agl_stream.store.resources_cache import ResourcesCache
from agl_stream.store.types import UNSET, AttemptedRollout, Unset
from agl_stream.wire.semconv import AGL_ATTEMPT
from consumers.runner import Runner, RunnerOptions, RunnerStats

TIMEOUT = 60.0  # generous: the machine may be busy
FAST = Backoff(tries=4, first_s=0.01, max_s=0.02)

Faults = Iterator[Exception]


def times(count: int) -> Faults:
    """A timeout, ``count`` times: what ``asyncio.wait_for`` raises, with an empty message."""
    return (TimeoutError() for _ in range(count))


def always() -> Faults:
    return (TimeoutError() for _ in itertools.count())


class FlakyStore:
    """The store calls a runner makes, answered in memory as the processor would; ``faults``
    maps a call (``export_spans``, ``start_running``, ``update_rollout``, ``update_attempt:<status>``
    with ``-`` for no status) to the errors its next calls raise."""

    def __init__(self, faults: dict[str, Faults]) -> None:
        self.faults = faults
        self.calls: list[str] = []
        self.rollout = Rollout(rollout_id="ro-1", input={"x": 1}, start_time=time.time())
        self.attempt = Attempt(rollout_id="ro-1", attempt_id="at-1", sequence_id=1, start_time=time.time())
        self.claimed = False
        self.spans: list[Span] = []

    def _call(self, name: str) -> None:
        self.calls.append(name)
        error = next(self.faults.get(name, iter(())), None)
        if error is not None:
            raise error

    def _set_status(self, status: RolloutStatus) -> None:
        self.rollout = self.rollout.model_copy(update={"status": status})

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def beat(self, attempts: Sequence[tuple[str, str]], **_: Any) -> None:
        pass

    async def dequeue_rollout(self, worker_id: str | None = None, *, wait: float = 0.0) -> AttemptedRollout | None:
        if self.claimed:
            await asyncio.sleep(wait)  # the processor's long poll, with nothing to hand out
            return None
        self._call("dequeue_rollout")
        self.claimed = True
        self.attempt = self.attempt.model_copy(update={"worker_id": worker_id})
        self._set_status("preparing")
        return AttemptedRollout(**self.rollout.model_dump(), attempt=self.attempt)

    async def start_running(
        self, rollout_id: str, attempt_id: str, *, reserve_sequence_ids: int, metadata: Any = UNSET
    ) -> tuple[Attempt, int]:
        self._call("start_running")
        self.attempt = self.attempt.model_copy(update={"status": "running"})
        self._set_status("running")
        return self.attempt, 1

    async def export_spans(self, spans: Sequence[Span]) -> None:
        # The tracer's flushes (which hold the attempt's root span) and the agent's returned spans.
        returned = all(span.name == RETURNED for span in spans)
        self._call("export_returned" if returned else "export_spans")
        self.spans += spans

    async def update_attempt(
        self, rollout_id: str, attempt_id: str, status: AttemptStatus | Unset = UNSET, **_: Any
    ) -> Attempt:
        self._call(f"update_attempt:{'-' if isinstance(status, Unset) else status}")
        if not isinstance(status, Unset) and status != self.attempt.status:
            self.attempt = self.attempt.model_copy(update={"status": status})
            if status == "succeeded":
                self._set_status("succeeded")
            elif self.rollout.status in ("preparing", "running"):
                self._set_status("failed")  # the default config: no retry
        return self.attempt

    async def update_rollout(self, rollout_id: str, status: RolloutStatus | Unset = UNSET, **_: Any) -> Rollout:
        self._call("update_rollout")
        if not isinstance(status, Unset):
            self._set_status(status)
        return self.rollout


class NoResources:
    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def get(self, resources_id: str | None) -> None:
        return None


async def reward(task: Any) -> float:
    return 0.5


RETURNED = "returned"


async def returns_a_span(task: Any) -> list[Span]:
    return [
        Span(rollout_id="ro-1", attempt_id="at-1", sequence_id=1, trace_id="0" * 32, span_id="1" * 16, name=RETURNED)
    ]


async def run_one(store: FlakyStore, agent: Any = reward) -> RunnerStats:
    """One rollout through a real runner over ``store``; the runner's stats once it stopped."""
    options = RunnerOptions(concurrency=1, max_rollouts=1, grace_s=TIMEOUT, heartbeat_interval_s=3600, retry=FAST)
    runner = Runner(FunctionalLitAgent(agent), Settings(), options, store=cast(AglStore, store))
    runner.resources = cast(ResourcesCache, NoResources())
    stats = await asyncio.wait_for(runner.run(asyncio.Event()), TIMEOUT)
    ended = stats.succeeded + stats.failed + stats.released + stats.already_closed + stats.abandoned
    assert stats.claimed == ended == 1, stats
    return stats


def _status(store: FlakyStore) -> tuple[str, str]:
    return store.rollout.status, store.attempt.status


async def test_a_span_flush_failing_during_a_failover_is_retried_and_the_attempt_succeeds() -> None:
    store = FlakyStore({"export_spans": times(2)})
    stats = await run_one(store)
    assert stats.succeeded == 1
    assert _status(store) == ("succeeded", "succeeded")
    assert store.calls.count("export_spans") == 3
    # The reward, then the attempt's root (it ends last), both in the flush that was retried.
    assert [span.name for span in store.spans] == ["agentlightning.annotation", AGL_ATTEMPT]


async def test_a_span_flush_that_never_gets_through_releases_the_attempt() -> None:
    store = FlakyStore({"export_spans": always()})
    stats = await run_one(store)
    assert stats.released == 1
    assert _status(store) == ("requeuing", "failed")  # requeued whatever the rollout's config says
    assert "update_attempt:succeeded" not in store.calls  # an incomplete trace is not reported
    assert store.calls.count("export_spans") == FAST.tries


async def test_a_claim_failing_during_a_failover_is_made_again_and_the_runner_keeps_running() -> None:
    store = FlakyStore({"dequeue_rollout": times(3)})
    stats = await run_one(store)
    assert stats.claim_failures == 3 and stats.succeeded == 1
    assert _status(store) == ("succeeded", "succeeded")


async def test_marking_the_attempt_running_is_retried() -> None:
    store = FlakyStore({"start_running": times(2)})
    stats = await run_one(store)
    assert stats.succeeded == 1 and _status(store) == ("succeeded", "succeeded")


async def test_an_attempt_that_cannot_be_marked_running_is_released() -> None:
    store = FlakyStore({"start_running": always()})
    stats = await run_one(store)
    assert stats.released == 1 and _status(store) == ("requeuing", "failed")
    assert "export_spans" not in store.calls  # the agent never ran


async def test_an_outcome_that_cannot_be_reported_releases_the_attempt() -> None:
    store = FlakyStore({"update_attempt:succeeded": always()})
    stats = await run_one(store)
    assert stats.released == 1 and _status(store) == ("requeuing", "failed")
    assert store.calls.count("update_attempt:succeeded") == FAST.tries


async def test_a_release_leaves_an_attempt_that_finished_meanwhile_alone() -> None:
    # The outcome went through though no answer said so: the release finds the attempt finished.
    store = FlakyStore({})
    refused = always()

    def lost_answer() -> Iterator[Exception]:
        for error in refused:
            store.attempt = store.attempt.model_copy(update={"status": "succeeded"})
            store._set_status("succeeded")
            yield error

    store.faults["update_attempt:succeeded"] = lost_answer()
    stats = await run_one(store)
    assert stats.already_closed == 1 and _status(store) == ("succeeded", "succeeded")
    assert "update_rollout" not in store.calls and "update_attempt:failed" not in store.calls


async def test_a_refused_outcome_is_counted() -> None:
    store = FlakyStore({"update_attempt:succeeded": iter([ValueError("unknown rollout id ro-1")])})
    stats = await run_one(store)
    assert stats.already_closed == 1
    assert store.calls.count("update_attempt:succeeded") == 1  # a refusal is not retried


async def test_an_attempt_neither_reported_nor_released_is_counted_abandoned() -> None:
    faults = {name: always() for name in ("update_attempt:succeeded", "update_attempt:-", "update_rollout")}
    store = FlakyStore(faults)
    stats = await run_one(store)
    assert stats.abandoned == 1
    assert _status(store) == ("running", "running")  # the watchdog's business now


async def test_returned_spans_are_exported_with_retries() -> None:
    store = FlakyStore({"export_returned": times(2)})
    stats = await run_one(store, returns_a_span)
    assert stats.succeeded == 1 and [span.name for span in store.spans] == [AGL_ATTEMPT, RETURNED]
    assert store.calls.count("export_returned") == 3


async def test_returned_spans_the_store_cannot_take_fail_the_attempt() -> None:
    # The agent's output, not the cluster: not retried, and not released (a retry would fail alike).
    store = FlakyStore({"export_returned": iter([ValueError("a span over the size limit")])})
    stats = await run_one(store, returns_a_span)
    assert stats.failed == 1 and _status(store) == ("failed", "failed")
    assert store.calls.count("export_returned") == 1


# -- the attempt's trace ---------------------------------------------------------------------


async def steps_and_rewards(task: Any) -> float:
    with trace.get_tracer("tests.runner").start_as_current_span("step"):
        with trace.get_tracer("tests.runner").start_as_current_span("tool"):
            pass
    return 0.5


async def test_an_attempt_is_one_trace_under_its_root_span() -> None:
    store = FlakyStore({})
    stats = await run_one(store, steps_and_rewards)
    assert stats.succeeded == 1
    tool, step, reward_span, root = store.spans  # in the order they ended: the root last
    assert (root.name, root.parent_id, root.sequence_id) == (AGL_ATTEMPT, None, 4)
    assert {span.trace_id for span in store.spans} == {root.trace_id}
    assert step.parent_id == reward_span.parent_id == root.span_id and tool.parent_id == step.span_id
    assert root.status.status_code != "ERROR"


async def test_a_failed_attempts_root_span_says_why() -> None:
    async def broken(task: Any) -> float:
        raise RuntimeError("the tool is gone")

    store = FlakyStore({})
    stats = await run_one(store, broken)
    assert stats.failed == 1
    [root] = [span for span in store.spans if span.name == AGL_ATTEMPT]
    assert root.status.status_code == "ERROR" and "the tool is gone" in (root.status.description or "")
    assert all(span.trace_id == root.trace_id for span in store.spans)
