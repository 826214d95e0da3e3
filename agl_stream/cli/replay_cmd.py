"""``agl-stream replay NAME``: re-derive triplet records from historical spans into a replay topic."""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer

from agl_stream.cli import output
from agl_stream.cli.adapter_options import (
    AgentMatch,
    AggregationOption,
    ExcludeLlmCallInReward,
    LlmCallMatch,
    RewardMatch,
    adapter_config,
)
from agl_stream.cli.context import settings_of
from agl_stream.errors import AglError


def replay(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Replay name: output topic <prefix>.triplets.replay.NAME.")],
    offsets: Annotated[
        list[str] | None,
        typer.Option("--offsets", help="PARTITION:FROM-TO of agl.spans (TO exclusive, either side optional)."),
    ] = None,
    from_offset: Annotated[
        list[str] | None,
        typer.Option("--from-offset", help="PARTITION:OFFSET, first offset read in that partition."),
    ] = None,
    to_offset: Annotated[
        list[str] | None,
        typer.Option("--to-offset", help="PARTITION:OFFSET, end (exclusive) in that partition."),
    ] = None,
    from_time: Annotated[
        str | None,
        typer.Option(help="Spans written at or after this time (ISO 8601, UTC if naive, or epoch seconds)."),
    ] = None,
    to_time: Annotated[
        str | None,
        typer.Option(help="Spans written before this time (ISO 8601 or epoch seconds)."),
    ] = None,
    sql: Annotated[
        str | None,
        typer.Option(
            help='Replay the rollouts this query returns (first column), e.g. "SELECT rollout_id FROM rollouts".'
        ),
    ] = None,
    reward: Annotated[
        str | None,
        typer.Option(help="pkg.mod:fn, called with an attempt's spans; its float (or None) replaces the final reward."),
    ] = None,
    incomplete: Annotated[
        str, typer.Option(help="Attempts with spans missing from the range: skip (counted) or emit as they are.")
    ] = "skip",
    llm_call_match: LlmCallMatch = None,
    agent_match: AgentMatch = None,
    reward_match: RewardMatch = "first_occurrence",
    exclude_llm_call_in_reward: ExcludeLlmCallInReward = True,
    aggregation: AggregationOption = "transition",
    workers: Annotated[
        int | None,
        typer.Option(min=1, help="Processes reading partitions in parallel (default: one per CPU; 1: none)."),
    ] = None,
) -> None:
    """Replay committed span history into <prefix>.triplets.replay.NAME, as the live builder would.

    Deterministic (same range and settings, same bytes) and idempotent (a rerun into the same
    topic writes nothing twice). Reads with no consumer group, up to the end offsets at start.

    Example: agl-stream replay exp1 --from-time 2026-01-01T00:00 --reward my_rewards:strict
    """
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from agl_stream.domain.replay import ReplaySettings, Selection, batches_topic_of, parse_offset_ranges, parse_time

    # The shell is a writer role (producers/), loaded by name like every role.
    from producers.replay import replay as run_replay

    settings = settings_of(ctx)
    adapter = adapter_config(llm_call_match, agent_match, reward_match, exclude_llm_call_in_reward, aggregation)
    try:
        replay_settings = ReplaySettings(adapter=adapter, reward=reward, incomplete=incomplete)
        bounds = parse_offset_ranges(offsets or (), from_offset or (), to_offset or ())
        selection = Selection(
            offsets=bounds or None,
            from_time=parse_time(from_time) if from_time else None,
            to_time=parse_time(to_time) if to_time else None,
            sql=sql,
        )
    except (ValueError, AglError) as error:
        raise typer.BadParameter(str(error)) from error

    console = output.console(stderr=True)
    columns = (
        TextColumn("[bold]replay {task.fields[name]}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]} records/s"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("replay", total=None, name=name, rate="-")

        def on_progress(done: int, total: int) -> None:
            speed = progress.tasks[0].speed
            progress.update(task, completed=done, total=total, rate=f"{speed:,.0f}" if speed else "-")

        try:
            summary = asyncio.run(
                run_replay(
                    settings,
                    name,
                    selection=selection,
                    replay_settings=replay_settings,
                    on_progress=on_progress,
                    workers=workers,
                )
            )
        except AglError as error:
            console.print(f"[red]replay failed:[/red] {error}")
            raise typer.Exit(1) from error

    out = output.console()
    out.print(f"topic          {summary.topic}")
    out.print(f"ranges         {', '.join(f'{p}:{lo}-{hi}' for p, (lo, hi) in summary.ranges.items()) or '-'}")
    out.print(f"spans          {summary.spans:,} read in {summary.read_s:.2f}s ({summary.spans_per_s:,.0f} spans/s)")
    out.print(f"attempts       {summary.attempts:,}")
    out.print(
        f"records        {summary.records:,} ({summary.written:,} written, {summary.already_present:,} already there)"
    )
    out.print(f"incomplete     {summary.incomplete:,} ({summary.incomplete_skipped:,} skipped)")
    out.print(f"unfinished     {summary.unfinished_attempts:,} attempts (no end in the history read)")
    for label, problems in (
        ("malformed spans", summary.malformed_spans),
        ("bad events", summary.bad_events),
        ("reward errors", summary.reward_errors),
    ):
        out.print(f"{label:<15}{problems.count:,}")
        for reason in problems.reasons:
            out.print(f"  - {reason}")
    out.print(f"settings       {summary.settings_digest}")
    out.print(f"digest         {summary.digest}")
    batches = batches_topic_of(settings.topic_prefix, name)
    out.print(f"batch it with  agl-stream batcher --input-topic {summary.topic} --output-topic {batches}")
