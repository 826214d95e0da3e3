"""The RL loop of ``agl-stream demo``: every role as its own process, driven and watched from here.

Started in order: the local stack (broker unless AGL_KAFKA_BOOTSTRAP, topics, rollout processor,
gateway with the embedded ClickHouse), the triplet builder, the batcher (GRPO groups of
``GROUP`` samples), the trainer (publishes policy version 0 at once), the CPU inference backend
(loads every published version), the LLM proxy, and a runner with the toy agent
(:mod:`agl_stream.demo.task`). This process enqueues rounds of task groups while the trainer
trains (asynchronous RL: rollouts never wait for training), shows progress, and reads the
reward per policy version back from ClickHouse with SQL. Everything it started is stopped at
the end, also on Ctrl-C or an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from agl_stream.config import Settings
from agl_stream.demo.task import PROMPTS
from agl_stream.local import stack
from agl_stream.local.processes import RoleGroup
from agl_stream.ports import free_ports
from agl_stream.store.client import AglStore

GROUP = 8  # samples per task: one GRPO group
GROUPS_PER_ROUND = 4  # one batch = one round: 32 rollouts
MODEL = "agl-tiny"

REWARD_BY_VERSION = (
    "SELECT policy_version, count() AS rollouts, round(avg(final_reward), 3) AS mean_reward "
    "FROM {db}.triplet_records FINAL WHERE policy_version IS NOT NULL "
    "GROUP BY policy_version ORDER BY policy_version"
)


# How much of what the loop wrote carries the policy version it ran with: (table, with, total).
VERSION_COVERAGE = (
    "SELECT 'spans', countIf(PolicyVersion IS NOT NULL), count() FROM {db}.otel_traces FINAL "
    "UNION ALL SELECT 'attempts', countIf(policy_version IS NOT NULL), count() FROM {db}.attempts FINAL "
    "WHERE status IN ('succeeded', 'failed') "
    "UNION ALL SELECT 'rollouts', countIf(policy_version IS NOT NULL), count() FROM {db}.rollouts FINAL "
    "WHERE status IN ('succeeded', 'failed') "
    "UNION ALL SELECT 'triplet_records', countIf(policy_version IS NOT NULL), count() FROM {db}.triplet_records FINAL "
    "UNION ALL SELECT 'trainer_steps', count(), count() FROM {db}.trainer_steps FINAL"
)


@dataclass
class DemoResult:
    versions: list[tuple[int, int, float]]  # (policy version, rollouts, mean reward)
    seconds: float
    rollouts: int
    coverage: dict[str, tuple[int, int]] = field(default_factory=dict)  # table -> (rows with a version, rows)

    def first_and_last(self, window: int = 3) -> tuple[float, float]:
        """The mean reward of the rollouts of the first ``window`` policy versions, and of the last:
        weighted by rollouts, so a version that ran only a couple of them cannot swing it."""

        def mean(versions: list[tuple[int, int, float]]) -> float:
            count = sum(n for _, n, _ in versions)
            return sum(n * reward for _, n, reward in versions) / count if count else 0.0

        return mean(self.versions[:window]), mean(self.versions[-window:])

    def rose(self, by: float = 0.1, window: int = 3, min_rollouts: int = 8) -> bool:
        """Whether the reward rose ``by`` from the first ``window`` versions to the last, with at
        least ``min_rollouts`` rollouts in the last window (a couple of lucky ones prove nothing)."""
        if len(self.versions) < window + 1 or sum(n for _, n, _ in self.versions[-window:]) < min_rollouts:
            return False
        first, last = self.first_and_last(window)
        return last >= first + by


@contextlib.contextmanager
def running_loop(
    settings: Settings,
    console: Console,
    *,
    keep: bool = False,
    trainer_options: Sequence[str] = (),
    triplet_options: Sequence[str] = (),
    agent: str = "agl_stream.demo.task:digits",
    group: int = GROUP,
    groups: int = GROUPS_PER_ROUND,
    runner_env: Mapping[str, str] | None = None,
    model: str = MODEL,
    inference_options: Sequence[str] = (),
    ports: tuple[int, int] | None = None,
) -> Iterator[Settings]:
    """Start every role; stop them all on the way out (a stack `up` started is used, and left running).

    ``keep``: leave the local stack this started running (broker, processor, gateway, ...) so that
    its data stays in view on the dashboard; the demo's own roles (trainer, model, proxy, runner)
    stop as always. `agl-stream --data-dir <its data dir> down` stops the stack.
    ``trainer_options``, ``triplet_options``: more `agl-stream trainer` / `triplets` flags (e.g.
    ``("--lr", "0.05")``, ``("--aggregation", "trajectory")``). ``agent``: the runner's
    ``module:function`` (another task: ``runner_env`` can put its folder on PYTHONPATH);
    ``group`` rollouts per task and ``groups`` tasks per training batch. ``model``: the name the
    policy is published and served under; ``inference_options``: more `agl-stream inference` flags
    (``("--engine", "vllm", "--model", folder)``); ``ports``: the inference role's and the LLM
    proxy's (free ones by default), for a caller that reads their ``/health``."""
    with console.status("starting the local stack (broker, topics, processor, gateway) ...") as spinner:
        opened = stack.open_session(settings, progress=spinner.update)
    try:
        running = opened.settings
        model_port, proxy_port = ports or free_ports(2)
        proxy_url = f"http://127.0.0.1:{proxy_port}/v1"
        roles = RoleGroup(running, settings.data_dir / "logs")
        try:
            with console.status(
                "starting the triplet builder, batcher, trainer, model, proxy and runner ..."
            ) as spinner:
                roles.progress = spinner.update
                roles.start("triplets", "--settle", "2", *triplet_options, name="triplets")
                roles.start(
                    "batcher",
                    "--group-size",
                    str(group),
                    "--max-rollouts",
                    str(group * groups),
                    "--linger",
                    "5",
                    name="batcher",
                )
                roles.start(
                    "trainer",
                    "--checkpoints",
                    str(settings.data_dir / "checkpoints"),
                    "--model-name",
                    model,
                    "--proxy-endpoint",
                    proxy_url,
                    *trainer_options,
                    name="trainer",
                )
                roles.start(
                    "inference",
                    "--port",
                    str(model_port),
                    "--model-name",
                    model,
                    *inference_options,
                    name="inference",
                )
                roles.wait_http("inference", f"http://127.0.0.1:{model_port}/health")
                roles.start(
                    "llm-proxy",
                    "--port",
                    str(proxy_port),
                    "--backend",
                    f"{model}=http://127.0.0.1:{model_port}/v1",
                    name="llm-proxy",
                )
                roles.wait_http("llm-proxy", f"http://127.0.0.1:{proxy_port}/health")
                roles.start(
                    "runner",
                    "--agent",
                    agent,
                    "--concurrency",
                    "16",
                    "--resources",
                    "latest",
                    name="runner",
                    env=runner_env,
                )
            yield running
        finally:
            with console.status("stopping everything the demo started ..."):
                roles.stop(timeout=30)
    finally:
        if not (keep and opened.owned):  # kept: the caller prints where its dashboard is
            with console.status("stopping the local stack ..."):
                stack.close_session(opened, settings)


async def _reward_by_version(store: AglStore, settings: Settings) -> list[tuple[int, int, float]]:
    assert store.side is not None, "the store is started"
    result = await store.side.query(REWARD_BY_VERSION.format(db=settings.clickhouse_database))
    return [(int(v), int(n), float(r)) for v, n, r in result.rows]


async def drive(
    settings: Settings,
    console: Console,
    *,
    versions: int,
    minutes: float,
    until: Callable[[DemoResult], bool] | None = None,
) -> DemoResult:
    """Enqueue rounds of task groups until the trainer published ``versions`` new policies, or
    sooner once ``until`` holds for the reward per version so far (e.g. ``DemoResult.rose``)."""
    started = time.monotonic()
    deadline = started + minutes * 60
    done = 0
    store = await AglStore(settings).start()
    try:
        with Progress(
            TextColumn("[bold]policy versions"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            console=console,
        ) as progress:
            bar = progress.add_task("train", total=versions, status="waiting for policy version 0")
            while (await store.get_latest_resources()) is None:
                if time.monotonic() > deadline:
                    raise TimeoutError("the trainer never published policy version 0 (see logs/trainer.log)")
                await asyncio.sleep(0.2)  # the trainer process starting (imports torch and VERL)
            in_flight: list[asyncio.Task[Any]] = []
            round_no = 0
            version = 0
            while version < versions and time.monotonic() < deadline:
                # Two rounds in flight: rollouts keep running while the trainer trains.
                while len(in_flight) < 2:
                    requests = [
                        {
                            "input": {"prompt": PROMPTS[(round_no + g) % len(PROMPTS)]},
                            "mode": "train",
                            "metadata": {"group_id": f"demo-{round_no}-{g}"},
                        }
                        for g in range(GROUPS_PER_ROUND)
                        for _ in range(GROUP)
                    ]
                    made = await store.enqueue_many_rollouts(requests)
                    in_flight.append(
                        asyncio.create_task(
                            store.wait_for_rollouts(rollout_ids=[r.rollout_id for r in made], timeout=300)
                        )
                    )
                    round_no += 1
                finished = await in_flight.pop(0)
                done += len(finished)
                latest = await store.get_latest_resources()
                version = latest.version if latest is not None else 0
                rows = await _reward_by_version(store, settings)
                last = f"v{rows[-1][0]}: reward {rows[-1][2]:.2f}" if rows else "no records yet"
                first = f"v{rows[0][0]}: {rows[0][2]:.2f}" if rows else ""
                progress.update(bar, completed=min(version, versions), status=f"{done} rollouts | {first} -> {last}")
                if until is not None and until(DemoResult(rows, time.monotonic() - started, done)):
                    break
            for task in in_flight:
                task.cancel()
        rows = await _reward_by_version(store, settings)
        assert store.side is not None
        coverage = await store.side.query(VERSION_COVERAGE.format(db=settings.clickhouse_database))
    finally:
        await store.close()
    return DemoResult(rows, time.monotonic() - started, done, {str(t): (int(w), int(n)) for t, w, n in coverage.rows})


def trainer_metrics(settings: Settings) -> dict[str, Any]:
    """What the trainer reported last (``metrics.json`` beside its checkpoints), if anything."""
    import json

    path = settings.data_dir / "checkpoints" / "metrics.json"
    return json.loads(path.read_text()) if path.exists() else {}


def show(result: DemoResult, console: Console, metrics: dict[str, Any] | None = None) -> None:
    table = Table(title="mean reward per policy version (SQL on ClickHouse: triplet_records)")
    for column in ("policy version", "rollouts", "mean reward"):
        table.add_column(column, justify="right")
    for version, rollouts, reward in result.versions:
        table.add_row(str(version), str(rollouts), f"{reward:.3f}")
    console.print(table)
    first, last = result.first_and_last()
    console.print(
        f"{result.rollouts} rollouts in {result.seconds:.0f}s; mean reward of the first 3 versions {first:.3f}, "
        f"of the last 3 {last:.3f}"
    )
    if result.coverage:
        console.print(
            "rows that carry their policy version: "
            + ", ".join(f"{table} {with_}/{total}" for table, (with_, total) in result.coverage.items())
        )
    if metrics:
        console.print(
            f"trainer: {metrics['trained_batches']} batches, {metrics['tokens_per_busy_s']:,.0f} tokens/s while "
            f"training, idle {metrics['idle_fraction']:.0%} of the time (waiting for batches), data staleness "
            f"{metrics['staleness_mean']:.2f} versions on average (max {metrics['staleness_max']:.0f})"
        )
