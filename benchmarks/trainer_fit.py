"""``Trainer.fit`` on this machine's CPU: time to the first policy update, and rollouts/s.

Two measurements, each a whole ``fit`` that starts its own local stack (broker, processor,
gateway) in a temporary data dir and stops it:

* **first_update**: ``Trainer(algorithm=VERL(config)).fit(...)`` with the torch backend and the
  tiny policy on the built-in toy task (``agl_stream.demo.task``: one round of
  ``--tasks`` tasks x ``--samples`` samples, one batch, one step). The clock starts when ``fit``
  is called and stops at the first step's ``step_time`` (``trainer_steps``); the milestones in
  between come from ClickHouse: the first rollout's start, the first attempt that finished (its
  triplet record), the first batch.
* **throughput**: ``Trainer(algorithm=Baseline(...), n_runners=--runners).fit(calculator_agent,
  ...)``: the calculator example against the CPU inference backend (``agl-stream inference``
  serving the tiny policy, started here; its answers are nonsense and make no tool calls, so
  each rollout is one model call and reward 0, which is fine for throughput). Rollouts/s is
  the rollouts over the span from the first rollout's start to the last one's end
  (``rollouts`` table), so the stack's start is not counted; ``rollouts_per_s_after_first_epoch``
  leaves out the first epoch too (runners importing the agent, first connections); the ``fit``
  wall time is reported beside them.

Run: ``python benchmarks/trainer_fit.py [--epochs 3] [--runners 4] [--only throughput]``; JSON
to benchmarks/results/trainer_fit.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from rich.console import Console

import agl_stream as agl
from agl_stream.clickhouse.client import get_client
from agl_stream.clickhouse.times import seconds as seconds_of
from agl_stream.config import Settings
from agl_stream.demo.task import PROMPTS, digits
from agl_stream.local.processes import RoleGroup
from agl_stream.ports import free_ports

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the examples are imported from the repository root
from examples.calculator import calc_agent  # noqa: E402


def _settings(data_dir: Path) -> Settings:
    settings = Settings(data_dir=data_dir, gateway_port=0, topic_prefix=f"b{uuid.uuid4().hex[:6]}", log_level="WARNING")
    if settings.uses_local_broker:
        port, controller = free_ports(2)
        settings = settings.model_copy(update={"kafka_port": port, "kafka_controller_port": controller})
    return settings


def _query(settings: Settings, sql: str) -> list[Any]:
    """One row of SQL on the run's ClickHouse (read after fit: the gateway let go of the engine)."""
    client = get_client(settings)
    try:
        return list(client.query(sql.format(db=settings.clickhouse_database)).result_rows[0])
    finally:
        client.close()


def first_update(tasks: int, samples: int) -> dict[str, Any]:
    config = {
        "data": {"train_batch_size": tasks, "max_response_length": 8},
        "actor_rollout_ref": {"rollout": {"n": samples}, "actor": {"optim": {"lr": 1e-2}}},
        "trainer": {"total_epochs": 1, "test_freq": 0, "val_before_train": False},
    }
    with tempfile.TemporaryDirectory(prefix="agl-bench-fit-") as tmp:
        settings = _settings(Path(tmp))
        algorithm = agl.VERL(config, linger_s=1.0)
        trainer = agl.Trainer(
            algorithm=algorithm, runner_concurrency=samples, settings=settings, console=Console(quiet=True)
        )
        train = [{"prompt": p} for p in PROMPTS[:tasks]]
        started = time.time()
        result = trainer.fit(digits, train)
        ended = time.time()
        (rollout_start,) = _query(settings, f"SELECT {seconds_of('min(start_time)')} FROM {{db}}.rollouts FINAL")
        (finished,) = _query(settings, f"SELECT {seconds_of('min(finish_time)')} FROM {{db}}.triplet_records FINAL")
        (batch,) = _query(settings, f"SELECT {seconds_of('min(created_time)')} FROM {{db}}.batches FINAL")
        step, seconds, steps = _query(
            settings,
            f"SELECT {seconds_of('min(step_time)')}, argMin(step_seconds, step_time), count() "
            "FROM {db}.trainer_steps FINAL",
        )
    return {
        "rollouts": len(result.rollout_ids),
        "policy_version": result.policy_version,
        "steps": steps,
        "seconds_fit_to_first_update": round(step - started, 2),
        "milestones_s": {
            "first_rollout_started": round(rollout_start - started, 2),
            "first_attempt_finished": round(finished - started, 2),
            "first_batch": round(batch - started, 2),
            "first_step_done": round(step - started, 2),
        },
        "first_step_seconds": round(seconds, 3),
        "seconds_fit_total": round(ended - started, 2),
    }


def throughput(runners: int, concurrency: int, epochs: int, max_tokens: int) -> dict[str, Any]:
    tasks = calc_agent.load_tasks(calc_agent.TRAIN_FILE) + calc_agent.load_tasks(calc_agent.VAL_FILE)
    with tempfile.TemporaryDirectory(prefix="agl-bench-fit-") as tmp:
        settings = _settings(Path(tmp))
        roles = RoleGroup(settings, Path(tmp) / "logs")
        (port,) = free_ports(1)
        try:
            roles.start("inference", "--port", str(port), "--no-follow", name="inference")
            roles.wait_http("inference", f"http://127.0.0.1:{port}/health")
            llm = agl.LLM(
                endpoint=f"http://127.0.0.1:{port}/v1",
                model="agl-tiny",
                sampling_parameters={"temperature": 1.0, "max_tokens": max_tokens},
            )
            trainer = agl.Trainer(
                algorithm=agl.Baseline(n_epochs=epochs),
                n_runners=runners,
                runner_concurrency=concurrency,
                initial_resources={"main_llm": llm},
                settings=settings,
                console=Console(quiet=True),
            )
            started = time.time()
            result = trainer.fit(calc_agent.calculator_agent, tasks)
            ended = time.time()
        finally:
            roles.stop(timeout=30)
        count, succeeded, first, last, starts, ends = _query(
            settings,
            f"SELECT count(), countIf(status = 'succeeded'), {seconds_of('min(start_time)')}, "
            f"{seconds_of('max(end_time)')}, arraySort(groupArray({seconds_of('start_time')})), "
            f"arraySort(groupArray({seconds_of('end_time')})) FROM {{db}}.rollouts FINAL",
        )
    # Steady state: the epochs after the first, whose rollouts start once every runner has
    # imported the agent and made its first call (the first epoch pays for those).
    later = count - len(tasks)
    steady = later / (ends[-1] - starts[len(tasks)]) if later > 0 else None
    return {
        "runners": runners,
        "runner_concurrency": concurrency,
        "max_tokens": max_tokens,
        "rollouts": count,
        "succeeded": succeeded,
        "mean_reward": result.mean_reward("train"),
        "seconds_first_start_to_last_end": round(last - first, 2),
        "rollouts_per_s": round(count / (last - first), 2),
        "rollouts_per_s_after_first_epoch": round(steady, 2) if steady is not None else None,
        "seconds_fit_total": round(ended - started, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=2, help="first_update: toy tasks in the round")
    parser.add_argument("--samples", type=int, default=4, help="first_update: samples per task (GRPO group)")
    parser.add_argument("--runners", type=int, default=4, help="throughput: runner processes")
    parser.add_argument("--concurrency", type=int, default=1, help="throughput: attempts per runner")
    parser.add_argument("--epochs", type=int, default=3, help="throughput: passes over the 40 calculator tasks")
    parser.add_argument("--max-tokens", type=int, default=32, help="throughput: completion tokens per call")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "trainer_fit.json")
    parser.add_argument("--only", choices=("first_update", "throughput"), help="run one part, keep the other's result")
    args = parser.parse_args()
    results: dict[str, Any] = json.loads(args.out.read_text()) if args.only and args.out.exists() else {}
    results["cpus"] = os.cpu_count()
    if args.only in (None, "first_update"):
        results["first_update"] = first_update(args.tasks, args.samples)
    if args.only in (None, "throughput"):
        results["throughput"] = throughput(args.runners, args.concurrency, args.epochs, args.max_tokens)
    print(json.dumps(results, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
