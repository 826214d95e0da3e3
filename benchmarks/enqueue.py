"""enqueue_many_rollouts on the whole local stack, nothing else running: rollouts/s and CPU per rollout.

The stack as `agl-stream up` starts it (broker on free ports, processor, gateway with chDB,
ingress); one client enqueues ``--rollouts`` rollouts with ``enqueue_many_rollouts`` in calls of
``--batch`` (each call returns once the processor folded every rollout in it, as the store
contract says); no runner claims them. Reported: rollouts/s inside the calls, CPU microseconds
per rollout for each process (the client is this script) over the calls, and for the gateway
also until its sinks have written every rollout (the rollouts table is what `query_rollouts`
reads). ``--profile DIR`` records the processor, the gateway and the client with py-spy
(their CPU figures then include the sampler's cost). The queue limit
(``AGL_MAX_QUEUED_PER_PARTITION``) is raised for the run.

Run: `python benchmarks/enqueue.py --rollouts 20000 --batch 1000`. JSON results go to
benchmarks/results/enqueue.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from _measure import bench_settings, cpu_seconds, profiled, tree_cpu_seconds  # type: ignore[import-not-found]

from agl_stream import connect
from agl_stream.kafka import broker
from agl_stream.local import stack


def _cpu(processes: dict[str, int]) -> dict[str, float]:
    return {
        name: cpu_seconds(pid) if name in ("supervisor", "client") else tree_cpu_seconds(pid)
        for name, pid in processes.items()
    }


async def _enqueue(
    options: dict[str, Any], rollouts: int, batch: int, processes: dict[str, int], profile: Path | None
) -> dict[str, Any]:
    store = await connect(**options)
    try:
        await store.enqueue_many_rollouts([{"input": {"warm": i}} for i in range(min(batch, 100))])
        before = _cpu(processes)
        started = time.perf_counter()
        made = 0
        with contextlib.ExitStack() as spies:
            for name in ("processor", "gateway", "client") if profile else ():
                spies.enter_context(profiled(processes[name], profile, name))
            while made < rollouts:
                count = min(batch, rollouts - made)
                await store.enqueue_many_rollouts([{"input": {"i": made + i, "task": "x" * 64}} for i in range(count)])
                made += count
        seconds = time.perf_counter() - started
        after = _cpu(processes)
        # The read side: a count is fenced on this client's writes, so it returns once the
        # gateway's sinks wrote every rollout.
        counted = await store.count_rollouts(status_in=["queuing"])
        queryable_s = time.perf_counter() - started
        sinks = _cpu(processes)
    finally:
        await store.close()
    per = {name: round((after[name] - before[name]) / made * 1e6, 1) for name in processes}
    return {
        "rollouts": made,
        "rollouts_queryable": counted,
        "batch": batch,
        "seconds": round(seconds, 3),
        "rollouts_per_s": round(made / seconds, 1),
        "cpu_us_per_rollout": per,
        "cpu_us_per_rollout_total": round(sum(per.values()), 1),
        "queryable_seconds": round(queryable_s, 3),
        "gateway_cpu_us_per_rollout_until_queryable": round((sinks["gateway"] - before["gateway"]) / made * 1e6, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument(
        "--profile", type=Path, default=None, help="py-spy the processor, gateway and client into this folder"
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "enqueue.json")
    args = parser.parse_args()
    os.environ.setdefault("AGL_MAX_QUEUED_PER_PARTITION", str(max(50_000, args.rollouts * 2)))
    with tempfile.TemporaryDirectory(prefix="agl-bench-enqueue-") as tmp:
        settings = bench_settings(Path(tmp), "e")
        try:
            info = stack.up(settings)
            processes = dict(info.pids)
            broker_pid = broker.status(settings).pid if settings.uses_local_broker else None
            if broker_pid is not None:
                processes["broker"] = broker_pid
            processes["client"] = os.getpid()
            live = stack.local_stack_settings(settings)
            options = live.model_dump(mode="json", exclude_none=True)
            result = asyncio.run(_enqueue(options, args.rollouts, args.batch, processes, args.profile))
        finally:
            stack.down(settings)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
