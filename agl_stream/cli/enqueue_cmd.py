"""``agl-stream enqueue --file tasks.jsonl``: produce task requests to agl.task-requests.

Each line is a JSON object with TaskRequest's fields (``input`` and ``metadata`` as JSON values,
not text). A line without ``request_id`` gets one derived from its text and line number
(agl_stream.domain.ingress.line_request_id), so running the same file again names the same
requests: an interrupted run is resumed by running it again.

Before sending a batch, the command asks ClickHouse (through the gateway, as the ingress does)
what the batch's rollouts hold, and classifies each request with the ingress's own rule
(agl_stream.domain.ingress.classify): a copy of a request already enqueued is counted "already
enqueued" and not sent; a request whose rollout holds a different request is refused like an
invalid line. When ClickHouse cannot be asked, everything valid is sent and the ingress answers
the copies (counted in its metrics, never dead-lettered).

Exit codes: 0 every line sent or already enqueued; 1 Kafka could not be reached or did not take
a request (one line on stderr; nothing after that point was sent); 3 some lines were refused
(each on stderr with its line number; the other lines were sent); 130 interrupted (Ctrl-C:
a summary of what was sent so far).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Annotated

import typer

from agl_stream.cli import output
from agl_stream.cli.context import settings_of
from agl_stream.errors import AglError

if TYPE_CHECKING:
    from aiokafka import AIOKafkaProducer
    from aiokafka.structs import RecordMetadata
    from rich.console import Console
    from rich.progress import Progress, ProgressColumn, TaskID

    from agl_stream.config import Settings
    from agl_stream.domain.ingress import HeldRequest
    from agl_stream.models import TaskRequest
    from agl_stream.store.readside import ReadSide

EXIT_REFUSED = 3
EXIT_INTERRUPTED = 130
_ASK_TIMEOUT_S = 10.0


class EnqueueInterrupted(Exception):
    """Ctrl-C: the batch in flight was finished, nothing more is sent."""


class EnqueueFailedError(AglError):
    """Kafka could not be reached, or did not acknowledge a request (the message says which)."""


def _rate_column() -> ProgressColumn:
    """Requests acknowledged per second, for the progress bar."""
    from rich.progress import ProgressColumn, Task
    from rich.text import Text

    class RateColumn(ProgressColumn):
        def render(self, task: Task) -> Text:
            speed = task.finished_speed or task.speed
            return Text("-- req/s" if speed is None else f"{speed:,.0f} req/s", style="progress.data.speed")

    return RateColumn()


@dataclass
class EnqueueSummary:
    """What a run did so far (filled in as it goes, so an interrupted run can still tell)."""

    lines: int = 0
    sent: int = 0
    """Requests the broker acknowledged."""
    already: int = 0
    """Requests whose rollout already holds them (a re-run): answered, not sent."""
    refused: list[tuple[int, str]] = field(default_factory=list)
    """(line number, reason): invalid lines, and requests whose rollout holds another request."""
    unchecked: str | None = None
    """Why ClickHouse could not be asked (then copies were sent, and the ingress answers them)."""
    seconds: float = 0.0

    def line(self, topic: str) -> str:
        rate = self.sent / self.seconds if self.seconds > 0 else 0.0
        text = (
            f"sent {self.sent:,} of {self.lines:,} task requests to {topic} in {self.seconds:.1f} s "
            f"({rate:,.0f} req/s); {self.already:,} already enqueued; {len(self.refused):,} refused lines"
        )
        if self.unchecked is not None:
            text += f" (ClickHouse not asked, the ingress answers copies: {self.unchecked})"
        return text


@dataclass
class _Pending:
    number: int
    request: TaskRequest


class _Run:
    """One run over a file: batches of valid lines, classified, the new ones sent and acked."""

    def __init__(
        self,
        settings: Settings,
        producer: AIOKafkaProducer,
        summary: EnqueueSummary,
        progress: Progress,
        bar: TaskID,
        ids_out: IO[str] | None,
    ) -> None:
        from agl_stream.domain.ingress import RecentRequests
        from agl_stream.wire.codec import Codec

        self.settings = settings
        self.producer = producer
        self.summary = summary
        self.progress = progress
        self.bar = bar
        self.ids_out = ids_out
        self.codec = Codec.default()
        self.topic = settings.topic("task-requests")
        self.seen = RecentRequests()  # this run's own requests: a line repeated in the file
        self._reads: ReadSide | None = None

    def refuse(self, number: int, reason: str) -> None:
        self.summary.refused.append((number, reason))
        self.progress.console.print(f"[red]line {number}[/red]: {reason}", markup=True, highlight=False)
        self.progress.advance(self.bar)

    async def _stored(self, batch: list[_Pending]) -> dict[str, HeldRequest]:
        from agl_stream.domain.ingress import held_from_rows, stored_rollouts_query
        from agl_stream.logs import describe
        from agl_stream.store.readside import read_side_for

        if self.summary.unchecked is not None:
            return {}  # asked once and failed: no wait per batch
        request_ids = [p.request.request_id for p in batch]
        sql, parameters = stored_rollouts_query(self.settings.clickhouse_database, request_ids)
        try:
            if self._reads is None:
                self._reads = read_side_for(self.settings)
            # At most this long in all: a gateway recorded but gone would be asked again for a minute.
            result = await asyncio.wait_for(self._reads.query(sql, parameters, timeout=_ASK_TIMEOUT_S), _ASK_TIMEOUT_S)
        except (AglError, OSError) as error:  # OSError includes the TimeoutError of wait_for
            self.summary.unchecked = describe(error).splitlines()[0][:200]
            return {}
        return held_from_rows(result.rows)

    async def flush(self, batch: list[_Pending]) -> None:
        """Classify the batch, send its new requests and wait until the broker took them all."""
        from aiokafka.errors import KafkaError

        from agl_stream.domain.ingress import HeldRequest, TaskRequestError, classify, rollout_id_for, stored_for

        stored = await self._stored(batch)
        futures: list[asyncio.Future[RecordMetadata]] = []
        sent: list[_Pending] = []
        for pending in batch:
            request = pending.request
            rollout_id = rollout_id_for(request.request_id)
            held = self.seen.held(rollout_id) or stored_for(stored, request.request_id)
            try:
                answer = classify(request, held)
            except TaskRequestError as conflict:
                self.refuse(pending.number, str(conflict))
                continue
            if answer is not None:
                self.summary.already += 1
                self._write_id(pending, answer.rollout_id, "already_enqueued")
                self.progress.advance(self.bar)
                continue
            key = request.request_id.encode("utf-8")
            try:
                futures.append(await self.producer.send(self.topic, self.codec.encode(request), key=key))
            except KafkaError as error:
                raise EnqueueFailedError(f"sending to {self.topic} failed: {type(error).__name__}: {error}") from error
            self.seen.add(HeldRequest.of(request))
            sent.append(pending)
        for pending, future in zip(sent, futures, strict=True):
            try:
                await future
            except KafkaError as error:
                raise EnqueueFailedError(
                    f"the broker did not take line {pending.number}: {type(error).__name__}: {error}"
                ) from error
            self.summary.sent += 1
            self._write_id(pending, rollout_id_for(pending.request.request_id), "sent")
            self.progress.advance(self.bar)
        batch.clear()

    def _write_id(self, pending: _Pending, rollout_id: str, outcome: str) -> None:
        if self.ids_out is not None:
            record = {"line": pending.number, "request_id": pending.request.request_id, "rollout_id": rollout_id}
            self.ids_out.write(json.dumps({**record, "outcome": outcome}) + "\n")

    async def aclose(self) -> None:
        if self._reads is not None:
            await self._reads.aclose()


def _on_first_interrupt() -> asyncio.Event:
    """An event the first SIGINT sets; the handler then steps aside for Python's own (a second
    Ctrl-C raises KeyboardInterrupt). Where the loop cannot take signals, the event is never set."""
    loop = asyncio.get_running_loop()
    interrupted = asyncio.Event()

    def first() -> None:
        interrupted.set()
        loop.remove_signal_handler(signal.SIGINT)

    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # no signals off the main thread
        loop.add_signal_handler(signal.SIGINT, first)
    return interrupted


async def _started_producer(settings: Settings) -> AIOKafkaProducer:
    """A started producer, or EnqueueFailedError saying which bootstrap did not answer."""
    from aiokafka.errors import KafkaError

    from agl_stream.kafka.io import make_producer

    producer = make_producer(settings)
    client_log = logging.getLogger("aiokafka")
    level = client_log.level
    client_log.setLevel(logging.CRITICAL)  # its "Unable connect to ..." lines: the error below says it once
    try:
        await producer.start()
    except (KafkaError, OSError) as error:
        await producer.stop()  # a producer that failed to start still holds its client
        raise EnqueueFailedError(
            f"cannot reach Kafka at {settings.bootstrap_servers} ({type(error).__name__}): start the local stack "
            "with `agl-stream up`, or set AGL_KAFKA_BOOTSTRAP to your cluster"
        ) from error
    finally:
        client_log.setLevel(level)
    return producer


async def enqueue_file(
    settings: Settings,
    path: Path,
    *,
    batch_size: int = 1000,
    salt: str = "",
    ids_out: IO[str] | None = None,
    console: Console | None = None,
    summary: EnqueueSummary | None = None,
) -> EnqueueSummary:
    """Send every valid, new line of ``path`` as a TaskRequest keyed by its request id; wait for
    the acks. ``summary`` (filled in as the run goes) says what was done even when it fails."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from agl_stream.domain.ingress import IngressLimits, TaskRequestError, request_from_line

    console = console or output.console(stderr=True)
    limits = IngressLimits.of(settings)
    summary = summary if summary is not None else EnqueueSummary()
    # Ctrl-C ends the run between batches (EnqueueInterrupted), so the summary counts exactly
    # what the broker took. Cancelling the task instead was not reliable: a cancellation that
    # lands while asyncio.wait_for's inner call completes can be lost on Python 3.11, and the
    # command then went on sending the whole file. A second Ctrl-C interrupts at once.
    interrupted = _on_first_interrupt()
    with path.open("rb") as counting:
        total = sum(1 for raw in counting if raw.strip())
    producer = await _started_producer(settings)
    started = time.perf_counter()
    try:
        with (
            Progress(
                TextColumn("[bold]enqueue[/bold]"),
                BarColumn(),
                MofNCompleteColumn(),
                _rate_column(),
                TimeElapsedColumn(),
                console=console,
                transient=False,
            ) as progress,
            path.open(encoding="utf-8", errors="replace") as lines,
        ):
            run = _Run(settings, producer, summary, progress, progress.add_task("enqueue", total=total), ids_out)
            try:
                batch: list[_Pending] = []
                for number, line in enumerate(lines, start=1):
                    if interrupted.is_set():
                        raise EnqueueInterrupted
                    if not line.strip():
                        continue
                    summary.lines += 1
                    try:
                        batch.append(_Pending(number, request_from_line(line, number, limits, salt=salt)))
                    except TaskRequestError as error:
                        run.refuse(number, str(error))
                        continue
                    if len(batch) >= batch_size:
                        await run.flush(batch)
                await run.flush(batch)
            finally:
                await run.aclose()
    finally:
        summary.seconds = time.perf_counter() - started
        await producer.stop()
    return summary


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
        Path | None,
        typer.Option(help="Write {line, request_id, rollout_id, outcome} per sent or already enqueued line here."),
    ] = None,
) -> None:
    """Send a file of tasks (one JSON object per line) to agl.task-requests.

    Fields per line: input (required, any JSON), request_id, mode (train/val/test), resources_id,
    config ({max_attempts, timeout_seconds, unresponsive_seconds, retry_condition}), metadata
    (a JSON object), request_time. A line without request_id gets a stable one derived from its
    text and line number, so rerunning the file never enqueues a task twice: lines already
    enqueued are counted "already enqueued" and not sent. Each task becomes rollout
    ro-<first 32 hex of sha256(request_id)> (docs/contract.md).

    Exit codes: 0 all lines sent or already enqueued; 1 Kafka unreachable or a send failed (one
    line on stderr); 3 some lines refused (invalid, or their request id already names another
    task; listed on stderr, the other lines were sent); 130 interrupted (what was sent so far is
    printed; run the file again to resume).

    Example: agl-stream enqueue --file tasks.jsonl
    """
    from rich.console import Console

    from agl_stream.local.stack import local_stack_settings

    settings = local_stack_settings(settings_of(ctx))
    out = Console(soft_wrap=True)  # the summary is read by scripts too: no line breaks inside it
    topic = settings.topic("task-requests")
    summary = EnqueueSummary()
    ids_file = ids.open("w", encoding="utf-8") if ids is not None else None
    try:
        asyncio.run(
            enqueue_file(settings, file, batch_size=batch_size, salt=id_salt, ids_out=ids_file, summary=summary)
        )
    except (EnqueueInterrupted, KeyboardInterrupt):
        out.print(f"interrupted: {summary.line(topic)}; run the same command again to resume", highlight=False)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except EnqueueFailedError:
        if summary.sent or summary.already:
            out.print(summary.line(topic), highlight=False)
        raise  # the CLI's entry point prints "error: <message>" on one line and exits 1
    finally:
        if ids_file is not None:
            ids_file.close()
    out.print(summary.line(topic), highlight=False)
    if summary.sent:
        out.print(
            "Status of a task: agl-stream sql \"SELECT status FROM agl.rollouts FINAL WHERE rollout_id = 'ro-...'\"",
            highlight=False,
        )
    if summary.refused:
        raise typer.Exit(EXIT_REFUSED)
