"""The dashboard's endpoints over 1,000,000 spans: how long each page's queries take.

Loads the same synthetic data as benchmarks/sql_cookbook.py (``--spans`` spans in attempts of
18, ~50,000 rollouts with retries, triplets, batches, workers) into a fresh embedded ClickHouse,
then times what each page asks for through the gateway's read-only query pool (QueryRunner, the
clients ``/v1/query`` and ``/v1/dashboard/...`` use, with the analytics checks) and the same
shaping code the endpoints run (consumers.dashboard.DashboardQueries): the overview, the
rollouts page (first page, a filtered page, a deep page), one rollout, one attempt's spans and
waterfall, the schema. One warm-up, then ``--runs`` timed runs; p50 and max are reported. The
goal is under a second per page.

``--rollouts N`` also fills the rollouts table up to N rows (paging over millions of rollouts).

Run: `python benchmarks/dashboard.py [--spans 1000000] [--rollouts 2000000]`; JSON to
benchmarks/results/dashboard.json (or ``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from sql_cookbook import GROUPS, ROLLOUTS_SQL, load  # type: ignore[import-not-found]

from agl_stream.clickhouse.client import get_client
from agl_stream.config import Settings
from consumers import dashboard_sql as dsql
from consumers.dashboard import DashboardQueries
from consumers.gateway import QueryRunner

ROOT = Path(__file__).resolve().parents[1]


async def measure(settings: Settings, runs: int) -> list[dict[str, Any]]:
    runner = QueryRunner(settings, size=4, time_limit_s=30)
    runner.open()
    queries = DashboardQueries(runner, settings.clickhouse_database)
    # A rollout in the middle of the data, with a retried first attempt (every 11th attempt fails).
    rollout_id, attempt_id = "ro-000025000", "at-000027500"
    pages: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
        ("overview (7 queries in parallel)", lambda: queries.overview(600)),
        ("rollouts: first page of 50", lambda: queries.rollouts(dsql.RolloutFilter())),
        (
            "rollouts: status=failed, mode=train, page 3",
            lambda: queries.rollouts(dsql.RolloutFilter(status="failed", mode="train", offset=100)),
        ),
        (
            "rollouts: time window, 200 rows",
            lambda: queries.rollouts(dsql.RolloutFilter(since=1767225600 + 1000, until=1767225600 + 1200, limit=200)),
        ),
        ("rollouts: deep page (offset 40,000)", lambda: queries.rollouts(dsql.RolloutFilter(offset=40_000))),
        ("one rollout (rollout, attempts, triplets)", lambda: queries.rollout(rollout_id)),
        ("one attempt's spans and waterfall", lambda: queries.spans(rollout_id, attempt_id)),
        ("schema of the agl database", queries.schema),
    ]
    results = []
    try:
        for name, page in pages:
            answer = await page()  # warm-up; also checks that it answers
            timings = []
            for _ in range(runs):
                started = time.perf_counter()
                await page()
                timings.append((time.perf_counter() - started) * 1000)
            results.append(
                {
                    "page": name,
                    "answer_bytes": len(json.dumps(answer)),
                    "p50_ms": round(statistics.median(timings), 1),
                    "max_ms": round(max(timings), 1),
                    "within_1s": statistics.median(timings) <= 1000,
                }
            )
            print(f"{results[-1]['p50_ms']:8.1f} ms (max {results[-1]['max_ms']:7.1f})  {name}", flush=True)
    finally:
        runner.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=1_000_000)
    parser.add_argument("--chunk", type=int, default=10_000, help="Spans per INSERT (the sink's batch size).")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--rollouts", type=int, default=0, help="Fill the rollouts table up to this many rows.")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "dashboard.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="agl-dashboard-bench-") as data_dir:
        settings = Settings(data_dir=Path(data_dir))
        loaded = load(settings, args.spans, args.chunk)
        if args.rollouts:
            # More rollouts than the spans' own (ids from 0, so those ones are the same rows again:
            # FINAL keeps one of each): the rollouts table at the size of a long-running cluster.
            client = get_client(settings)
            try:
                db = settings.clickhouse_database
                client.command(ROLLOUTS_SQL.format(db=db, groups=GROUPS, rollouts=args.rollouts))
                loaded["rows"]["rollouts_final"] = int(client.command(f"SELECT count() FROM {db}.rollouts FINAL"))  # type: ignore[arg-type]
            finally:
                client.close()
        print(json.dumps(loaded), flush=True)
        pages = asyncio.run(measure(settings, args.runs))
    report = {
        "spans": args.spans,
        "engine": "chDB (embedded), through the gateway's QueryRunner and DashboardQueries",
        "cpus": os.cpu_count(),
        "load_average_1m_at_end": os.getloadavg()[0],
        "runs_per_page": args.runs,
        "load": loaded,
        "pages": pages,
        "all_within_1s": all(p["within_1s"] for p in pages),
        "slowest_p50_ms": max(p["p50_ms"] for p in pages),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "pages"}, indent=2))


if __name__ == "__main__":
    main()
