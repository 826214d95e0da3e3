"""A long run: memory and disk of every role over many rollouts with spans.

Starts the local stack with the training data path (broker unless AGL_KAFKA_BOOTSTRAP,
processor, gateway with chDB, ingress, triplet builder, batcher) and ``--workers`` runner
processes running ``benchmarks.bench_agents:two_calls`` (two LLM-call spans with token ids and
a reward span: every rollout becomes triplets). It keeps ``--window`` rollouts in flight,
enqueued in chunks, and every ``--every`` finished rollouts samples each process's resident
memory (VmRSS; the supervisor's roles by their current pids, each runner process, the broker's
JVM) and the data dir's size on disk. The verdict: no role's RSS keeps growing (its last sample
no more than ``--growth`` times its sample at the first mark, after the caches warmed).

Run: `python benchmarks/soak.py [--rollouts 100000] [--every 10000]`; JSON to
benchmarks/results/soak.json, a line per sample as it goes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from _measure import bench_settings, descendants  # type: ignore[import-not-found]

from agl_stream import connect
from agl_stream.config import Settings
from agl_stream.kafka import broker
from agl_stream.local import stack
from agl_stream.local.processes import start_role, stop_role
from agl_stream.local.supervisor import read_status

CHUNK = 500  # rollouts per enqueue call


def rss_mib(pid: int) -> float | None:
    """Resident memory of a process in MiB (None when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def disk_mib(folder: Path) -> float:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
    return total / (1 << 20)


def processes(settings: Settings, runners_pid: int, broker_pid: int | None) -> dict[str, int]:
    """Every process of the run by name, with the pids running now (the supervisor restarts)."""
    found = {role: state.pid for role, state in read_status(settings.run_dir).items() if state.pid is not None}
    for index, pid in enumerate(p for p in descendants(runners_pid) if p != runners_pid):
        found[f"runner-{index}"] = pid
    if broker_pid is not None:
        found["broker"] = broker_pid
    return found


def sample(settings: Settings, done: int, started: float, runners_pid: int, broker_pid: int | None) -> dict[str, Any]:
    rss = {name: rss_mib(pid) for name, pid in processes(settings, runners_pid, broker_pid).items()}
    restarts = {role: state.restarts for role, state in read_status(settings.run_dir).items()}
    return {
        "rollouts": done,
        "seconds": round(time.monotonic() - started, 1),
        "rss_mib": {name: round(value, 1) for name, value in rss.items() if value is not None},
        "data_dir_mib": round(disk_mib(settings.data_dir), 1),
        "restarts": {role: n for role, n in restarts.items() if n},
    }


async def drive(
    settings: Settings, total: int, every: int, window: int, runners_pid: int, broker_pid: int | None
) -> dict[str, Any]:
    samples: list[dict[str, Any]] = []
    succeeded = 0
    started = time.monotonic()
    async with connect(**settings.model_dump(exclude_none=True)) as store:
        pending: list[list[str]] = []  # chunks in flight, oldest first
        sent = finished = 0
        next_mark = every
        while finished < total:
            while sent < total and (sent - finished) < window:
                count = min(CHUNK, total - sent)
                made = await store.enqueue_many_rollouts([{"input": {"i": sent + i}} for i in range(count)])
                pending.append([r.rollout_id for r in made])
                sent += count
            waiting = pending.pop(0)
            while waiting:
                done = await store.wait_for_rollouts(rollout_ids=waiting, timeout=30)
                succeeded += sum(r.status == "succeeded" for r in done)
                closed = {r.rollout_id for r in done}
                waiting = [rid for rid in waiting if rid not in closed]
                finished += len(closed)
            if finished >= next_mark or finished >= total:
                point = sample(settings, finished, started, runners_pid, broker_pid)
                samples.append(point)
                rate = finished / max(point["seconds"], 1e-9)
                print(json.dumps(point | {"rollouts_per_s": round(rate, 1)}), flush=True)
                next_mark += every
    return {"samples": samples, "succeeded": succeeded, "seconds": round(time.monotonic() - started, 1)}


def verdict(samples: list[dict[str, Any]], growth: float) -> dict[str, Any]:
    """Each process's RSS at the first mark and at the end, and whether it stayed within ``growth``x."""
    if len(samples) < 2:
        return {}
    first, last = samples[0]["rss_mib"], samples[-1]["rss_mib"]
    per_role = {
        name: {"first_mib": first[name], "last_mib": last[name], "ratio": round(last[name] / first[name], 2)}
        for name in sorted(first)
        if name in last and first[name]
    }
    grew = [name for name, seen in per_role.items() if seen["ratio"] > growth]
    span = samples[-1]["rollouts"] - samples[0]["rollouts"]
    disk = (samples[-1]["data_dir_mib"] - samples[0]["data_dir_mib"]) / max(span / 1000, 1e-9)
    return {"per_role": per_role, "grew": grew, "bounded": not grew, "disk_mib_per_1k_rollouts": round(disk, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=100_000, help="rollouts in all")
    parser.add_argument("--every", type=int, default=10_000, help="rollouts between samples")
    parser.add_argument("--window", type=int, default=2_000, help="rollouts in flight at most")
    parser.add_argument("--workers", type=int, default=2, help="runner processes")
    parser.add_argument("--concurrency", type=int, default=16, help="attempts per runner process")
    parser.add_argument("--growth", type=float, default=1.5, help="largest last/first RSS ratio counted as bounded")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/soak.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="agl-bench-soak-") as tmp:
        settings = bench_settings(Path(tmp), "soak")
        stack.up(settings, training=True)
        try:
            running = stack.local_stack_settings(settings)
            broker_pid = broker.status(settings).pid if settings.uses_local_broker else None
            runners = start_role(
                running,
                "runner",
                "--agent",
                "benchmarks.bench_agents:two_calls",
                "--workers",
                str(args.workers),
                "--concurrency",
                str(args.concurrency),
                log_path=settings.data_dir / "runners.log",
            )
            try:
                run = asyncio.run(drive(running, args.rollouts, args.every, args.window, runners.pid, broker_pid))
            finally:
                stop_role(runners, timeout=60)
        finally:
            stack.down(settings)
    results = {"options": {k: str(v) for k, v in vars(args).items()}, **run, **verdict(run["samples"], args.growth)}
    print(json.dumps({k: v for k, v in results.items() if k != "samples"}, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
