"""The sinks' linger against the real stack: with a linger far longer than any test, a store read
waiting on a fence still gets its records into ClickHouse at once, and a read of one worker waits
for (and so flushes) only what this client wrote about that worker, not every rollout's state."""

from __future__ import annotations

from collections.abc import Iterator
from uuid import uuid4

import pytest

from agl_stream import AglStore, connect
from agl_stream.config import Settings
from tests.integration.helpers import local_stack

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def lingering_stack(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    # A linger far longer than any test: only a waiting reader (or a full batch) makes a sink insert.
    with local_stack(kafka_bootstrap, tmp_path_factory.mktemp("lingering"), sink_linger_ms=600_000) as settings:
        yield settings


async def _rows_in_table(store: AglStore, rollout_id: str) -> int:
    """Rows of the rollout in the rollouts table as it stands, waiting for nothing (no fence)."""
    assert store.side is not None
    sql = f"SELECT count() AS n FROM {store.settings.clickhouse_database}.rollouts WHERE rollout_id = {{r:String}}"
    result = await store.side.query(sql, {"r": rollout_id})
    return int(result.dicts()[0]["n"])


async def test_a_worker_read_flushes_no_other_rollout_and_a_fenced_read_ends_the_linger(
    lingering_stack: Settings,
) -> None:
    async with connect(**lingering_stack.model_dump(exclude_none=True)) as store:
        worker = f"w-{uuid4().hex[:6]}"
        other = await store.enqueue_rollout({"not": "the worker's"})
        beat = await store.update_worker(worker, heartbeat_stats={"load": 1})
        assert beat.worker_id == worker and beat.heartbeat_stats == {"load": 1}
        # The worker's read waited for its heartbeat only: the other rollout's state still lingers.
        assert await _rows_in_table(store, other.rollout_id) == 0
        # A read of that rollout waits on its fence, which ends the linger at once.
        read = await store.get_rollout_by_id(other.rollout_id)
        assert read is not None and read.rollout_id == other.rollout_id
        assert await _rows_in_table(store, other.rollout_id) == 1

        # The worker's own claim is in its fence: its read sees it busy on that rollout.
        mine = await store.enqueue_rollout({"for": worker})
        for _ in range(200):  # the other rollout is queued too, and may come first
            claimed = await store.dequeue_rollout(worker_id=worker)
            if claimed is not None and claimed.rollout_id == mine.rollout_id:
                break
        else:
            raise AssertionError(f"{mine.rollout_id} was never dequeued")
        busy = await store.get_worker_by_id(worker)
        assert busy is not None and busy.status == "busy" and busy.current_rollout_id == mine.rollout_id
