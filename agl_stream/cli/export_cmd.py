"""``agl-stream export OUT``: chosen rollouts' chats, tool calls and rewards as TRL training data.

The shell around :mod:`agl_stream.domain.export`: it picks rollouts (a WHERE clause over the
rollouts table, policy versions, or the records of a replay topic), reads their spans from
ClickHouse in chunks through the store's read side (the gateway's read-only query path, every
value a bound parameter), converts them with the pure functions and writes the rows as a
``datasets`` folder (``save_to_disk``), Parquet, or JSON lines. Documented in docs/export.md.
"""

from __future__ import annotations

import asyncio
import enum
import json
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from agl_stream.cli.adapter_options import (
    AgentMatch,
    ExcludeLlmCallInReward,
    LlmCallMatch,
    RewardMatch,
    adapter_config,
)
from agl_stream.cli.context import settings_of
from agl_stream.errors import AglError

# `agl-stream --help` imports this module: its libraries load in the functions that use them.
if TYPE_CHECKING:
    from agl_stream.config import Settings
    from agl_stream.domain.adapter import AdapterConfig
    from agl_stream.domain.export import ExportKind, ExportSummary, ExportTrace
    from agl_stream.models import TripletRecord
    from agl_stream.store.readside import ReadSide

CHUNK = 50
"""Rollouts whose spans one query reads (a query's result stays far below the analytics limits)."""
FINISHED = ("succeeded", "failed")
"""Rollout statuses exported: finished ones (a running rollout's spans are not all there yet)."""
QUERY_TIMEOUT = 120.0


class OutputFormat(str, enum.Enum):
    hf = "hf"
    parquet = "parquet"
    jsonl = "jsonl"


class Kind(str, enum.Enum):
    sft = "sft"
    dpo = "dpo"


@dataclass(frozen=True)
class Selection:
    """Which rollouts: all three narrow the finished rollouts together."""

    where: str | None = None
    policy_versions: tuple[int, ...] = ()
    replay: str | None = None


OnProgress = Callable[[int, int], None]
"""``(rollouts read so far, rollouts chosen)``."""


async def _replay_records(settings: Settings, name: str) -> dict[tuple[str, str], TripletRecord]:
    """Every record of the replay topic, by (rollout id, attempt id): committed ones, up to the end at the start."""
    from aiokafka import TopicPartition

    from agl_stream.domain.export import ExportError
    from agl_stream.domain.replay import replay_topic
    from agl_stream.kafka.io import make_consumer
    from agl_stream.models import TripletRecord
    from agl_stream.wire.codec import Codec

    topic = replay_topic(settings.topic_prefix, name)
    codec = Codec.default()
    consumer = make_consumer(settings, group_id=None, fetch_max_wait_ms=100)
    await consumer.start()
    records: dict[tuple[str, str], TripletRecord] = {}
    try:
        partitions = consumer.partitions_for_topic(topic)
        if not partitions:  # a topic this consumer has not heard of yet (as producers/replay.py asks)
            await consumer._client.force_metadata_update()
            partitions = consumer.partitions_for_topic(topic)
        if not partitions:
            raise ExportError(f"replay topic {topic} does not exist: run `agl-stream replay {name}` first")
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        ends = await consumer.end_offsets(tps)
        await consumer.seek_to_beginning(*tps)
        while [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
            for tp, messages in (await consumer.getmany(timeout_ms=500)).items():
                for message in messages:
                    if message.offset < ends[tp] and message.value:
                        record = codec.decode(message.value, TripletRecord)
                        records[(record.rollout_id, record.attempt_id)] = record
    finally:
        await consumer.stop()
    return records


async def _chosen(side: ReadSide, settings: Settings, selection: Selection, fence: Any) -> list[str]:
    """The rollout ids the selection names, finished ones only, in id order."""
    from agl_stream.domain.export import ExportError

    db = settings.clickhouse_database
    parameters: dict[str, Any] = {"statuses": list(FINISHED)}
    conditions = ["status IN {statuses:Array(String)}"]
    if selection.policy_versions:
        conditions.append("policy_version IN {versions:Array(Int64)}")
        parameters["versions"] = list(selection.policy_versions)
    if selection.where:
        # The user's condition is SQL by design, like `agl-stream sql`: it runs on the read side's
        # read-only path (one SELECT, allowed functions, agl tables only; the engine decides).
        conditions.append(f"({selection.where})")
    sql = f"SELECT rollout_id FROM {db}.rollouts FINAL WHERE {' AND '.join(conditions)} ORDER BY rollout_id"
    try:
        result = await side.query(sql, parameters, fence=fence, timeout=QUERY_TIMEOUT)
    except AglError as exc:
        raise ExportError(f"choosing rollouts failed: {exc}") from exc
    return [str(row[0]) for row in result.rows]


async def _chunk_traces(
    side: ReadSide,
    settings: Settings,
    ids: Sequence[str],
    replayed: dict[tuple[str, str], TripletRecord] | None,
) -> list[ExportTrace]:
    """The traces of these rollouts: each one's latest attempt (or the attempt a replay record names)."""
    from agl_stream.clickhouse import times
    from agl_stream.domain.export import FROM_SPANS, ExportTrace
    from agl_stream.domain.trace_collector import group_id_of
    from agl_stream.models import Span
    from agl_stream.store.queries import ROLLOUT_COLUMNS, rollout_from_row, span_from_row

    db = settings.clickhouse_database
    rollouts = await side.query(
        f"SELECT {times.select(ROLLOUT_COLUMNS)}, policy_version FROM {db}.rollouts FINAL "
        "WHERE rollout_id IN {ids:Array(String)}",
        {"ids": list(ids)},
        timeout=QUERY_TIMEOUT,
    )
    spans = await side.query(
        f"SELECT SpanJson FROM {db}.otel_traces FINAL WHERE RolloutId IN {{ids:Array(String)}} "
        "ORDER BY RolloutId, AttemptId, SequenceId, SpanId",
        {"ids": list(ids)},
        timeout=QUERY_TIMEOUT,
    )
    by_attempt: dict[tuple[str, str], list[Span]] = {}
    for row in spans.dicts():
        span = span_from_row(row)
        by_attempt.setdefault((span.rollout_id, span.attempt_id), []).append(span)
    replayed_of: dict[str, list[tuple[str, str]]] = {}
    for key in replayed or {}:
        replayed_of.setdefault(key[0], []).append(key)
    traces = []
    for row in rollouts.dicts():
        rollout = rollout_from_row(row)
        version = row.get("policy_version")
        if replayed is not None:
            keys = sorted(replayed_of.get(rollout.rollout_id, []))
        else:  # the latest attempt: the one whose first span has the highest sequence id
            attempts = [key for key in by_attempt if key[0] == rollout.rollout_id]
            keys = sorted(attempts, key=lambda k: by_attempt[k][0].sequence_id)[-1:]
        for key in keys:
            record = replayed.get(key) if replayed is not None else None
            traces.append(
                ExportTrace(
                    rollout_id=rollout.rollout_id,
                    attempt_id=key[1],
                    group_id=record.group_id if record is not None else group_id_of(rollout),
                    spans=by_attempt.get(key, []),
                    policy_version=(
                        record.policy_version if record is not None and record.policy_version is not None else version
                    ),
                    reward=record.final_reward if record is not None else FROM_SPANS,
                )
            )
    return traces


async def collect(
    settings: Settings,
    selection: Selection,
    kind: ExportKind,
    *,
    adapter: AdapterConfig | None = None,
    min_reward: float | None = None,
    min_margin: float = 0.0,
    on_progress: OnProgress | None = None,
) -> tuple[list[dict[str, Any]], ExportSummary]:
    """The rows of an export and its summary; ExportError when no rollout matches or none gives a row."""
    from agl_stream.domain.export import Conversation, ExportError, ExportSummary, conversations_of, rows_of
    from agl_stream.kafka.offsets import fence_at_end
    from agl_stream.store.readside import read_side_for

    replayed = await _replay_records(settings, selection.replay) if selection.replay else None
    side = read_side_for(settings)
    try:
        fence: dict[str, dict[int, int]] = {}
        for topic in ("spans", "rollout-state"):  # every span and state written so far is in the tables
            fence.update(await fence_at_end(settings, topic))
        ids = await _chosen(side, settings, selection, fence)
        if replayed is not None:
            wanted = {rollout_id for rollout_id, _ in replayed}
            ids = [i for i in ids if i in wanted]
        if not ids:
            raise ExportError(f"no finished rollout matches {_describe(selection)}; look with `agl-stream sql`")
        summary = ExportSummary()
        conversations: list[Conversation] = []
        for start in range(0, len(ids), CHUNK):
            for trace in await _chunk_traces(side, settings, ids[start : start + CHUNK], replayed):
                found, part = conversations_of(trace, adapter)
                conversations += found
                summary.absorb(part)
            if on_progress is not None:
                on_progress(min(len(ids), start + CHUNK), len(ids))
    except AglError as exc:
        if isinstance(exc, ExportError):
            raise
        raise ExportError(f"reading the rollouts failed: {exc}") from exc
    finally:
        await side.aclose()
    rows = rows_of(conversations, kind, summary, min_reward=min_reward, min_margin=min_margin)
    if not rows:
        reasons = {**summary.skipped_calls, **summary.left_out}
        why = "; ".join(f"{n} {reason}" for reason, n in reasons.items()) or "nothing to pair"
        raise ExportError(f"{summary.rollouts} rollout(s) matched but gave no {kind} row ({why})")
    return rows, summary


def _describe(selection: Selection) -> str:
    parts = [f"--where {selection.where!r}"] if selection.where else []
    if selection.policy_versions:
        parts.append("--policy-version " + ",".join(map(str, selection.policy_versions)))
    if selection.replay:
        parts.append(f"--replay {selection.replay}")
    return " ".join(parts) or "(no filter)"


def write_rows(rows: list[dict[str, Any]], output: OutputFormat, path: Path) -> None:
    """Write rows as JSON lines, or through ``datasets`` as a saved dataset folder or a Parquet file."""
    from agl_stream.domain.export import ExportError

    path.parent.mkdir(parents=True, exist_ok=True)
    if output is OutputFormat.jsonl:
        with path.open("w", encoding="utf-8") as out:
            for row in rows:
                out.write(json.dumps(row, ensure_ascii=False) + "\n")
        return
    try:
        import datasets  # type: ignore[import-untyped]
    except ImportError as exc:  # pragma: no cover - datasets comes with the train and dev extras
        raise ExportError("--format hf and parquet need the `datasets` package; install it or use jsonl") from exc
    try:
        dataset = datasets.Dataset.from_list(rows)
    except (TypeError, ValueError) as exc:  # pyarrow: rows whose values are of different shapes
        raise ExportError(f"the rows do not fit one Arrow schema ({exc}); export with --format jsonl") from exc
    if output is OutputFormat.hf:
        dataset.save_to_disk(str(path))
    else:
        dataset.to_parquet(str(path))


def export(
    ctx: typer.Context,
    out: Annotated[Path, typer.Argument(help="Where to write: a folder (hf) or a file (parquet, jsonl).")],
    kind: Annotated[
        Kind, typer.Option("--kind", help="sft: one chat per row (messages); dpo: prompt/chosen/rejected pairs.")
    ] = Kind.sft,
    output: Annotated[
        OutputFormat,
        typer.Option("--format", help="hf: datasets save_to_disk folder; parquet: one file; jsonl: chat JSON lines."),
    ] = OutputFormat.hf,
    where: Annotated[
        str | None,
        typer.Option(help="SQL condition on the rollouts table, e.g. \"mode = 'train' AND start_time > 1767225600\"."),
    ] = None,
    policy_version: Annotated[
        list[int] | None,
        typer.Option("--policy-version", help="Only rollouts run with this policy version (repeatable)."),
    ] = None,
    replay: Annotated[
        str | None,
        typer.Option(help="Only the attempts of replay NAME's topic, with the replay's rewards and versions."),
    ] = None,
    min_reward: Annotated[float | None, typer.Option(help="sft: only conversations rewarded at least this.")] = None,
    min_margin: Annotated[
        float, typer.Option(min=0.0, help="dpo: pair only when best and worst reward differ by more than this.")
    ] = 0.0,
    overwrite: Annotated[bool, typer.Option(help="Replace OUT if it exists.")] = False,
    llm_call_match: LlmCallMatch = None,
    agent_match: AgentMatch = None,
    reward_match: RewardMatch = "first_occurrence",
    exclude_llm_call_in_reward: ExcludeLlmCallInReward = True,
) -> None:
    """Export finished rollouts' chat messages, tool calls and rewards as TRL training data.

    SFT rows are TRL's conversational format ({"messages", "tools"} plus rollout_id, attempt_id,
    group_id, reward, policy_version); DPO rows are {"prompt", "chosen", "rejected"}: per task,
    its best-rewarded rollout against its worst. The LLM calls are those the trace adapter keeps
    for training. Load with datasets.load_from_disk (hf) or load_dataset("parquet"/"json", ...).
    More: docs/export.md. Example:

        agl-stream export data/sft --where "mode = 'train'" --min-reward 1
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    settings = settings_of(ctx)
    adapter = adapter_config(llm_call_match, agent_match, reward_match, exclude_llm_call_in_reward)
    if out.exists() and not overwrite:
        raise typer.BadParameter(f"{out} exists; pass --overwrite to replace it", param_hint="OUT")
    selection = Selection(where=where, policy_versions=tuple(policy_version or ()), replay=replay)
    console = Console(stderr=True)
    columns = (
        TextColumn("[bold]export {task.fields[kind]}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("rollouts"),
        TimeElapsedColumn(),
    )
    try:
        with Progress(*columns, console=console, transient=True) as progress:
            task = progress.add_task("export", total=None, kind=kind.value)
            rows, summary = asyncio.run(
                collect(
                    settings,
                    selection,
                    kind.value,  # type: ignore[arg-type]
                    adapter=adapter,
                    min_reward=min_reward,
                    min_margin=min_margin,
                    on_progress=lambda done, total: progress.update(task, completed=done, total=total),
                )
            )
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        write_rows(rows, output, out)
    except AglError as error:
        console.print(f"[red]export failed:[/red] {error}")
        raise typer.Exit(1) from error
    said = Console()
    said.print(f"wrote          {summary.rows:,} {kind.value} rows to {out} ({output.value})")
    said.print(
        f"rollouts       {summary.rollouts:,} read, {summary.calls:,} LLM calls, {summary.conversations:,} chats"
    )
    for label, reasons in (("skipped calls", summary.skipped_calls), ("left out", summary.left_out)):
        for reason, count in sorted(reasons.items()):
            said.print(f"{label:<15}{count:,} {reason}")
