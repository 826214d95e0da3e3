"""The broker's JIT on a broker kept under load: CPU per rollout round after round, C1 only or tiered.

For each ``--jit`` (``c1``: ``-XX:TieredStopAtLevel=1``; ``tiered``: Java's default, C1 then C2),
a fresh local stack (`agl-stream up`: broker on free ports, processor, gateway, ingress) runs
``--rounds`` rounds of ``--per-round`` rollouts: an algorithm enqueues them in calls of 500 while
``--runners`` runner coroutines on two store clients (this process) claim each one with the
runner's long poll and mark it succeeded. Reported per round: rollouts/s and CPU milliseconds per
rollout of the broker, the processor and the gateway. The first rounds show the JIT's own work
(tiered: C2 compiling), the later ones what a long-lived broker costs.

Run: `python benchmarks/broker_jit.py [--jit both --rounds 8 --per-round 4000]`; JSON to
benchmarks/results/broker_jit.json.
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

from _measure import bench_settings, tree_cpu_seconds  # type: ignore[import-not-found]

from agl_stream import AglStore, connect
from agl_stream.kafka import broker
from agl_stream.local import stack


async def _rounds(
    options: dict[str, Any], pids: dict[str, int], rounds: int, per_round: int, runners: int
) -> list[Any]:
    algorithm = await connect(**options)
    clients = [await connect(**options) for _ in range(2)]
    results = []
    try:
        for index in range(rounds):
            done = 0

            async def runner(store: AglStore, worker: str) -> None:
                nonlocal done
                while done < per_round:
                    claimed = await store.dequeue_rollout(worker_id=worker, wait=1.0)
                    if claimed is not None:
                        await store.update_attempt(claimed.rollout_id, claimed.attempt.attempt_id, status="succeeded")
                        done += 1

            before = {name: tree_cpu_seconds(pid) for name, pid in pids.items()}
            started = time.perf_counter()
            working = [asyncio.create_task(runner(clients[i % 2], f"w-{i}")) for i in range(runners)]
            for first in range(0, per_round, 500):
                count = min(500, per_round - first)
                await algorithm.enqueue_many_rollouts([{"input": {"i": first + i}} for i in range(count)])
            await asyncio.gather(*working)
            seconds = time.perf_counter() - started
            row: dict[str, Any] = {
                f"{name}_cpu_ms_per_rollout": round((tree_cpu_seconds(pid) - before[name]) / done * 1000, 3)
                for name, pid in pids.items()
            }
            row = {"round": index + 1, "rollouts_per_s": round(done / seconds, 1), **row}
            print(json.dumps(row), flush=True)
            results.append(row)
    finally:
        for client in (algorithm, *clients):
            await client.close()
    return results


def run(jit: str, args: argparse.Namespace) -> list[Any]:
    os.environ["AGL_MAX_QUEUED_PER_PARTITION"] = str(max(50_000, 2 * args.per_round))
    with tempfile.TemporaryDirectory(prefix="agl-bench-jit-") as tmp:
        settings = bench_settings(Path(tmp), "j").model_copy(update={"kafka_jit": jit})
        try:
            info = stack.up(settings)
            pids = {"broker": broker.status(settings).pid or 0, **{r: info.pids[r] for r in ("processor", "gateway")}}
            options = stack.local_stack_settings(settings).model_dump(mode="json", exclude_none=True)
            return asyncio.run(_rounds(options, pids, args.rounds, args.per_round, args.runners))
        finally:
            stack.down(settings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jit", choices=["c1", "tiered", "both"], default="both")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--per-round", type=int, default=4000)
    parser.add_argument("--runners", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "broker_jit.json")
    args = parser.parse_args()
    report = {}
    for jit in ("c1", "tiered") if args.jit == "both" else (args.jit,):
        print(f"== {jit}", flush=True)
        report[jit] = run(jit, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
