"""``transition`` against ``trajectory`` aggregation on a multi-turn task, trained on this CPU.

The keypad example (``examples/keypad``: three model calls per rollout, the keypad's feedback
inserted between them, reward = mean digit fraction of the three answers) is trained by the
demo's loop of roles (:func:`agl_stream.demo.loop.running_loop`: stack, triplet builder,
batcher with GRPO groups of ``--group`` and batches of ``--groups`` groups, trainer with the
torch backend and the tiny policy, CPU inference, LLM proxy, runner; learning rate 0.05 as the
RL loop test trains: the demo's 0.01 moves the tiny policy little in 8 versions), once with
``agl-stream triplets --aggregation transition`` and once with ``--aggregation trajectory``;
everything else is the same (the same initial weights, seed 0; sampling is not seeded and the
loop is asynchronous, so the runs are not replicas).

Per mode it reports, from ClickHouse:

* per policy version trained (``trainer_steps`` joined with ``batches``): rollouts in the
  batch, samples (training rows), tokens (prompt + response, inserted ones included), loss
  tokens (generated ones), the step's seconds and when the version was published (seconds
  since the first task was enqueued);
* per policy version that ran rollouts (``triplet_records``): rollouts and their mean reward;
* overall: samples per rollout and tokens per sample over every record the triplet builder
  wrote (``triplet_records``), and the wall time to the last version.

* the attempts that failed (an agent call that failed fails its attempt) and, with
  ``--engine vllm``, the inference role's hand-off counters (``/health``: switches, calls held,
  retried, cut and refused, the longest pause, the longest hold of one call).

Run: ``python benchmarks/aggregation.py [--versions 8] [--modes transition trajectory]``; JSON to
benchmarks/results/aggregation.json. Each mode starts its own local stack in a temporary data
dir (unless AGL_KAFKA_BOOTSTRAP names a cluster) and stops everything it started.

On a GPU (``scripts/gpu_check_loop.sh`` runs it so): ``--backend verl --engine vllm --model-path
FOLDER`` trains an HF model folder with VERL's FSDP engine and serves every version with vLLM
behind the hand-off gate (``--vllm-arg=--gpu-memory-utilization=0.3`` leaves the trainer room).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from _measure import bench_settings  # type: ignore[import-not-found]
from rich.console import Console
from rich.table import Table

from agl_stream.config import Settings
from agl_stream.demo import loop
from agl_stream.ports import free_ports
from agl_stream.store.client import AglStore

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the examples are imported from the repository root
from examples.keypad import keypad_agent  # noqa: E402

AGENT = "examples.keypad.keypad_agent:keypad_agent"
# The runner imports the example from the repository root.
RUNNER_ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
MODEL = loop.MODEL

TRAINED_BY_VERSION = (
    "SELECT s.policy_version, b.n_records, s.samples, s.tokens, s.metrics['response_tokens'], "
    "s.step_seconds, s.step_time FROM {db}.trainer_steps AS s FINAL "
    "INNER JOIN (SELECT batch_id, n_records FROM {db}.batches FINAL) AS b ON s.batch_id = b.batch_id "
    "ORDER BY s.policy_version"
)
REWARD_BY_VERSION = (
    "SELECT policy_version, count(), avg(final_reward) FROM {db}.triplet_records FINAL "
    "WHERE policy_version IS NOT NULL GROUP BY policy_version ORDER BY policy_version"
)
ATTEMPTS = "SELECT countIf(status = 'failed'), count() FROM {db}.attempts FINAL WHERE status IN ('succeeded', 'failed')"
RECORDS = (
    "SELECT count(), sum(n_triplets), sum(prompt_tokens + response_tokens), "
    "countIf(n_triplets > 1) FROM {db}.triplet_records FINAL"
)


async def _rows(store: AglStore, sql: str, settings: Settings) -> list[Any]:
    assert store.side is not None, "the store is started"
    return list((await store.side.query(sql.format(db=settings.clickhouse_database))).rows)


async def gate_counters(health_url: str) -> dict[str, Any]:
    """The inference role's hand-off counters (vLLM engine), or {} where its /health has none."""
    with contextlib.suppress(httpx.HTTPError, ValueError):
        async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
            handoff = (await http.get(health_url)).json().get("handoff")
            return dict(handoff) if isinstance(handoff, dict) else {}
    return {}


async def drive(
    settings: Settings, *, versions: int, minutes: float, group: int, groups: int, health_url: str
) -> dict[str, Any]:
    """Enqueue rounds of ``groups`` task groups (two rounds in flight, as the demo does) until the
    trainer published ``versions`` versions after version 0; then read what was trained."""
    tasks = keypad_agent.load_tasks(keypad_agent.TRAIN_FILE)
    store = await AglStore(settings).start()
    try:
        deadline = time.monotonic() + minutes * 60
        while (await store.get_latest_resources()) is None:
            if time.monotonic() > deadline:
                raise TimeoutError("the trainer never published policy version 0 (see logs/trainer.log)")
            await asyncio.sleep(0.2)
        started, started_wall = time.monotonic(), time.time()
        in_flight: list[asyncio.Task[Any]] = []
        round_no = version = 0
        while version < versions and time.monotonic() < deadline:
            while len(in_flight) < 2:
                requests = [
                    {
                        "input": tasks[(round_no * groups + g) % len(tasks)],
                        "mode": "train",
                        "metadata": {"group_id": f"keypad-{round_no}-{g}"},
                    }
                    for g in range(groups)
                    for _ in range(group)
                ]
                made = await store.enqueue_many_rollouts(requests)
                ids = [r.rollout_id for r in made]
                in_flight.append(asyncio.create_task(store.wait_for_rollouts(rollout_ids=ids, timeout=600)))
                round_no += 1
            await in_flight.pop(0)
            latest = await store.get_latest_resources()
            version = latest.version if latest is not None else 0
            print(f"  {time.monotonic() - started:6.0f}s  policy version {version}", flush=True)
        wall = time.monotonic() - started
        for task in in_flight:
            task.cancel()
        # The last step's row reaches ClickHouse through the sink: wait for it (bounded).
        trained: list[Any] = []
        waited = time.monotonic() + 120
        while time.monotonic() < waited:
            trained = await _rows(store, TRAINED_BY_VERSION, settings)
            if len(trained) >= version:
                break
            await asyncio.sleep(1)
        rewards = await _rows(store, REWARD_BY_VERSION, settings)
        records, samples, tokens, merged_more = (await _rows(store, RECORDS, settings))[0]
        failed_attempts, attempts = (await _rows(store, ATTEMPTS, settings))[0]
        gate = await gate_counters(health_url)
    finally:
        await store.close()
    return {
        "wall_s": round(wall, 1),
        "versions": version,
        "trained": [
            {
                "version": int(v),
                "rollouts": int(n),
                "samples": int(s),
                "tokens": int(t),
                "loss_tokens": int(lt),
                "step_s": round(float(ss), 2),
                "published_s": round(float(at) - started_wall, 1),
            }
            for v, n, s, t, lt, ss, at in trained
        ],
        "reward": [{"version": int(v), "rollouts": int(n), "mean": round(float(r), 4)} for v, n, r in rewards],
        "records": int(records),
        "samples_per_rollout": round(int(samples) / int(records), 3) if records else float("nan"),
        "tokens_per_sample": round(int(tokens) / int(samples), 1) if samples else float("nan"),
        "records_of_several_samples": int(merged_more),
        "attempts": int(attempts),
        "failed_attempts": int(failed_attempts),
        "gate": gate,
    }


def show(results: dict[str, dict[str, Any]], console: Console) -> None:
    modes = list(results)
    table = Table(title="trained per policy version (trainer_steps x batches)")
    table.add_column("version", justify="right")
    for mode in modes:
        for column in ("rollouts", "samples", "tokens", "loss tok", "published s"):
            table.add_column(f"{mode[:5]} {column}", justify="right")
    by_mode = {mode: {row["version"]: row for row in results[mode]["trained"]} for mode in modes}
    for version in sorted({v for rows in by_mode.values() for v in rows}):
        cells = [str(version)]
        for mode in modes:
            row = by_mode[mode].get(version)
            keys = ("rollouts", "samples", "tokens", "loss_tokens", "published_s")
            cells += [str(row[k]) for k in keys] if row else ["-"] * len(keys)
        table.add_row(*cells)
    console.print(table)
    table = Table(title="mean reward of the rollouts each policy version ran (triplet_records)")
    table.add_column("version", justify="right")
    for mode in modes:
        table.add_column(f"{mode} rollouts", justify="right")
        table.add_column(f"{mode} reward", justify="right")
    rewards = {mode: {row["version"]: row for row in results[mode]["reward"]} for mode in modes}
    for version in sorted({v for rows in rewards.values() for v in rows}):
        cells = [str(version)]
        for mode in modes:
            row = rewards[mode].get(version)
            cells += [str(row["rollouts"]), f"{row['mean']:.3f}"] if row else ["-", "-"]
        table.add_row(*cells)
    console.print(table)
    table = Table(title="overall (every triplet record written)")
    columns = ("mode", "records", "samples/rollout", "tokens/sample", "versions", "wall s", "failed attempts")
    for column in columns:
        table.add_column(column, justify="right")
    for mode in modes:
        r = results[mode]
        table.add_row(
            mode,
            str(r["records"]),
            str(r["samples_per_rollout"]),
            str(r["tokens_per_sample"]),
            str(r["versions"]),
            str(r["wall_s"]),
            f"{r['failed_attempts']}/{r['attempts']}",
        )
    console.print(table)
    for mode in modes:
        gate = results[mode]["gate"]
        if gate:
            console.print(
                f"{mode}: hand-off gate: {gate['switches']} switches, longest pause {gate['longest_pause_s']:.1f} s, "
                f"{gate['held']} calls held (longest {gate['longest_hold_s']:.1f} s), {gate['retried']} retried, "
                f"{gate['cut']} cut, {gate['refused']} refused"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--versions", type=int, default=8, help="policy versions to train per mode")
    parser.add_argument("--minutes", type=float, default=20.0, help="most minutes per mode")
    parser.add_argument("--group", type=int, default=8, help="rollouts per task (one GRPO group)")
    parser.add_argument("--groups", type=int, default=4, help="groups per batch")
    parser.add_argument("--lr", type=float, default=0.05, help="the trainer's learning rate (the RL loop test's)")
    parser.add_argument("--modes", nargs="+", default=["transition", "trajectory"])
    parser.add_argument("--backend", choices=("torch", "verl"), default="torch", help="the trainer's policy backend")
    parser.add_argument("--engine", choices=("cpu", "vllm"), default="cpu", help="the inference role's engine")
    parser.add_argument("--model-path", help="HF causal LM folder to start from (default: the tiny policy)")
    parser.add_argument("--model-name", default=MODEL, help="the name the policy is served under")
    parser.add_argument("--vllm-arg", action="append", default=[], help="one more argument for vLLM's server")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "aggregation.json")
    args = parser.parse_args()
    console = Console()
    # SIGTERM (a timeout, a kill) unwinds like Ctrl-C, so every role and the stack are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.engine == "vllm" and not args.model_path:
        parser.error("--engine vllm needs --model-path (vLLM serves a model folder)")
    trainer_options = ["--lr", str(args.lr), "--backend", args.backend]
    inference_options = [f"--vllm-arg={arg}" for arg in args.vllm_arg]
    if args.model_path:
        trainer_options += ["--initial-model", args.model_path]
        inference_options += ["--model", args.model_path]
    if args.engine == "vllm":
        inference_options += ["--engine", "vllm"]
    results: dict[str, dict[str, Any]] = {}
    for mode in args.modes:
        console.print(f"[bold]{mode}[/bold]: training {args.versions} versions")
        with tempfile.TemporaryDirectory(prefix="agl-aggregation-") as folder:
            settings = bench_settings(Path(folder), "agg")
            ports = free_ports(2)
            with loop.running_loop(
                settings,
                console,
                trainer_options=trainer_options,
                triplet_options=("--aggregation", mode),
                agent=AGENT,
                group=args.group,
                groups=args.groups,
                runner_env=RUNNER_ENV,
                model=args.model_name,
                inference_options=inference_options,
                ports=(ports[0], ports[1]),
            ) as running:
                results[mode] = asyncio.run(
                    drive(
                        running,
                        versions=args.versions,
                        minutes=args.minutes,
                        group=args.group,
                        groups=args.groups,
                        health_url=f"http://127.0.0.1:{ports[0]}/health",
                    )
                )
        args.out.parent.mkdir(parents=True, exist_ok=True)  # after each mode: a later failure keeps it
        args.out.write_text(json.dumps({"cpus": os.cpu_count(), "lr": args.lr, **results}, indent=2) + "\n")
    show(results, console)
    console.print(f"written to {args.out}")


if __name__ == "__main__":
    main()
