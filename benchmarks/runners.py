"""Runner processes end to end, on this machine: rollouts/s of a trivial agent, and span ingest.

Starts a local stack (broker unless AGL_KAFKA_BOOTSTRAP is set, processor, gateway with chDB)
and ``agl-stream runner --workers N`` processes, then measures:

* **trivial**: rollouts/s for a no-op agent (enqueue -> claim -> running -> reward span ->
  succeeded), from the first enqueue until ``wait_for_rollouts`` saw every one finish;
* **spans**: span ingest from runners to ClickHouse-queryable: agents each emit many ~2.5 KB
  spans; the clock stops when the gateway's spans sink has applied every span written
  (an offset fence on agl.spans), so the figure is spans/s *queryable*, not merely sent.

Run: `python benchmarks/runners.py [--rollouts 2000] [--span-rollouts 200 --spans 100]`.
JSON results go to benchmarks/results/runners.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from _measure import cpu_seconds  # type: ignore[import-not-found]

from agl_stream import connect
from agl_stream.config import Settings
from agl_stream.kafka import broker
from agl_stream.kafka.offsets import fence_at_end
from agl_stream.local import stack
from agl_stream.local.processes import start_role, stop_role
from agl_stream.ports import free_ports


def _children(pid: int) -> list[int]:
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return children


async def _phase(
    settings: Settings, inputs: list[dict[str, Any]], timeout: float, processes: dict[str, int]
) -> dict[str, Any]:
    async with connect(**settings.model_dump(exclude_none=True)) as store:
        side = store.side
        assert side is not None, "the benchmark reads through the gateway"
        cpu_before = {name: cpu_seconds(pid) for name, pid in processes.items()}
        started = time.perf_counter()
        made = []
        for start in range(0, len(inputs), 500):
            made += await store.enqueue_many_rollouts([{"input": i} for i in inputs[start : start + 500]])
        finished = await store.wait_for_rollouts(rollout_ids=[r.rollout_id for r in made], timeout=timeout)
        finished_at = time.perf_counter()
        await side.query("SELECT 1", fence=await fence_at_end(settings, "spans"), timeout=timeout)
        queryable_at = time.perf_counter()
        cpu = {name: round(cpu_seconds(pid) - cpu_before[name], 2) for name, pid in processes.items()}
        table = f"{settings.clickhouse_database}.otel_traces"
        counted = await side.query(
            f"SELECT count() FROM {table} WHERE RolloutId IN {{ids:Array(String)}}",
            {"ids": [r.rollout_id for r in made]},
        )
    succeeded = sum(r.status == "succeeded" for r in finished)
    spans = int(counted.rows[0][0])
    return {
        "rollouts": len(made),
        "succeeded": succeeded,
        "seconds_to_finished": finished_at - started,
        "seconds_to_queryable": queryable_at - started,
        "rollouts_per_s": len(made) / (finished_at - started),
        "spans": spans,
        "spans_per_s_queryable": spans / (queryable_at - started),
        "cpu_seconds": cpu,
        "cpu_us_per_span": sum(cpu.values()) / max(spans, 1) * 1e6,
    }


async def _wait_for_members(settings: Settings, runners_pid: int, count: int, timeout: float = 120.0) -> list[int]:
    """The pids of this phase's ``count`` runner processes, once each has reported (its first
    worker heartbeat), so the clock starts with all of them at work. Workers of an earlier
    phase stay in the workers table: a runner is told by the pid in its worker id
    (``runner-<host>-<pid>``), or an earlier phase's workers would pass for this one's and the
    runners' CPU would go uncounted."""
    from agl_stream import connect

    async with connect(**settings.model_dump(exclude_none=True)) as store:
        deadline = time.monotonic() + timeout
        while True:
            pids = _children(runners_pid) if count > 1 else [runners_pid]
            reported = {worker.worker_id for worker in await store.query_workers()}
            if len(pids) == count and all(any(w.endswith(f"-{pid}") for w in reported) for pid in pids):
                return pids
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {count} runners reported within {timeout}s")
            await asyncio.sleep(0.1)  # runners report on their own schedule: nothing to wait on


def _run_phase(
    settings: Settings,
    agent: str,
    workers: int,
    concurrency: int,
    inputs: list[dict[str, Any]],
    broker_pid: int | None,
) -> Any:
    runners = start_role(
        settings,
        "runner",
        "--agent",
        agent,
        "--workers",
        str(workers),
        "--concurrency",
        str(concurrency),
        log_path=settings.data_dir / "runners.log",
    )
    try:
        runner_pids = asyncio.run(_wait_for_members(settings, runners.pid, workers))
        processes = dict(stack.read_stack(settings).pids)  # type: ignore[union-attr]
        for index, pid in enumerate(runner_pids):
            processes[f"runner{index}"] = pid
        if broker_pid is not None:
            processes["broker"] = broker_pid
        return asyncio.run(_phase(settings, inputs, 900, processes))
    finally:
        stop_role(runners, timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=2_000, help="rollouts of the trivial agent")
    parser.add_argument("--span-rollouts", type=int, default=200, help="rollouts of the span-heavy agent")
    parser.add_argument("--spans", type=int, default=100, help="spans per span-heavy rollout")
    parser.add_argument("--workers", type=int, default=4, help="runner processes")
    parser.add_argument("--concurrency", type=int, default=16, help="attempts per runner process")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/runners.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="agl-bench-runners-") as tmp:
        settings = Settings(
            data_dir=Path(tmp), gateway_port=0, topic_prefix=f"b{uuid.uuid4().hex[:6]}", log_level="WARNING"
        )
        if settings.uses_local_broker:
            port, controller = free_ports(2)
            settings = settings.model_copy(update={"kafka_port": port, "kafka_controller_port": controller})
        stack.up(settings)
        try:
            running = stack.local_stack_settings(settings)
            broker_pid = broker.status(settings).pid if settings.uses_local_broker else None
            results = {
                "workers": args.workers,
                "concurrency": args.concurrency,
                "trivial": _run_phase(
                    running,
                    "benchmarks.bench_agents:trivial",
                    args.workers,
                    args.concurrency,
                    [{"i": i} for i in range(args.rollouts)],
                    broker_pid,
                ),
                "spans": _run_phase(
                    running,
                    "benchmarks.bench_agents:chatty",
                    args.workers,
                    args.concurrency,
                    [{"spans": args.spans} for _ in range(args.span_rollouts)],
                    broker_pid,
                ),
            }
        finally:
            stack.down(settings)
    print(json.dumps(results, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
