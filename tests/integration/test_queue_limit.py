"""A bounded rollout queue against the real stack: the processor refuses an enqueue past
AGL_MAX_QUEUED_PER_PARTITION, the store client raises QueueFullError, and the queue admits again
once runners claimed what was queued."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from agl_stream import AglStore, connect
from agl_stream.config import Settings
from agl_stream.domain.queue import QUEUE_FULL
from agl_stream.local import stack
from agl_stream.store.replies import QueueFullError, RejectedError
from tests.integration.helpers import local_stack

pytestmark = pytest.mark.integration

LIMIT = 2


@pytest.fixture(scope="module")
def limited_stack(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    with local_stack(kafka_bootstrap, tmp_path_factory.mktemp("limited"), max_queued_per_partition=LIMIT) as settings:
        yield settings


async def _fill(store: AglStore, partitions: int) -> tuple[list[str], QueueFullError]:
    """Enqueue one rollout at a time until one is refused: at most LIMIT per partition fit, so a
    refusal comes by the (LIMIT * partitions + 1)th."""
    accepted: list[str] = []
    for _ in range(LIMIT * partitions + 1):
        try:
            accepted.append((await store.enqueue_rollout({"i": len(accepted)})).rollout_id)
        except QueueFullError as error:
            return accepted, error
    raise AssertionError(f"{len(accepted)} rollouts queued on {partitions} partitions with a limit of {LIMIT} each")


async def test_an_enqueue_past_the_limit_is_refused_and_admitted_again_after_claims(limited_stack: Settings) -> None:
    async with connect(**limited_stack.model_dump(exclude_none=True)) as store:
        partitions = len(await store._producer.partitions_for(limited_stack.topic("rollouts")))
        accepted, refused = await _fill(store, partitions)
        assert isinstance(refused, RejectedError) and isinstance(refused, ValueError)
        message = str(refused)
        assert message.startswith(QUEUE_FULL) and f"{LIMIT} queued rollouts" in message
        assert "AGL_MAX_QUEUED_PER_PARTITION" in message
        match = re.search(r"rollout (ro-\w+) refused", message)
        assert match is not None and match.group(1) not in accepted
        assert await store.get_rollout_by_id(match.group(1)) is None  # it does not exist
        for rollout_id in accepted:
            rollout = await store.get_rollout_by_id(rollout_id)
            assert rollout is not None and rollout.status == "queuing"
        # Runners claim and finish everything queued: every queue has room again.
        claimed = set()
        while (attempted := await store.dequeue_rollout(worker_id="w-1")) is not None:
            claimed.add(attempted.rollout_id)
            await store.update_attempt(attempted.rollout_id, attempted.attempt.attempt_id, status="succeeded")
        assert claimed == set(accepted)
        again, refused_again = await _fill(store, partitions)
        assert again and str(refused_again).startswith(QUEUE_FULL)  # admitted, then bounded again
        for rollout_id in again:
            rollout = await store.get_rollout_by_id(rollout_id)
            assert rollout is not None and rollout.status == "queuing"


async def test_a_full_queue_over_rest_is_a_503_with_retry_after(limited_stack: Settings) -> None:
    """Back-pressure, not the caller's mistake: the seed's client retries a 503 (and gives up on
    a 4xx at once)."""
    import httpx

    info = stack.read_stack(limited_stack)
    assert info is not None and info.gateway_url
    async with connect(**limited_stack.model_dump(exclude_none=True)) as store:
        partitions = len(await store._producer.partitions_for(limited_stack.topic("rollouts")))
    body = {"rollouts": [{"input": {"rest": i}} for i in range(LIMIT * partitions + 1)]}
    async with httpx.AsyncClient(base_url=info.gateway_url, trust_env=False, timeout=120) as http:
        response = await http.post("/v1/agl/queues/rollouts/enqueue", json=body)
    assert response.status_code == 503, response.text
    assert response.headers.get("Retry-After") and response.json()["error"] == "queue_full"
    assert "AGL_MAX_QUEUED_PER_PARTITION" in response.json()["message"]
