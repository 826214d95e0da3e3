"""The store end to end: a no-op agent loop on the whole local stack, on this machine.

An algorithm enqueues rollouts in batches; workers (coroutines over a few store clients, each
client one consumer-group member) claim them, write a few spans and mark them succeeded. All
processes run here: the broker, the rollout processor, the gateway with chDB, and this script.

Reports: rollouts/s and spans/s end to end, enqueue -> claim latency (p50/p99), fenced
read-after-write latency (update_rollout then get_rollout_by_id, p50/p99), and the processor's
RSS as finished rollouts pile up (memory must stay flat: finished rollouts are forgotten).

Run: `python benchmarks/store.py --rollouts 5000` (starts a broker on free ports in a temporary
folder unless AGL_KAFKA_BOOTSTRAP is set; stops everything it started). JSON results go to
benchmarks/results/store.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _measure import cpu_seconds, percentile  # type: ignore[import-not-found]

from agl_stream import AglStore, connect
from agl_stream.config import Settings
from agl_stream.kafka import broker
from agl_stream.local import stack
from agl_stream.models import Span
from agl_stream.ports import free_ports

PROBES = 100


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def step_spans(rollout_id: str, attempt_id: str, attributes: Sequence[dict[str, Any]]) -> list[Span]:
    """One ``agent.step`` span per item of ``attributes``, numbered from 1 (the benchmarks' spans)."""
    now = time.time()
    return [
        Span(
            rollout_id=rollout_id,
            attempt_id=attempt_id,
            sequence_id=i + 1,
            trace_id=uuid.uuid4().hex,
            span_id=uuid.uuid4().hex[:16],
            name="agent.step",
            attributes=attrs,
            start_time=now,
            end_time=now,
        )
        for i, attrs in enumerate(attributes)
    ]


def _spans(rollout_id: str, attempt_id: str, count: int) -> list[Span]:
    return step_spans(rollout_id, attempt_id, [{"step": i, "reward": 0.0} for i in range(count)])


async def run(
    settings: Settings, rollouts: int, clients: int, workers_per_client: int, spans: int, broker_pid: int | None
) -> dict[str, Any]:
    options = settings.model_dump(exclude_none=True)
    processor_pid = stack.read_stack(settings).pids["processor"]  # type: ignore[union-attr]
    processes = dict(stack.read_stack(settings).pids)  # type: ignore[union-attr]
    processes["benchmark"] = os.getpid()
    if broker_pid is not None:
        processes["broker"] = broker_pid
    enqueued_at: dict[str, float] = {}
    claim_latency: list[float] = []
    probe_ids: set[str] = set()
    probe_latency: list[float] = []
    probes_done = asyncio.Event()
    finished = 0
    rss: list[tuple[int, float]] = [(0, _rss_mb(processor_pid))]
    done = asyncio.Event()
    stop = asyncio.Event()

    async def algorithm(store: AglStore) -> None:
        for start in range(0, rollouts, 500):
            batch = [{"input": {"i": i}} for i in range(start, min(rollouts, start + 500))]
            now = time.time()
            for rollout in await store.enqueue_many_rollouts(batch):
                enqueued_at[rollout.rollout_id] = now

    async def worker(store: AglStore, name: str) -> None:
        nonlocal finished
        while not stop.is_set():
            claimed = await store.dequeue_rollout(worker_id=name)
            if claimed is None:
                continue
            latency = time.time() - enqueued_at.get(claimed.rollout_id, time.time())
            if claimed.rollout_id in probe_ids:
                probe_latency.append(latency)
                if len(probe_latency) == PROBES:
                    probes_done.set()
            else:
                claim_latency.append(latency)
            await store.add_many_spans(_spans(claimed.rollout_id, claimed.attempt.attempt_id, spans))
            await store.update_attempt(claimed.rollout_id, claimed.attempt.attempt_id, status="succeeded")
            if claimed.rollout_id in probe_ids:
                continue
            finished += 1
            if finished % max(1, rollouts // 10) == 0:
                rss.append((finished, _rss_mb(processor_pid)))
            if finished >= rollouts:
                done.set()

    async def probe(store: AglStore) -> None:
        # Steady-state enqueue -> claim latency: one rollout at a time into an idle queue.
        for _ in range(PROBES):
            before = time.time()
            rollout = await store.enqueue_rollout({"probe": True})
            enqueued_at[rollout.rollout_id] = before
            probe_ids.add(rollout.rollout_id)
            await asyncio.sleep(0.05)  # pacing the probes, not synchronisation
        await asyncio.wait_for(probes_done.wait(), 60)

    stores = [await connect(**options) for _ in range(clients + 1)]
    try:
        # Join the claimers' consumer group before the clock starts: a one-time cost per worker.
        await asyncio.gather(*(s.dequeue_rollout(worker_id="warm-up") for s in stores[1:]))
        started = time.perf_counter()
        cpu_before = {name: cpu_seconds(pid) for name, pid in processes.items()}
        tasks = [
            asyncio.create_task(worker(s, f"w{i}-{j}"))
            for i, s in enumerate(stores[1:])
            for j in range(workers_per_client)
        ]
        await algorithm(stores[0])
        await done.wait()
        elapsed = time.perf_counter() - started
        # Where the two cores went: CPU seconds per process over the measured run.
        cpu = {name: round(cpu_seconds(pid) - cpu_before[name], 2) for name, pid in processes.items()}
        await probe(stores[0])
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        rss.append((finished, _rss_mb(processor_pid)))
        # Read-after-write: a fenced read right after a write sees it.
        written = await stores[0].enqueue_rollout({"probe": True})
        raw: list[float] = []
        for i in range(200):
            await stores[0].update_rollout(written.rollout_id, metadata={"i": i})
            t0 = time.perf_counter()
            seen = await stores[0].get_rollout_by_id(written.rollout_id)
            raw.append(time.perf_counter() - t0)
            assert seen is not None and seen.metadata == {"i": i}, "a fenced read missed its write"
    finally:
        for store in stores:
            await store.close()
    return {
        "rollouts": rollouts,
        "spans_per_rollout": spans,
        "clients": clients,
        "workers": clients * workers_per_client,
        "seconds": elapsed,
        "rollouts_per_s": rollouts / elapsed,
        "cpu_seconds": cpu,
        "cpu_ms_per_rollout": sum(cpu.values()) / rollouts * 1e3,
        "spans_per_s": rollouts * spans / elapsed,
        "enqueue_to_claim_ms_idle_queue": {
            "p50": percentile(probe_latency, 0.5) * 1e3,
            "p99": percentile(probe_latency, 0.99) * 1e3,
        },
        "enqueue_to_claim_ms_backlog": {
            "p50": percentile(claim_latency, 0.5) * 1e3,
            "p99": percentile(claim_latency, 0.99) * 1e3,
        },
        "read_after_write_ms": {"p50": percentile(raw, 0.5) * 1e3, "p99": percentile(raw, 0.99) * 1e3},
        "processor_rss_mb": rss,
        "processor_rss_growth_mb": rss[-1][1] - statistics.median(v for _, v in rss[1:3]) if len(rss) > 2 else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=5_000)
    parser.add_argument("--clients", type=int, default=4, help="store clients running workers")
    parser.add_argument("--workers-per-client", type=int, default=16)
    parser.add_argument("--spans", type=int, default=3, help="spans per rollout")
    parser.add_argument(
        "--finished-retention", type=float, default=60.0, help="seconds the processor keeps finished rollouts"
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/store.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="agl-bench-store-") as tmp:
        settings = Settings(
            data_dir=Path(tmp),
            gateway_port=0,
            topic_prefix=f"b{uuid.uuid4().hex[:6]}",
            log_level="WARNING",
            finished_retention_s=args.finished_retention,
        )
        own_broker = settings.uses_local_broker
        if own_broker:
            port, controller = free_ports(2)
            settings = settings.model_copy(update={"kafka_port": port, "kafka_controller_port": controller})
        stack.up(settings)
        try:
            results = asyncio.run(
                run(
                    stack.local_stack_settings(settings),
                    args.rollouts,
                    args.clients,
                    args.workers_per_client,
                    args.spans,
                    broker.status(settings).pid if own_broker else None,
                )
            )
        finally:
            stack.down(settings)
    print(json.dumps(results, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
