"""kill -9 the rollout processor while rollouts are in flight: nothing is lost or applied twice.

Workers keep claiming and finishing rollouts while the processor is killed and restarted. Every
rollout must end in the state an uncrashed run gives (succeeded, one attempt per claim), every
task must be delivered, and an attempt the crash caused must be a recorded attempt.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from uuid import uuid4

import pytest

from agl_stream import AglStore, connect
from agl_stream.config import Settings
from agl_stream.local import stack
from agl_stream.local.supervisor import read_status
from agl_stream.store.replies import RejectedError

pytestmark = pytest.mark.integration

# Enough for the kill to land mid-flight with claims, updates and state records in every stage;
# four workers on two clients keep the run short on a loaded 2-core CI machine.
ROLLOUTS = 800


@pytest.fixture
def own_stack(kafka_bootstrap: str, tmp_path: Path) -> Iterator[Settings]:
    settings = Settings(
        kafka_bootstrap=kafka_bootstrap, data_dir=tmp_path, topic_prefix=f"c{uuid4().hex[:10]}", gateway_port=0
    )
    stack.up(settings)
    try:
        yield stack.local_stack_settings(settings)
    finally:
        stack.down(settings)


async def _work(store: AglStore, worker: str, wanted: set[str], finished: set[str], claims: dict[str, int]) -> None:
    idle_since = time.monotonic()
    while not wanted <= finished:
        claimed = await store.dequeue_rollout(worker_id=worker)
        if claimed is None:
            assert time.monotonic() - idle_since < 150, "the queue stayed empty with rollouts unfinished"
            continue
        idle_since = time.monotonic()
        claims[claimed.rollout_id] = claims.get(claimed.rollout_id, 0) + 1
        try:
            await store.update_attempt(claimed.rollout_id, claimed.attempt.attempt_id, status="succeeded")
        except RejectedError:
            continue  # a duplicate delivery after the crash; the fold already decided
        finished.add(claimed.rollout_id)


async def test_processor_killed_mid_flight_loses_and_duplicates_nothing(own_stack: Settings) -> None:
    # A processor restart on a loaded CI machine can take a while: calls wait it out.
    options = {**own_stack.model_dump(exclude_none=True), "request_timeout_s": 180.0}
    run = stack.read_stack(own_stack)
    assert run is not None
    async with connect(**options) as producer:
        rollouts = await producer.enqueue_many_rollouts([{"input": {"i": i}} for i in range(ROLLOUTS)])
    wanted = {r.rollout_id for r in rollouts}
    finished: set[str] = set()
    claims: dict[str, int] = {}

    async def crash_and_restart() -> None:
        deadline = time.monotonic() + 180  # a guard against a hang, not a speed goal (CI is slow)
        while len(finished) < ROLLOUTS // 4:  # kill once a quarter is through
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)  # watching the workers' progress counter
        (own_stack.run_dir / "processor.ready").unlink(missing_ok=True)
        os.kill(run.pids["processor"], signal.SIGKILL)
        # Nobody starts it again here: the stack's supervisor does.
        while True:
            state = read_status(own_stack.run_dir).get("processor")
            if state is not None and state.restarts == 1 and state.pid not in (None, run.pids["processor"]):
                break
            assert time.monotonic() < deadline + 60, "the supervisor did not start the processor again"
            await asyncio.sleep(0.05)  # polling the supervisor's status file

    await _run_and_check(options, wanted, finished, claims, crash_and_restart)


async def _run_and_check(
    options: dict[str, object], wanted: set[str], finished: set[str], claims: dict[str, int], crash: object
) -> None:
    async with connect(**options) as a, connect(**options) as b:
        await asyncio.gather(
            *(_work(client, f"w-{i}", wanted, finished, claims) for i, client in enumerate((a, b, a, b))),
            crash(),  # type: ignore[operator]
        )
        # Other clients' writes are not fenced for `a`: wait for them the way the API offers.
        rows = await a.wait_for_rollouts(rollout_ids=sorted(wanted), timeout=60)
        assert {r.rollout_id: r.status for r in rows} == dict.fromkeys(wanted, "succeeded")
        # A claim is decided once, by the fold: no rollout ran twice, each has the one attempt.
        assert claims == dict.fromkeys(wanted, 1)
        for rid in sorted(wanted)[:: ROLLOUTS // 40]:
            assert [(x.sequence_id, x.status) for x in await a.query_attempts(rid)] == [(1, "succeeded")]
