"""A runner whose span export fails as in a broker's failover, against the real stack.

The store client is the real one on the real broker and processor; only its ``export_spans``
(the tracer's flush) fails, a set number of times or always, with the empty-message
``TimeoutError`` a failover brings. The attempt must end and the rollout finish either way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from typing import Any
from uuid import uuid4

import pytest

from agl_stream import AglStore, connect
from agl_stream.agent.litagent import FunctionalLitAgent
from agl_stream.config import Settings
from agl_stream.kafka.offsets import fence_at_end
from agl_stream.local import stack
from agl_stream.models import Span
from agl_stream.retry import Backoff
from consumers.runner import Runner, RunnerOptions, RunnerStats

pytestmark = pytest.mark.integration

TIMEOUT = 120.0  # generous: the machine may be busy
QUICK = Backoff(tries=3, first_s=0.05, max_s=0.1)


@pytest.fixture(scope="module")
def own_stack(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    # A stack of its own: a runner claims whatever its topics' queue holds.
    settings = Settings(
        kafka_bootstrap=kafka_bootstrap,
        data_dir=tmp_path_factory.mktemp("runner-faults"),
        topic_prefix=f"f{uuid4().hex[:10]}",
        gateway_port=0,
    )
    stack.up(settings, timeout=120)
    try:
        yield stack.local_stack_settings(settings)
    finally:
        stack.down(settings)


class FailingExport(AglStore):
    """The real store client, whose first ``failures`` span exports raise ``TimeoutError()``."""

    def __init__(self, settings: Settings, failures: float) -> None:
        super().__init__(settings)
        self.failures = failures
        self.failed = 0

    async def export_spans(self, spans: Sequence[Span]) -> None:
        if self.failed < self.failures:
            self.failed += 1
            raise TimeoutError()
        await super().export_spans(spans)


async def reward(task: Any) -> float:
    return 1.0


async def run_one(settings: Settings, store: AglStore | None = None) -> RunnerStats:
    """A real runner that claims one rollout and stops once its attempt ended."""
    options = RunnerOptions(concurrency=1, max_rollouts=1, grace_s=TIMEOUT, retry=QUICK)
    runner = Runner(FunctionalLitAgent(reward), settings, options, store=store)
    return await asyncio.wait_for(runner.run(asyncio.Event()), TIMEOUT)


async def test_a_flush_failing_a_few_times_is_retried_and_the_attempt_succeeds(own_stack: Settings) -> None:
    async with connect(**own_stack.model_dump(exclude_none=True)) as store:
        rollout = await store.enqueue_rollout({"flush": "fails twice"})
        flaky = FailingExport(own_stack, failures=2)
        stats = await run_one(own_stack, flaky)
        assert (stats.claimed, stats.succeeded) == (1, 1), stats
        assert flaky.failed == 2
        [final] = await store.wait_for_rollouts(rollout_ids=[rollout.rollout_id], timeout=TIMEOUT)
        assert final.status == "succeeded"
        attempts = await store.query_attempts(rollout.rollout_id)
        assert [(a.sequence_id, a.status) for a in attempts] == [(1, "succeeded")]
        assert store.side is not None
        await store.side.query("SELECT 1", fence=await fence_at_end(own_stack, "spans"))  # the spans sink caught up
        spans = await store.query_spans(rollout.rollout_id, attempts[0].attempt_id)
        # the reward and the attempt's root span, each stored once
        assert [s.name for s in spans] == ["agentlightning.annotation", "agentlightning.attempt"]


async def test_a_flush_that_never_gets_through_releases_the_attempt_and_the_rollout_finishes(
    own_stack: Settings,
) -> None:
    async with connect(**own_stack.model_dump(exclude_none=True)) as store:
        rollout = await store.enqueue_rollout({"flush": "always fails"})
        stats = await run_one(own_stack, FailingExport(own_stack, failures=float("inf")))
        assert (stats.claimed, stats.released) == (1, 1), stats
        # Given back: requeued for another attempt, whatever the rollout's config says.
        again = await run_one(own_stack)
        assert (again.claimed, again.succeeded) == (1, 1), again
        [final] = await store.wait_for_rollouts(rollout_ids=[rollout.rollout_id], timeout=TIMEOUT)
        assert final.status == "succeeded"
        attempts = await store.query_attempts(rollout.rollout_id)
        assert [(a.sequence_id, a.status) for a in attempts] == [(1, "failed"), (2, "succeeded")]
