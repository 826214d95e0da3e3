"""``agl-stream enqueue --file tasks.jsonl``: produce task requests to agl.task-requests.

Each line is a JSON object with TaskRequest's fields (``input`` and ``metadata`` as JSON values,
not text). A line without ``request_id`` gets one derived from its text and line number
(agl_stream.domain.ingress.line_request_id), so running the same file again names the same requests
and the ingress processor enqueues each once: an interrupted run is resumed by running it again.
Bad lines are reported (line number and reason) and skipped; the exit code is 1 if any was bad.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Annotated, Optional

import typer
from aiokafka.structs import RecordMetadata
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

from agl_stream.cli.context import settings_of
from agl_stream.codec import Codec
from agl_stream.config import Settings
from agl_stream.domain.ingress import IngressLimits, TaskRequestError, request_from_line, rollout_id_for
from agl_stream.kafka.io import make_producer
from agl_stream.stack import local_stack_settings


class _RateColumn(ProgressColumn):
    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text("-- req/s" if speed is None else f"{speed:,.0f} req/s", style="progress.data.speed")


@dataclass
class EnqueueSummary:
    lines: int = 0
    sent: int = 0
    bad: list[tuple[int, str]] = field(default_factory=list)
    seconds: float = 0.0


async def enqueue_file(
    settings: Settings,
    path: Path,
    *,
    batch_size: int = 1000,
    salt: str = "",
    ids_out: IO[str] | None = None,
    console: Console | None = None,
) -> EnqueueSummary:
    """Send every valid line of ``path`` as a TaskRequest keyed by its request id; wait for the acks."""
    console = console or Console(stderr=True)
    codec = Codec.default()
    limits = IngressLimits.of(settings)
    topic = settings.topic("task-requests")
    summary = EnqueueSummary()
    with path.open("rb") as counting:
        total = sum(1 for raw in counting if raw.strip())
    producer = make_producer(settings)
    await producer.start()
    started = time.perf_counter()
    try:
        with (
            Progress(
                TextColumn("[bold]enqueue[/bold]"),
                BarColumn(),
                MofNCompleteColumn(),
                _RateColumn(),
                TimeElapsedColumn(),
                console=console,
                transient=False,
            ) as progress,
            path.open(encoding="utf-8", errors="replace") as lines,
        ):
            bar = progress.add_task("enqueue", total=total)
            pending: list[asyncio.Future[RecordMetadata]] = []
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                summary.lines += 1
                try:
                    request = request_from_line(line, number, limits, salt=salt)
                except TaskRequestError as error:
                    summary.bad.append((number, str(error)))
                    progress.console.print(f"[red]line {number}[/red]: {error}", markup=True, highlight=False)
                    progress.advance(bar)
                    continue
                key = request.request_id.encode("utf-8")
                pending.append(await producer.send(topic, codec.encode(request), key=key))
                if ids_out is not None:
                    record = {"line": number, "request_id": request.request_id}
                    ids_out.write(json.dumps({**record, "rollout_id": rollout_id_for(request.request_id)}) + "\n")
                if len(pending) >= batch_size:
                    await _acked(pending, progress, bar, summary)
            await _acked(pending, progress, bar, summary)
    finally:
        await producer.stop()
    summary.seconds = time.perf_counter() - started
    return summary


async def _acked(
    pending: list[asyncio.Future[RecordMetadata]], progress: Progress, bar: object, summary: EnqueueSummary
) -> None:
    for future in pending:
        await future
    summary.sent += len(pending)
    progress.advance(bar, len(pending))  # type: ignore[arg-type]
    pending.clear()


def enqueue(
    ctx: typer.Context,
    file: Annotated[
        Path,
        typer.Option("--file", "-f", exists=True, dir_okay=False, readable=True, help="JSON Lines of task requests."),
    ],
    batch_size: Annotated[int, typer.Option(min=1, help="Requests in flight before waiting for the broker.")] = 1000,
    id_salt: Annotated[
        str, typer.Option(help="Mixed into derived request ids: the same file with a new salt is new tasks.")
    ] = "",
    ids: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option(help="Write {line, request_id, rollout_id} per sent line to this JSON Lines file."),
    ] = None,
) -> None:
    """Send a file of tasks (one JSON object per line) to agl.task-requests.

    Fields per line: input (required, any JSON), request_id, mode (train/val/test), resources_id,
    config ({max_attempts, timeout_seconds, unresponsive_seconds, retry_condition}), metadata
    (a JSON object), request_time. A line without request_id gets a stable one derived from its
    text and line number, so rerunning the file never enqueues a task twice. Each task becomes
    rollout ro-<first 12 hex of sha256(request_id)> (docs/contract.md).

    Example: agl-stream enqueue --file tasks.jsonl
    """
    settings = local_stack_settings(settings_of(ctx))
    out = Console(soft_wrap=True)  # the summary is read by scripts too: no line breaks inside it
    ids_file = ids.open("w", encoding="utf-8") if ids is not None else None
    try:
        summary = asyncio.run(enqueue_file(settings, file, batch_size=batch_size, salt=id_salt, ids_out=ids_file))
    finally:
        if ids_file is not None:
            ids_file.close()
    rate = summary.sent / summary.seconds if summary.seconds > 0 else 0.0
    out.print(
        f"sent {summary.sent:,} of {summary.lines:,} task requests to {settings.topic('task-requests')} "
        f"in {summary.seconds:.1f} s ({rate:,.0f} req/s); {len(summary.bad):,} bad lines",
        highlight=False,
    )
    if summary.sent:
        out.print(
            "Repeats of earlier runs are refused by the ingress as duplicates. Status of a task: "
            "agl-stream sql \"SELECT status FROM agl.rollouts FINAL WHERE rollout_id = 'ro-...'\"",
            highlight=False,
        )
    if summary.bad:
        raise typer.Exit(1)
