"""wait_for_rollouts' memory of notices (FinishedRollouts): pure asyncio, no broker.

The test plays the reply channel: it calls ``heard`` as the processor's notices would arrive."""

from __future__ import annotations

import asyncio

from agl_stream.models import Rollout
from agl_stream.store.notices import FinishedRollouts


def _rollout(rollout_id: str, status: str = "succeeded") -> Rollout:
    return Rollout.model_validate({"rollout_id": rollout_id, "input": {}, "start_time": 1.0, "status": status})


async def _started() -> None:
    """Let the waits just created run to their first await: a wait registers before it."""
    await asyncio.sleep(0)


async def test_what_was_heard_before_is_answered_at_once() -> None:
    finished = FinishedRollouts()
    finished.heard(_rollout("r1"))
    finished.heard(_rollout("r2", status="running"))  # not finished: not an answer
    got = await finished.wait(["r1", "r2", "r3"], timeout=0)
    assert list(got) == ["r1"]


async def test_a_wait_ends_when_the_last_id_is_heard() -> None:
    finished = FinishedRollouts()
    finished.heard(_rollout("r1"))
    waiting = asyncio.create_task(finished.wait(["r1", "r2", "r3"], timeout=600))
    await _started()
    finished.heard(_rollout("r3", status="failed"))
    finished.heard(_rollout("other"))  # nobody waits for it
    await asyncio.sleep(0)
    assert not waiting.done()  # r2 still missing
    finished.heard(_rollout("r2"))
    got = await asyncio.wait_for(waiting, 60)  # long before the wait's own timeout
    assert {rid: r.status for rid, r in got.items()} == {"r1": "succeeded", "r2": "succeeded", "r3": "failed"}
    assert finished._waits == []


async def test_a_wait_that_times_out_answers_what_it_heard() -> None:
    finished = FinishedRollouts()
    waiting = asyncio.create_task(finished.wait(["r1", "r2"], timeout=0.05))
    await _started()
    finished.heard(_rollout("r2"))
    got = await asyncio.wait_for(waiting, 60)
    assert list(got) == ["r2"]
    assert finished._waits == []


async def test_concurrent_waits_each_hear_their_own_ids() -> None:
    finished = FinishedRollouts()
    first = asyncio.create_task(finished.wait(["a", "shared"], timeout=600))
    second = asyncio.create_task(finished.wait(["b", "shared"], timeout=600))
    await _started()
    for rid in ("shared", "a", "b"):
        finished.heard(_rollout(rid))
    assert set(await asyncio.wait_for(first, 60)) == {"a", "shared"}
    assert set(await asyncio.wait_for(second, 60)) == {"b", "shared"}


async def test_a_cancelled_wait_stops_listening() -> None:
    finished = FinishedRollouts()
    waiting = asyncio.create_task(finished.wait(["r1"], timeout=None))
    await _started()
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert finished._waits == []
    finished.heard(_rollout("r1"))  # told to no one, remembered for the next wait
    assert list(await finished.wait(["r1"], timeout=0)) == ["r1"]
