"""A three-broker cluster under load: brokers, the controller and role instances die mid-run.

One local KRaft cluster of three nodes (``agl-stream kafka start --brokers 3``) serves the whole
module, with topics at replication 3 and ``min.insync.replicas`` 2, and one stack on it (rollout
processor, gateway with its sinks, triplet builder, batcher). Runner processes run an agent that
makes two LLM-call spans and a reward per rollout, so every finished attempt goes all the way:
spans into ``otel_traces``, one triplet record, one place in a training batch.

While rollouts flow, the tests ``kill -9`` a broker and start it again, kill the active KRaft
controller, and run second instances of the processor, the triplet builder and the batcher,
killing one of each. After every run the counts must be exact: no rollout lost or finished
twice, every span once in ``otel_traces``, every attempt once in ``triplet_records`` and once
in the batches. The figures (pause seen by the runners, catch-up) are printed.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from uuid import uuid4

import pytest
from aiokafka.admin import AIOKafkaAdminClient

from agl_stream import AglStore, connect
from agl_stream.config import Settings
from agl_stream.kafka import broker
from agl_stream.kafka.offsets import fence_at_end
from agl_stream.local import stack
from agl_stream.models import TripletBatch
from agl_stream.ports import free_port_run
from agl_stream.wire.codec import Codec
from tests.integration.helpers import read_to_end, start_role, stop_role

pytestmark = pytest.mark.integration

AGENT = "tests.integration.agents:llm_like"  # two LLM calls with token ids and a reward span
# Lean for `make test`; CLUSTER_TEST_ROLLOUTS=3000 gives the figures of a longer run.
ROLLOUTS = int(os.environ.get("CLUSTER_TEST_ROLLOUTS", "480"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    first = free_port_run(6)
    local = Settings(
        kafka_bootstrap=None,
        data_dir=tmp_path_factory.mktemp("cluster"),
        kafka_brokers=3,
        kafka_port=first,
        kafka_controller_port=first + 1,
        kafka_heap="384m",
    )
    broker.start(local)
    try:
        yield local
    finally:
        broker.stop(local)


@pytest.fixture(scope="module")
def cluster_stack(cluster: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    settings = Settings(
        kafka_bootstrap=cluster.bootstrap_servers,
        data_dir=tmp_path_factory.mktemp("cluster-stack"),
        topic_prefix=f"k{uuid4().hex[:10]}",
        gateway_port=0,
    )
    stack.up(settings, training=True)
    try:
        yield stack.local_stack_settings(settings)
    finally:
        stack.down(settings)


@pytest.fixture
def runners(cluster_stack: Settings) -> Iterator[subprocess.Popen[bytes]]:
    runner = start_role(
        cluster_stack, "runner", "--agent", AGENT, "--workers", "2", "--concurrency", "8", log_name="runner"
    )
    try:
        yield runner
    finally:
        assert stop_role(runner, timeout=60) == 0


@pytest.fixture
async def store(cluster_stack: Settings) -> AsyncIterator[AglStore]:
    async with connect(**cluster_stack.model_dump(exclude_none=True)) as client:
        yield client


async def _under_replicated(settings: Settings) -> int:
    """Partitions of this stack's topics whose in-sync replicas are fewer than their replicas."""
    admin = AIOKafkaAdminClient(**settings.kafka_client_options())
    await admin.start()
    try:
        names = [settings.topic(n) for n in ("rollouts", "rollout-state", "spans", "triplets", "triplet-batches")]
        described = await admin.describe_topics(names)
    finally:
        await admin.close()
    return sum(len(p["isr"]) < len(p["replicas"]) for topic in described for p in topic["partitions"])


class Run:
    """Rollouts enqueued at once; completions observed as the store announces them."""

    def __init__(self, store: AglStore, total: int) -> None:
        self.store = store
        self.total = total
        self.ids: list[str] = []
        self.finished: dict[str, float] = {}  # rollout id -> when this client heard it finished

    async def enqueue(self) -> None:
        for start in range(0, self.total, 250):
            made = await self.store.enqueue_many_rollouts(
                [{"input": {"i": i}, "mode": "train"} for i in range(start, min(start + 250, self.total))]
            )
            self.ids += [r.rollout_id for r in made]

    async def until(self, count: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.finished) < count:
            if time.monotonic() > deadline:
                left = await self.store.query_rollouts(rollout_ids=[r for r in self.ids if r not in self.finished])
                raise AssertionError(
                    f"only {len(self.finished)} of {count} rollouts finished; not finished: "
                    + "; ".join(repr(r) for r in left[:5])
                )
            waiting = [r for r in self.ids if r not in self.finished]
            for rollout in await self.store.wait_for_rollouts(rollout_ids=waiting, timeout=0.5):
                self.finished.setdefault(rollout.rollout_id, time.monotonic())

    def pause_after(self, moment: float) -> float:
        """The longest time without a finished rollout in the minute after ``moment``."""
        times = sorted([moment, *(t for t in self.finished.values() if moment <= t <= moment + 60)])
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


async def _wait_for(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> float:
    began = time.monotonic()
    while not condition():
        assert time.monotonic() - began < timeout, f"{what} did not happen within {timeout:.0f} s"
        await asyncio.sleep(0.1)  # polling another process's state, with a deadline
    return time.monotonic() - began


async def _check_exactly_once(settings: Settings, store: AglStore, run: Run) -> dict[str, int]:
    """Every rollout finished once and succeeded; its spans, triplet record and batch place once."""
    wanted = set(run.ids)
    assert len(wanted) == run.total
    rollouts = await store.query_rollouts(rollout_ids=run.ids)
    assert Counter(r.status for r in rollouts) == {"succeeded": run.total}
    attempts = {r.rollout_id: r.attempt.attempt_id for r in rollouts if r.attempt is not None}  # type: ignore[attr-defined]
    assert set(attempts) == wanted

    # The sinks have everything written so far once these fences hold.
    fence = await fence_at_end(settings, "spans") | await fence_at_end(settings, "triplets")
    assert store.side is not None
    db = settings.clickhouse_database
    listed = ",".join(f"'{r}'" for r in run.ids)
    spans = await store.side.query(
        f"SELECT count(), uniqExact(SpanId), uniqExact(RolloutId) FROM {db}.otel_traces FINAL "
        f"WHERE RolloutId IN ({listed})",
        fence=fence,
        timeout=120,
    )
    [[span_rows, distinct_spans, span_rollouts]] = spans.rows
    assert span_rows == distinct_spans and span_rollouts == run.total
    # A builder emits an attempt's record once its spans settled, so the last ones may still
    # be on their way: read until every attempt has one (or the deadline).
    deadline = time.monotonic() + 120
    while True:
        records = await store.side.query(
            f"SELECT rollout_id, attempt_id, count() FROM {db}.triplet_records FINAL "
            f"WHERE rollout_id IN ({listed}) GROUP BY rollout_id, attempt_id",
            fence=await fence_at_end(settings, "triplets"),
            timeout=120,
        )
        if len(records.rows) >= run.total or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)  # the builder's settle time, polled with a deadline
    assert {(r, a) for r, a, _ in records.rows} == set(attempts.items())
    assert {int(n) for _, _, n in records.rows} == {1}

    # Training batches: a batch re-sent after a lost acknowledgement is the same batch (same id);
    # across distinct batches each finished attempt has exactly one place.
    deadline = time.monotonic() + 120
    codec = Codec.default()
    while True:
        distinct: dict[str, TripletBatch] = {}
        for message in await read_to_end(settings, settings.topic("triplet-batches"), timeout=60):
            batch = codec.decode(message.value, TripletBatch)
            distinct.setdefault(batch.batch_id, batch)
        places = Counter((r.rollout_id, r.attempt_id) for b in distinct.values() for r in b.records)
        ours = {key: n for key, n in places.items() if key[0] in wanted}
        if len(ours) == run.total or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)  # the batcher lingers before a partial batch goes out
    assert ours == dict.fromkeys(attempts.items(), 1)
    return {"rollouts": run.total, "spans": int(span_rows), "triplet_records": len(records.rows), "batched": len(ours)}


@pytest.mark.timeout(900)
async def test_a_broker_and_then_the_controller_die_under_load_and_nothing_is_lost(
    cluster: Settings, cluster_stack: Settings, runners: subprocess.Popen[bytes], store: AglStore
) -> None:
    run = Run(store, total=ROLLOUTS)
    await run.enqueue()
    await run.until(run.total * 3 // 16)
    assert await _under_replicated(cluster_stack) == 0

    # A broker that is not the active controller dies: its partitions' leadership moves.
    controller = broker.active_controller(cluster)
    assert controller is not None
    victim = next(n for n in (1, 2, 3) if n != controller)
    killed_at = time.monotonic()
    assert broker.stop_node(cluster, victim, kill=True) is not None
    await run.until(run.total * 6 // 16)
    restarted_at = time.monotonic()
    # Started again as `agl-stream --data-dir <dir> kafka start` does: naming neither the node
    # count nor the ports, which the data dir remembers.
    broker.start(Settings(data_dir=cluster.data_dir, kafka_heap=cluster.kafka_heap))
    catch_up = 0.0
    while await _under_replicated(cluster_stack):
        catch_up = time.monotonic() - restarted_at
        assert catch_up < 120, "the restarted broker's replicas never rejoined the ISR"
        await asyncio.sleep(0.2)  # replicas fetching from the leaders, polled with a deadline
    catch_up = time.monotonic() - restarted_at

    # The active controller dies: the two other voters elect a new one.
    await run.until(run.total * 9 // 16)
    controller = broker.active_controller(cluster)
    assert controller is not None
    failed_over_at = time.monotonic()
    broker.stop_node(cluster, controller, kill=True)
    election = await _wait_for(
        lambda: broker.active_controller(cluster) not in (None, controller), "a new controller election"
    )
    await run.until(run.total * 12 // 16)
    broker.start(cluster)
    await run.until(run.total)

    counts = await _check_exactly_once(cluster_stack, store, run)
    print(
        f"\nbroker {victim} killed: longest pause in completions {run.pause_after(killed_at):.2f} s; "
        f"replicas back in sync {catch_up:.1f} s after its restart\n"
        f"controller {controller} killed: new controller in {election:.2f} s, longest pause "
        f"{run.pause_after(failed_over_at):.2f} s\ncounts {counts}"
    )


@pytest.mark.timeout(900)
async def test_second_instances_of_the_processors_join_and_one_of_each_dies(
    cluster_stack: Settings, runners: subprocess.Popen[bytes], store: AglStore, tmp_path: Path
) -> None:
    # The extra instances run from a data dir of their own (ready files), on the same topics and
    # consumer groups: the partitions are shared out, then move back when one is killed.
    second = cluster_stack.model_copy(update={"data_dir": tmp_path})
    extra = {
        "processor": start_role(second, "processor", log_name="processor-2"),
        "triplets": start_role(second, "triplets", log_name="triplets-2"),
        "batcher": start_role(second, "batcher", log_name="batcher-2"),
    }
    try:
        for role in extra:
            ready = tmp_path / "run" / f"{role}.ready"
            await _wait_for(ready.exists, f"the second {role} ready", timeout=90)
        run = Run(store, total=ROLLOUTS // 2)
        await run.enqueue()
        await run.until(run.total // 3)
        for process in extra.values():
            os.kill(process.pid, signal.SIGKILL)
            process.wait(30)
        killed_at = time.monotonic()
        await run.until(run.total)
        counts = await _check_exactly_once(cluster_stack, store, run)
        print(
            f"\none of two processors, builders and batchers killed: longest pause {run.pause_after(killed_at):.2f} s"
        )
        print(f"counts {counts}")
    finally:
        for process in extra.values():
            if process.poll() is None:
                stop_role(process, timeout=30)
