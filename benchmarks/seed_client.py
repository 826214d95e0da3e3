"""The seed's own store benchmark client against the seed's server and against agl-stream's ``/v1/agl``.

Agent Lightning 0.3.0 ships a store benchmark in its repository (``tests/benchmark/benchmark_store.py``,
not in its wheel): an algorithm enqueues rollouts one ``enqueue_rollout`` call at a time and polls
them, ``--n-runners`` unmodified runner processes (its ``Trainer`` with the client-server strategy)
claim them and run an agent whose spans go through the seed's tracer (OTLP to ``/v1/traces``) and
whose rewards go through ``/v1/agl``. This script runs that client, unmodified and in the seed's
virtualenv, first against a local agl-stream stack's gateway, then against the seed's ``agl store``,
and reports per side the wall time and the CPU seconds of every store-side process over the run.

The benchmark is read from a checkout of the agent-lightning repository (``--checkout``: a work
tree or a bare git directory; its ``v0.3.0`` tag is used when it is a git repository) into a
temporary folder; nothing of it is kept. ``--profile DIR`` also records the gateway with py-spy
(a flame graph per run, ``DIR/gateway.svg``, and raw samples ``DIR/gateway.txt``).

Run: ``python benchmarks/seed_client.py --checkout PATH [--total-tasks 256 --n-runners 8]``;
JSON goes to benchmarks/results/seed_client.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _measure import (  # type: ignore[import-not-found]
    busiest_threads,
    cpu_seconds,
    profiled,
    thread_cpu_seconds,
    tree_cpu_seconds,
)
from compare_seed import (  # type: ignore[import-not-found]
    HERE,
    Store,
    _cpu,
    agl_store,
    console,
    per_rollout,
    scrape_counts,
    seed_store,
)

sys.path.insert(0, str(HERE.parent))
from tests.seed_venv import SEED_CHILD_ENV, ensure_seed_venv

FILES = ("benchmark_store.py", "utils.py")
TAG = "v0.3.0"


def extract_benchmark(checkout: Path, into: Path) -> Path:
    """The seed's benchmark package under ``into`` (``tests/benchmark``), from a work tree or a git directory."""
    package = into / "tests" / "benchmark"
    package.mkdir(parents=True)
    (into / "tests" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    for name in FILES:
        tree_file = checkout / "tests" / "benchmark" / name
        if tree_file.is_file() and not (checkout / "HEAD").exists():
            (package / name).write_text(tree_file.read_text())
            continue
        shown = subprocess.run(
            [
                "git",
                "--git-dir",
                str(checkout if (checkout / "HEAD").exists() else checkout / ".git"),
                "show",
                f"{TAG}:tests/benchmark/{name}",
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if shown.returncode != 0:
            raise SystemExit(f"cannot read tests/benchmark/{name} at {TAG} from {checkout}: {shown.stderr.strip()}")
        (package / name).write_text(shown.stdout)
    return into


def run_client(store: Store, url: str, bench: Path, args: argparse.Namespace, profile: Path | None) -> dict[str, Any]:
    python = ensure_seed_venv()
    before = _cpu(store.processes)
    threads_before = {name: thread_cpu_seconds(pid) for name, pid in store.processes.items()}
    own_before = {name: cpu_seconds(pid) for name, pid in store.processes.items()}
    counts_before = scrape_counts(store.metrics_dir)
    command = [
        str(python),
        "-m",
        "tests.benchmark.benchmark_store",
        "--store-url",
        url,
        "--mode",
        args.mode,
        "--total-tasks",
        str(args.total_tasks),
        "--n-runners",
        str(args.n_runners),
        "--batch-size",
        str(args.batch_size),
        "--max-rounds",
        str(args.max_rounds),
        "--sleep-seconds",
        str(args.sleep_seconds),
    ]
    log = store.logs / f"{store.label}-client.log"
    gateway = store.processes.get("gateway")
    started = time.monotonic()
    client_cpu = 0.0
    with log.open("wb") as handle, profiled(gateway, profile, "gateway") if gateway else contextlib.nullcontext():
        client = subprocess.Popen(
            command, cwd=bench, stdout=handle, stderr=subprocess.STDOUT, env={**os.environ, **SEED_CHILD_ENV}
        )
        while client.poll() is None:
            client_cpu = max(client_cpu, tree_cpu_seconds(client.pid))  # its runners are gone once it exits
            time.sleep(0.5)  # sampling a child's CPU
    wall = time.monotonic() - started
    if client.returncode != 0:
        raise RuntimeError(f"the seed's benchmark exited {client.returncode}:\n{log.read_text()[-3000:]}")
    cpu = {name: round(seconds - before[name], 2) for name, seconds in _cpu(store.processes).items()}
    # Where each store-side process spent it, by thread name: a gateway's Python threads are all
    # "python", the embedded ClickHouse engine's have their own names; a broker's its handlers.
    threads = {
        name: busiest_threads(
            threads_before[name], thread_cpu_seconds(pid), wall, cpu_seconds(pid) - own_before[name], top=6
        )
        for name, pid in store.processes.items()
    }
    store_cpu = sum(cpu.values())
    counts = per_rollout(counts_before, scrape_counts(store.metrics_dir), args.total_tasks)
    console.print(f"{store.label}: {wall:.1f} s, store side {store_cpu:.1f} CPU-s {cpu}")
    return {
        "wall_s": round(wall, 1),
        "store_cpu_s": round(store_cpu, 2),
        "store_cpu_s_by_process": cpu,
        "store_cpu_ms_per_rollout": round(1000 * store_cpu / args.total_tasks, 1),
        "client_cpu_s_at_least": round(client_cpu, 1),
        "counts_per_rollout": counts,
        "busiest_threads_percent": threads,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkout", type=Path, required=True, help="the agent-lightning repository (tag v0.3.0)")
    parser.add_argument("--mode", choices=("batch", "batch_partial", "single"), default="batch")
    parser.add_argument("--total-tasks", type=int, default=256)
    parser.add_argument("--n-runners", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--max-rounds", type=int, default=10)
    parser.add_argument("--sleep-seconds", type=float, default=1.0)
    parser.add_argument("--only", choices=("agl", "seed", "both"), default="both")
    parser.add_argument("--profile", type=Path, default=None, help="py-spy the gateway into this folder")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "seed_client.json")
    args = parser.parse_args()
    report: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items() if k not in ("checkout", "out", "profile")}
    }
    report["config"]["cpus"] = os.cpu_count()
    with tempfile.TemporaryDirectory(prefix="agl-bench-seed-client-") as tmp:
        bench = extract_benchmark(args.checkout, Path(tmp) / "bench")
        logs = Path(tmp)
        if args.only in ("agl", "both"):
            with agl_store(logs) as store:
                assert store.url is not None
                report["agl-stream"] = run_client(store, store.url, bench, args, args.profile)
        if args.only in ("seed", "both"):
            with seed_store(logs) as store:
                assert store.url is not None
                report["seed"] = run_client(store, store.url, bench, args, None)
    agl, seed = report.get("agl-stream"), report.get("seed")
    if agl and seed:
        report["ratio_agl_over_seed"] = {
            "speed": round(seed["wall_s"] / agl["wall_s"], 2),
            "store_cpu": round(agl["store_cpu_s"] / seed["store_cpu_s"], 2),
        }
        console.print(
            f"agl-stream / seed: speed {report['ratio_agl_over_seed']['speed']}x, "
            f"store CPU {report['ratio_agl_over_seed']['store_cpu']}x"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    console.print(f"results: {args.out}")


if __name__ == "__main__":
    main()
