"""Capacity figures: the store benchmark with 1, 2 or 4 rollout processor instances on 1 or 3 brokers.

Each configuration gets a fresh local stack: a broker (or a three-node KRaft cluster, with the
topics at replication 3 and min.insync.replicas 2), the roles ``agl-stream up`` starts, and
``--processors - 1`` extra processor instances in the same consumer group. Then the work of
``benchmarks/compare_seed.py`` runs against it (enqueue, runners claim, add spans, finish;
the algorithm waits), and one row per configuration shows rollouts/s, spans/s and CPU per
rollout over the stack's own processes (every broker node and processor instance included).

On a 2-core machine more instances cannot go faster: the point is what replication and the
extra members cost, not speed-up. Run:

    python benchmarks/scale.py                      # brokers 1,3 x processors 1,2,4
    python benchmarks/scale.py --brokers 3 --processors 2 --rollouts 2000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# A sibling script, imported the way it imports its own siblings (its folder is sys.path[0]).
from compare_seed import Store, Workload, run_workload  # type: ignore[import-not-found]
from rich.console import Console
from rich.table import Table

console = Console()
COMPARE_SEED = Path(__file__).resolve().parent / "compare_seed.py"


@contextlib.contextmanager
def scaled_store(logs: Path, brokers: int, processors: int) -> Iterator[Store]:
    """A local stack on ``brokers`` nodes with ``processors`` rollout processor instances."""
    from agl_stream.config import Settings
    from agl_stream.kafka import broker
    from agl_stream.local import stack
    from agl_stream.local.processes import start_role, stop_role
    from agl_stream.ports import free_port_run

    with tempfile.TemporaryDirectory(prefix="agl-bench-scale-") as tmp:
        first = free_port_run(2 * brokers)
        settings = Settings(
            kafka_bootstrap=None,
            data_dir=Path(tmp),
            gateway_port=0,
            topic_prefix=f"s{uuid.uuid4().hex[:6]}",
            log_level="WARNING",
            kafka_brokers=brokers,
            kafka_port=first,
            kafka_controller_port=first + 1,
        )
        extra = []
        try:
            with console.status(f"starting {brokers} broker(s) and the stack"):
                stack.up(settings, timeout=180)
            info = stack.read_stack(settings)
            assert info is not None
            live = stack.local_stack_settings(settings)
            processes = dict(info.pids)
            for node in broker.nodes_status(settings):
                assert node.pid is not None
                processes[f"broker-{node.node_id}"] = node.pid
            for n in range(2, processors + 1):
                # Own data dirs: each instance writes its ready file there.
                own = live.model_copy(update={"data_dir": Path(tmp) / f"processor-{n}"})
                process = start_role(own, "processor", log_path=logs / f"processor-{n}.log")
                extra.append(process)
                processes[f"processor-{n}"] = process.pid
                ready = own.run_dir / "processor.ready"
                deadline = time.monotonic() + 120
                while not ready.exists():
                    if process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"processor {n} did not start; see {logs / f'processor-{n}.log'}")
                    time.sleep(0.1)  # another process starting up
            options = live.model_dump(mode="json", exclude_none=True)
            yield Store(
                label=f"{brokers}b-{processors}p",
                client_command=[sys.executable, str(COMPARE_SEED), "--settings", json.dumps(options)],
                processes=processes,
                port=first,
                logs=logs,
            )
        finally:
            for process in extra:
                stop_role(process, timeout=30)
            stack.down(settings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--brokers", default="1,3", help="broker counts to try, comma separated")
    parser.add_argument("--processors", default="1,2,4", help="rollout processor instances to try")
    parser.add_argument("--rollouts", type=int, default=1000)
    parser.add_argument("--runner-processes", type=int, default=2)
    parser.add_argument("--runners-per-process", type=int, default=8)
    parser.add_argument("--spans", type=int, default=5, help="spans per rollout (1 KB each)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    work = Workload(
        rollouts=args.rollouts,
        runner_processes=args.runner_processes,
        runners_per_process=args.runners_per_process,
        spans=args.spans,
        probes=20,
    )
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="agl-bench-scale-logs-") as logs_dir:
        for brokers in (int(b) for b in args.brokers.split(",")):
            for processors in (int(p) for p in args.processors.split(",")):
                title = f"{brokers} broker(s), {processors} processor(s)"
                console.print(f"[bold]{title}[/bold]: {work.rollouts:,} rollouts")
                try:
                    with scaled_store(Path(logs_dir), brokers, processors) as store:
                        result = asyncio.run(run_workload(store, work, title))
                except Exception as error:  # report it and go on with the next configuration
                    console.print(f"[red]{title} failed:[/red] {type(error).__name__}: {error}")
                    result = {"error": f"{type(error).__name__}: {error}"}
                rows.append({"brokers": brokers, "processors": processors, **result})
    table = Table(title=f"{work.rollouts:,} rollouts, {work.runner_processes * work.runners_per_process} runners")
    for column in ("brokers", "processors", "rollouts/s", "spans/s", "CPU ms/rollout (stack)", "of it: brokers"):
        table.add_column(column, justify="right")
    for row in rows:
        if "error" in row:
            table.add_row(str(row["brokers"]), str(row["processors"]), "failed", "", "", "")
            continue
        broker_cpu = sum(s for name, s in row["cpu_seconds"].items() if name.startswith("broker"))
        table.add_row(
            str(row["brokers"]),
            str(row["processors"]),
            f"{row['rollouts_per_s']:.1f}",
            f"{row['rollouts_per_s'] * work.spans:.0f}",
            f"{row['cpu_ms_per_rollout']['store_side']:.1f}",
            f"{broker_cpu / work.rollouts * 1e3:.1f}",
        )
    console.print(table)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
