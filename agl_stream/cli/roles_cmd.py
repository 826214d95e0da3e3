"""Long-running roles. Each lives in its own top-level package and is imported when its command
runs; the CLI is the one part of ``agl_stream`` above the roles (docs/architecture.md, the layers)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from agl_stream.cli.adapter_options import (
    AgentMatch,
    AggregationOption,
    ExcludeLlmCallInReward,
    LlmCallMatch,
    RewardMatch,
    adapter_config,
)
from agl_stream.cli.context import settings_of

if TYPE_CHECKING:
    from agl_stream.config import Settings


def sink(
    ctx: typer.Context,
    batch_size: Annotated[int, typer.Option(min=1, help="Most span rows per INSERT.")] = 10_000,
    flush_ms: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Longest wait to fill a span batch, in ms (default: AGL_SINK_LINGER_MS; a store read waiting "
            "for the spans ends it at once).",
        ),
    ] = None,
) -> None:
    """Run the ClickHouse sinks (spans, rollout states, resources, workers, triplets, batches) until SIGTERM.

    The gateway runs the same sinks plus the query API; run this only without a gateway.

    With the embedded engine this process owns the ClickHouse data dir.
    """
    from agl_stream import metrics
    from consumers import clickhouse_sink

    settings = settings_of(ctx)
    with metrics.expose(settings, "sink"):
        clickhouse_sink.main(settings, batch_size=batch_size, flush_ms=flush_ms)


def processor(
    ctx: typer.Context,
    watchdog_interval: Annotated[
        float | None, typer.Option(min=0.05, help="Seconds between watchdog scans (env AGL_WATCHDOG_INTERVAL_S).")
    ] = None,
    finished_retention: Annotated[
        float | None,
        typer.Option(min=0.0, help="Seconds a finished rollout stays in memory (env AGL_FINISHED_RETENTION_S)."),
    ] = None,
) -> None:
    """Run the rollout processor (state machine, task queue, watchdog) until SIGTERM or Ctrl-C."""
    settings = settings_of(ctx)
    overrides = {"watchdog_interval_s": watchdog_interval, "finished_retention_s": finished_retention}
    settings = settings.model_copy(update={k: v for k, v in overrides.items() if v is not None})
    from agl_stream import metrics
    from processors import rollouts

    with metrics.expose(settings, "processor"):
        rollouts.main(settings)


def runner(
    ctx: typer.Context,
    agent: Annotated[
        str | None,
        typer.Option(help="The agent as pkg.module:name (a LitAgent, LitAgent subclass or @rollout function)."),
    ] = None,
    agent_file: Annotated[
        Path | None,
        typer.Option(
            help="Instead of --agent: a file a Trainer wrote (the pickled agent and runner hooks); "
            "only load files your own Trainer wrote: unpickling runs the code they name.",
        ),
    ] = None,
    command: Annotated[
        str | None,
        typer.Option(
            help="Instead of --agent: a shell command run once per attempt, in any language "
            "(agl_stream.agent.command_agent: "
            "the task in $AGL_TASK_FILE, the model at $OPENAI_BASE_URL through the LLM proxy, the reward as the "
            "last stdout line or in $AGL_REWARD_FILE).",
        ),
    ] = None,
    command_timeout: Annotated[
        float | None,
        typer.Option(min=0.001, help="--command: seconds one run may take before its process group is stopped."),
    ] = None,
    concurrency: Annotated[int, typer.Option(min=1, help="Attempts one runner process runs at once.")] = 4,
    workers: Annotated[int, typer.Option(min=1, help="Runner processes to start (one group member each).")] = 1,
    grace: Annotated[
        float, typer.Option(min=0.0, help="Seconds live attempts may finish after SIGTERM before they are released.")
    ] = 30.0,
    heartbeat_interval: Annotated[
        float, typer.Option(min=0.05, help="Seconds between heartbeats of live attempts and of the worker.")
    ] = 5.0,
    max_rollouts: Annotated[
        int | None, typer.Option(min=1, help="Stop after claiming this many rollouts (per process).")
    ] = None,
    worker_id: Annotated[str | None, typer.Option(help="Worker id (default: runner-<host>-<pid>).")] = None,
    resources: Annotated[
        str,
        typer.Option(
            help="pinned: the resources each rollout names (fixed at enqueue, as Agent Lightning's runner); "
            "latest: the latest at claim time (streaming RL: every attempt runs the newest policy).",
        ),
    ] = "pinned",
) -> None:
    """Run an agent on every queued rollout it claims until SIGTERM or Ctrl-C.

    Each process claims rollouts from the rollout processor (oldest first; any number of
    processes, whatever the partition count), resolves resources
    from agl.resources, traces the agent's spans into agl.spans and reports the attempt's status.
    On SIGTERM it stops claiming, lets live attempts finish for --grace seconds and releases the
    rest so they are retried.

    Example: agl-stream runner --agent my_pkg.agents:solve --concurrency 8 --workers 2
    Example: agl-stream runner --command "node agent.js" --command-timeout 300 --concurrency 8
    """
    settings = settings_of(ctx)
    if resources not in ("pinned", "latest"):
        raise typer.BadParameter(f"{resources!r}: pinned or latest", param_hint="--resources")
    if sum(given is not None for given in (agent, agent_file, command)) != 1:
        raise typer.BadParameter("give the agent with one of --agent, --agent-file or --command", param_hint="--agent")
    if command_timeout is not None and command is None:
        raise typer.BadParameter("--command-timeout applies to --command only", param_hint="--command-timeout")
    sys.path.insert(0, os.getcwd())  # agents are usually modules of the project being run
    if workers > 1:
        if command is not None:
            child_args = ["--command", command]
            child_args += ["--command-timeout", str(command_timeout)] if command_timeout is not None else []
        else:
            child_args = ["--agent", agent] if agent is not None else ["--agent-file", str(agent_file)]
        child_args += ["--concurrency", str(concurrency), "--grace", str(grace)]
        child_args += ["--heartbeat-interval", str(heartbeat_interval)]
        child_args += ["--max-rollouts", str(max_rollouts)] if max_rollouts else []
        child_args += ["--resources", resources]
        _supervise_runners(settings, workers, child_args)
        return
    from agl_stream import metrics
    from consumers import runner

    options = runner.RunnerOptions(
        concurrency=concurrency,
        grace_s=grace,
        heartbeat_interval_s=heartbeat_interval,
        max_rollouts=max_rollouts,
        resources="latest" if resources == "latest" else "pinned",
    )
    if worker_id:
        options.worker_id = worker_id
    try:
        if agent_file is not None:
            loaded, hooks = runner.load_agent_file(agent_file)
        elif command is not None:
            from agl_stream.agent.command_agent import CommandAgent

            loaded, hooks = CommandAgent(command, timeout_s=command_timeout), []
        else:
            assert agent is not None
            loaded, hooks = runner.load_agent(agent), []
    except ValueError as error:
        hint = "--agent-file" if agent_file else "--command" if command is not None else "--agent"
        raise typer.BadParameter(str(error), param_hint=hint) from error
    with metrics.expose(settings, "runner"):
        runner.main(settings, loaded, options, hooks)


def _supervise_runners(settings: Settings, workers: int, child_args: list[str]) -> None:
    """Start ``workers`` single-process runners with the same options; forward SIGTERM/SIGINT to them."""
    from agl_stream.local.processes import role_environment

    env = role_environment(settings, "runner")
    children = [
        subprocess.Popen([sys.executable, "-m", "agl_stream", "runner", *child_args, "--workers", "1"], env=env)
        for _ in range(workers)
    ]

    def forward(signum: int, _frame: object) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    codes = [child.wait() for child in children]
    if any(codes):
        raise typer.Exit(max(codes))


def triplets(
    ctx: typer.Context,
    llm_call_match: LlmCallMatch = None,
    agent_match: AgentMatch = None,
    reward_match: RewardMatch = "first_occurrence",
    exclude_llm_call_in_reward: ExcludeLlmCallInReward = True,
    aggregation: AggregationOption = "transition",
    settle: Annotated[
        float, typer.Option(min=0.0, help="Seconds a finished attempt may wait for late spans before it is built.")
    ] = 5.0,
) -> None:
    """Run the triplet builder: each finished attempt's spans -> one record of triplets on agl.triplets."""
    adapter = adapter_config(llm_call_match, agent_match, reward_match, exclude_llm_call_in_reward, aggregation)
    from agl_stream import metrics
    from processors import triplets

    settings = settings_of(ctx)
    with metrics.expose(settings, "triplets"):
        triplets.main(settings, adapter=adapter, settle_s=settle)
