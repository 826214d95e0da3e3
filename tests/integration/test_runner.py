"""Runner processes against the real stack: many rollouts, failures, kill -9 and SIGTERM.

Each test has a stack of its own (runners consume every task of their topic prefix), and starts
runners as real processes: `agl-stream runner --agent tests.integration.agents:scripted`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator

import pytest

from agl_stream import AglStore, connect
from agl_stream.config import Settings
from agl_stream.kafka.offsets import fence_at_end
from agl_stream.models import RolloutConfig
from tests.integration.helpers import local_stack, start_role, stop_role

pytestmark = pytest.mark.integration

AGENT = "tests.integration.agents:scripted"


@pytest.fixture(scope="module")
def own_stack(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    # One stack for the module (~30 s each to start): every test enqueues its own rollouts,
    # waits for them, and stops the runners it started.
    with local_stack(kafka_bootstrap, tmp_path_factory.mktemp("runner-stack"), watchdog_interval_s=0.2) as settings:
        yield settings


def _runner(settings: Settings, *args: str, name: str) -> subprocess.Popen[bytes]:
    return start_role(settings, "runner", "--agent", AGENT, *args, log_name=name)


async def _until(check: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    """Wait for a condition the test cannot be notified of (another process's progress)."""
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_240_rollouts_across_4_runner_processes(own_stack: Settings) -> None:
    runners = _runner(own_stack, "--workers", "4", "--concurrency", "8", name="runners")
    try:
        async with connect(**own_stack.model_dump(exclude_none=True)) as store:
            made = await store.enqueue_many_rollouts([{"input": {"kind": "ok", "i": i}} for i in range(240)])
            ids = [r.rollout_id for r in made]
            finished = await store.wait_for_rollouts(rollout_ids=ids, timeout=300)
            assert len(finished) == 240
            assert {r.status for r in finished} == {"succeeded"}
            table = f"{own_stack.clickhouse_database}.otel_traces"
            assert store.side is not None
            result = await store.side.query(
                "SELECT RolloutId, AttemptId, groupArray(SequenceId) AS seqs, groupArray(SpanName) AS names, "
                f"count() AS n FROM {table} WHERE RolloutId IN {{ids:Array(String)}} GROUP BY RolloutId, AttemptId",
                {"ids": ids},
                fence=await fence_at_end(own_stack, "spans"),
                timeout=60,
            )
            rows = result.dicts()
            assert len(rows) == 240, "every rollout has spans from exactly one attempt"
            for row in rows:
                # the root span, agent.step, tool.call, the message, the reward: each exactly once
                assert row["n"] == 5, row
                assert sorted(row["seqs"]) == [1, 2, 3, 4, 5], row  # gap-free, from 1
                assert sorted(row["names"]) == sorted(
                    [
                        "agentlightning.attempt",
                        "agent.step",
                        "tool.call",
                        "agentlightning.message",
                        "agentlightning.annotation",
                    ]
                )
            sample = made[7]
            [attempt] = await store.query_attempts(sample.rollout_id)
            assert {row["AttemptId"] for row in rows if row["RolloutId"] == sample.rollout_id} == {attempt.attempt_id}
            spans = await store.query_spans(sample.rollout_id, attempt.attempt_id)
            step = next(s for s in spans if s.name == "agent.step")
            tool = next(s for s in spans if s.name == "tool.call")
            assert tool.parent_id == step.span_id and step.attributes["task.i"] == 7
            assert attempt.worker_id is not None and attempt.worker_id.startswith("runner-")
    finally:
        assert stop_role(runners, timeout=60) == 0


async def test_an_agent_that_raises_fails_the_attempt_and_is_retried(own_stack: Settings) -> None:
    runner = _runner(own_stack, name="runner")
    try:
        async with connect(**own_stack.model_dump(exclude_none=True)) as store:
            config = RolloutConfig(max_attempts=2, retry_condition=["failed"])
            rollout = await store.enqueue_rollout({"kind": "raise"}, config=config)
            [final] = await store.wait_for_rollouts(rollout_ids=[rollout.rollout_id], timeout=60)
            assert final.status == "failed"
            attempts = await store.query_attempts(rollout.rollout_id)
            assert [(a.sequence_id, a.status) for a in attempts] == [(1, "failed"), (2, "failed")]
            fence = await fence_at_end(own_stack, "spans")
            assert store.side is not None
            for attempt in attempts:
                await store.side.query("SELECT 1", fence=fence)
                spans = await store.query_spans(rollout.rollout_id, attempt.attempt_id)
                [exception] = [s for s in spans if s.name == "agentlightning.exception"]
                assert exception.attributes["exception.type"] == "ValueError"
                assert "scripted failure" in str(exception.attributes["exception.message"])
    finally:
        assert stop_role(runner, timeout=60) == 0


async def test_a_runner_killed_mid_attempt_is_retried_on_another_runner(own_stack: Settings) -> None:
    first = _runner(own_stack, "--heartbeat-interval", "0.3", name="first")
    second: subprocess.Popen[bytes] | None = None
    try:
        async with connect(**own_stack.model_dump(exclude_none=True)) as store:
            config = RolloutConfig(unresponsive_seconds=2, max_attempts=2, retry_condition=["unresponsive"])
            rollout = await store.enqueue_rollout({"kind": "sleep_first", "seconds": 120}, config=config)

            async def running() -> bool:
                latest = await store.get_latest_attempt(rollout.rollout_id)
                return latest is not None and latest.status == "running"

            await _until(running, 60, "the first runner to run the attempt")
            os.kill(first.pid, signal.SIGKILL)
            first.wait()
            second = _runner(own_stack, "--heartbeat-interval", "0.3", name="second")
            [final] = await store.wait_for_rollouts(rollout_ids=[rollout.rollout_id], timeout=90)
            assert final.status == "succeeded"
            attempts = await store.query_attempts(rollout.rollout_id)
            assert [(a.sequence_id, a.status) for a in attempts] == [(1, "unresponsive"), (2, "succeeded")]
            assert attempts[0].worker_id != attempts[1].worker_id
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
        if second is not None:
            assert stop_role(second, timeout=60) == 0


async def test_sigterm_finishes_or_releases_every_live_attempt(own_stack: Settings) -> None:
    first = _runner(own_stack, "--grace", "10", "--concurrency", "4", name="first")
    second: subprocess.Popen[bytes] | None = None
    try:
        async with connect(**own_stack.model_dump(exclude_none=True)) as store:
            slow = await store.enqueue_rollout({"kind": "sleep_first", "seconds": 120})
            quick = await store.enqueue_rollout({"kind": "sleep", "seconds": 4})

            async def both_claimed() -> bool:
                # The read side shows a state up to a second late (the sinks linger), and a busy
                # machine may add more: the quick attempt may be seen running or already done.
                rollouts = await store.query_rollouts(rollout_id_in=[slow.rollout_id, quick.rollout_id])
                status = {r.rollout_id: r.status for r in rollouts}
                return status.get(slow.rollout_id) == "running" and status.get(quick.rollout_id) in (
                    "running",
                    "succeeded",
                )

            await _until(both_claimed, 60, "both attempts to run")
            first.send_signal(signal.SIGTERM)
            assert first.wait(timeout=60) == 0
            # The quick attempt finished (within the grace period, if still live); the slow one was
            # given back.
            finished = await store.wait_for_rollouts(rollout_ids=[quick.rollout_id], timeout=30)
            assert [r.status for r in finished] == ["succeeded"]

            async def requeued() -> bool:
                # The runner's release is not behind this client's read fence: wait for the sink.
                released = await store.get_rollout_by_id(slow.rollout_id)
                return released is not None and released.status == "requeuing"

            await _until(requeued, 30, "the slow rollout to be given back (requeuing)")
            second = _runner(own_stack, name="second")
            [final] = await store.wait_for_rollouts(rollout_ids=[slow.rollout_id], timeout=60)
            assert final.status == "succeeded"
            attempts = await store.query_attempts(slow.rollout_id)
            assert [(a.sequence_id, a.status) for a in attempts] == [(1, "failed"), (2, "succeeded")]
            assert [a.status for a in await store.query_attempts(quick.rollout_id)] == ["succeeded"]
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
        if second is not None:
            assert stop_role(second, timeout=60) == 0


async def test_a_sync_agent_runs_in_a_thread_and_is_traced(own_stack: Settings) -> None:
    runner = start_role(own_stack, "runner", "--agent", "tests.integration.agents:sync_scripted", log_name="sync")
    try:
        async with connect(**own_stack.model_dump(exclude_none=True)) as store:
            rollouts = await store.enqueue_many_rollouts([{"input": {"n": n}} for n in range(6)])
            finished = await store.wait_for_rollouts(rollout_ids=[r.rollout_id for r in rollouts], timeout=60)
            assert [r.status for r in finished] == ["succeeded"] * 6
            assert store.side is not None
            await store.side.query("SELECT 1", fence=await fence_at_end(own_stack, "spans"))
            spans = await store.query_spans(rollouts[0].rollout_id, "latest")
            # the thread's span is a child of the attempt's root span, which ends last
            assert [s.name for s in spans] == ["sync.step", "agentlightning.annotation", "agentlightning.attempt"]
            assert [s.sequence_id for s in spans] == [1, 2, 3]
            assert spans[0].parent_id == spans[2].span_id
    finally:
        assert stop_role(runner, timeout=60) == 0


async def test_resources_come_from_the_rollouts_snapshot_or_the_latest(own_stack: Settings) -> None:
    from agl_stream.models import LLM, ProxyLLM

    runner = start_role(own_stack, "runner", "--agent", "tests.integration.agents:needs_llm", log_name="llm")
    try:
        async with connect(**own_stack.model_dump(exclude_none=True)) as store:
            old = await store.add_resources({"policy": LLM(endpoint="http://127.0.0.1:1/v1", model="v1")})
            await store.add_resources(
                {
                    "policy": ProxyLLM(endpoint="http://127.0.0.1:2/v1", model="v2"),
                    "other": LLM(endpoint="x", model="o"),
                }
            )
            pinned = await store.enqueue_rollout({"expected_model": "v1"}, resources_id=old.resources_id)
            # No snapshot named: the runner takes the latest one when it runs the rollout.
            latest = await store.enqueue_rollout({"expected_model": "v2"})
            finished = await store.wait_for_rollouts(rollout_ids=[pinned.rollout_id, latest.rollout_id], timeout=60)
            assert [r.status for r in finished] == ["succeeded", "succeeded"]
            assert store.side is not None
            await store.side.query("SELECT 1", fence=await fence_at_end(own_stack, "spans"))
            messages = {}
            for rollout in finished:
                spans = await store.query_spans(rollout.rollout_id, "latest")
                rewards = [s for s in spans if s.name == "agentlightning.annotation"]
                assert [s.attributes["agentlightning.reward.0.value"] for s in rewards] == [1.0]
                [message] = [s for s in spans if s.name == "agentlightning.message"]
                messages[rollout.rollout_id] = message.attributes["agentlightning.message.body"]
            assert messages[pinned.rollout_id] == "v1 at http://127.0.0.1:1/v1"
            attempt = (await store.get_latest_attempt(latest.rollout_id)).attempt_id  # type: ignore[union-attr]
            # A ProxyLLM reaches the agent as an LLM on this attempt's proxy URL.
            assert (
                messages[latest.rollout_id]
                == f"v2 at http://127.0.0.1:2/rollout/{latest.rollout_id}/attempt/{attempt}/v1"
            )
    finally:
        assert stop_role(runner, timeout=60) == 0


async def test_eight_runner_processes_on_four_partitions_all_claim(own_stack: Settings) -> None:
    # Claims are store requests the processor answers, not partitions of a consumer group: a
    # runner process beyond the partition count gets work like the others.
    started = time.time()
    runners = _runner(own_stack, "--workers", "8", "--concurrency", "1", name="eight")
    try:
        async with connect(**own_stack.model_dump(exclude_none=True)) as store:
            await _until(lambda: _workers_seen(store, 8, since=started), 120, "8 runner processes to report")
            tasks = [{"input": {"kind": "sleep", "seconds": 0.05, "i": i}} for i in range(160)]
            made = await store.enqueue_many_rollouts(tasks)
            finished = await store.wait_for_rollouts(rollout_ids=[r.rollout_id for r in made], timeout=300)
            assert len(finished) == 160
            per_worker: dict[str, int] = {}
            for rollout in made:
                [attempt] = await store.query_attempts(rollout.rollout_id)
                assert attempt.worker_id is not None
                per_worker[attempt.worker_id] = per_worker.get(attempt.worker_id, 0) + 1
            print("rollouts per runner process:", sorted(per_worker.values()))
            assert len(per_worker) == 8, per_worker
    finally:
        assert stop_role(runners, timeout=60) == 0


async def _workers_seen(store: AglStore, count: int, *, since: float) -> bool:
    """At least ``count`` workers reported since ``since`` (the module's earlier runners did before)."""
    workers = await store.query_workers()
    return sum(w.last_heartbeat_time is not None and w.last_heartbeat_time >= since for w in workers) >= count
