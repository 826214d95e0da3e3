"""What an idle stack costs: CPU per process with no client at all, and with idle runners.

Starts the local stack (`agl-stream up`: broker, processor, gateway, ingress; ``--training``
adds the triplet builder and the batcher), lets it settle, then measures each process's CPU over
``--seconds``: first with no client, then with ``--runners`` runner coroutines in one process
long-polling an empty queue (``dequeue_rollout(wait=...)``, as `agl-stream runner` claims), each
with its periodic heartbeat. Prints % of one core per process and in all, and each window's
Kafka requests per second by role and API (from the roles' /metrics), and, with no client,
each process's busiest threads by name (``/proc/<pid>/task``: where a JVM's idle CPU goes,
its compilers, request handlers, purgatory reapers); JSON to benchmarks/results/idle.json.

Run: ``python benchmarks/idle.py`` (``--seconds 30 --runners 8 --training``).
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

from _measure import (  # type: ignore[import-not-found]
    busiest_threads,
    cpu_seconds,
    scrape_counts,
    thread_cpu_seconds,
    tree_cpu_seconds,
)

from agl_stream import connect, metrics
from agl_stream.config import Settings
from agl_stream.kafka import broker
from agl_stream.local import stack
from agl_stream.ports import free_ports

RESULTS = Path(__file__).resolve().parent / "results" / "idle.json"


def _cpu(processes: dict[str, int]) -> dict[str, float]:
    return {
        name: cpu_seconds(pid) if name == "supervisor" else tree_cpu_seconds(pid) for name, pid in processes.items()
    }


async def _measure(
    processes: dict[str, int], metrics_dir: Path, seconds: float
) -> tuple[dict[str, float], Any, dict[str, dict[str, float]]]:
    """% of a core per process over the window, Kafka requests per second by role and API, and
    each process's busiest threads (% of a core by thread name)."""
    requests_before = scrape_counts(metrics_dir)["kafka_requests"]
    threads_before = {name: thread_cpu_seconds(pid) for name, pid in processes.items()}
    own_before = {name: cpu_seconds(pid) for name, pid in processes.items()}
    before, began = _cpu(processes), time.monotonic()
    await asyncio.sleep(seconds)  # the measured window itself
    after, took = _cpu(processes), time.monotonic() - began
    threads = {
        name: busiest_threads(threads_before[name], thread_cpu_seconds(pid), took, cpu_seconds(pid) - own_before[name])
        for name, pid in processes.items()
    }
    requests_after = scrape_counts(metrics_dir)["kafka_requests"]
    rates = {
        key: round((n - requests_before.get(key, 0.0)) / took, 2)
        for key, n in sorted(requests_after.items())
        if n > requests_before.get(key, 0.0)
    }
    cpu = {name: round((after[name] - before[name]) / took * 100, 2) for name in processes}
    return cpu, {"all": round(sum(rates.values()), 1), **rates}, threads


async def _idle_runners(settings: Settings, runners: int, stop: asyncio.Event) -> None:
    async with connect(**settings.model_dump(exclude_none=True)) as store:

        async def runner(worker_id: str) -> None:
            while not stop.is_set():
                claimed = await store.dequeue_rollout(worker_id=worker_id, wait=5.0)
                if claimed is not None:
                    raise RuntimeError("the queue was meant to stay empty")

        async def beats() -> None:
            while not stop.is_set():
                await store.beat([], worker_id="idle-0")
                await asyncio.sleep(10)  # the runner's heartbeat period

        tasks = [asyncio.create_task(runner(f"idle-{i}")) for i in range(runners)] + [asyncio.create_task(beats())]
        await stop.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def measure(settings: Settings, processes: dict[str, int], args: argparse.Namespace) -> dict[str, Any]:
    live = stack.local_stack_settings(settings)
    metrics_dir = settings.run_dir / metrics.ENDPOINTS_DIR
    await asyncio.sleep(args.settle)  # starts and first flushes out of the window
    quiet, quiet_requests, quiet_threads = await _measure(processes, metrics_dir, args.seconds)
    stop = asyncio.Event()
    clients = asyncio.create_task(_idle_runners(live, args.runners, stop))
    await asyncio.sleep(args.settle)
    polled, polled_requests, _ = await _measure(processes, metrics_dir, args.seconds)
    stop.set()
    await clients
    return {
        "seconds": args.seconds,
        "runners": args.runners,
        "training": args.training,
        "cpu_percent_no_client": {**quiet, "all": round(sum(quiet.values()), 2)},
        "cpu_percent_idle_runners": {**polled, "all": round(sum(polled.values()), 2)},
        "kafka_requests_per_second_no_client": quiet_requests,
        "kafka_requests_per_second_idle_runners": polled_requests,
        # Where an idle process's CPU goes (a JVM's compiler, request handlers, reapers...).
        "busiest_threads_percent_no_client": quiet_threads,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0, help="length of each measured window")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds before each window")
    parser.add_argument("--runners", type=int, default=8, help="idle runner coroutines in the second window")
    parser.add_argument("--training", action="store_true", help="also run the triplet builder and the batcher")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="agl-bench-idle-") as tmp:
        settings = Settings(data_dir=Path(tmp), gateway_port=0, topic_prefix=f"i{uuid.uuid4().hex[:6]}")
        port, controller = free_ports(2)
        settings = settings.model_copy(update={"kafka_port": port, "kafka_controller_port": controller})
        stack.up(settings, training=args.training)
        try:
            info = stack.read_stack(settings)
            assert info is not None
            processes = dict(info.pids)
            status = broker.status(settings)
            if status.pid is not None:
                processes["broker"] = status.pid
            result = asyncio.run(measure(settings, processes, args))
        finally:
            stack.down(settings)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
