"""``agl-stream dlq``: read the dead letters on agl.dlq, count them, show one, resubmit them.

Reads the topic itself, not the ``dead_letters`` table: the topic is the truth and holds the
rejected bytes (the table keeps no bytes, so that SQL callers do not see them), and it works
without a gateway. A read is a bounded scan, with no consumer group and no commit: from the
beginning (or ``--since``, by the records' timestamps) to the end offsets as of the start.
The pure parts (selection, counting, decoding, what a resubmission sends) are
agl_stream/domain/dead_letters.py; docs/dlq.md is the guide.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any

import typer

from agl_stream.cli.context import settings_of

if TYPE_CHECKING:
    from agl_stream.config import Settings
    from agl_stream.domain.dead_letters import DeadLetter, Resubmission, Selection

dlq_app = typer.Typer(no_args_is_help=True)

SourceTopic = Annotated[
    str | None,
    typer.Option("--source-topic", "-t", help="Only dead letters of this topic (task-requests or agl.task-requests)."),
]
Reason = Annotated[
    str | None, typer.Option("--reason", "-r", help="Only those whose reason or error type contains this (any case).")
]
Processor = Annotated[str | None, typer.Option(help="Only those this role rejected (ingress, processor, ...).")]
Since = Annotated[
    str | None,
    typer.Option(help="Only those rejected since: 30m, 2h, 7d ago, an ISO date-time (UTC) or epoch seconds."),
]
Json = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
Timeout = Annotated[float, typer.Option(help="Seconds the read of the topic may take.")]


def _selection(
    settings: Settings, source_topic: str | None, reason: str | None, processor: str | None, since: str | None
) -> Selection:
    from agl_stream.domain.dead_letters import Selection, full_topic, parse_since

    return Selection(
        source_topic=None if source_topic is None else full_topic(source_topic, settings.topic_prefix),
        reason=reason,
        processor=processor,
        since=None if since is None else parse_since(since, time.time()),
    )


async def _partitions(settings: Settings, topic: str) -> dict[Any, int]:
    from agl_stream.kafka.offsets import end_offsets

    return dict(await end_offsets(settings, topic))


async def _scan(settings: Settings, since: float | None, timeout: float) -> tuple[list[DeadLetter], int]:
    """Every record on agl.dlq up to its end offsets as of now (from ``since`` on, by timestamp):
    the dead letters, and how many records there are not DLQ records."""
    from aiokafka import TopicPartition

    from agl_stream.kafka.io import make_consumer

    topic = settings.topic("dlq")
    ends: dict[TopicPartition, int] = await _partitions(settings, topic)
    if not any(ends.values()):
        return [], 0
    consumer = make_consumer(settings, group_id=None)
    await consumer.start()
    try:
        consumer.assign(list(ends))
        await consumer.seek_to_beginning(*ends)
        if since is not None:
            found = await consumer.offsets_for_times({tp: int(since * 1000) for tp in ends})
            for tp, end in ends.items():
                at = found.get(tp)
                consumer.seek(tp, at.offset if at is not None else end)
        return await _read_until(consumer, ends, timeout)
    finally:
        await consumer.stop()


async def _read_until(consumer: Any, ends: dict[Any, int], timeout: float) -> tuple[list[DeadLetter], int]:
    from agl_stream.domain.dead_letters import DeadLetter
    from agl_stream.errors import CodecError
    from agl_stream.models import DlqRecord
    from agl_stream.wire.codec import Codec

    codec = Codec.default()
    letters: list[DeadLetter] = []
    foreign = 0
    deadline = time.monotonic() + timeout
    while [tp for tp, end in ends.items() if await consumer.position(tp) < end]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the DLQ topic was not read to its end in {timeout:.0f} s; give a longer --timeout")
        for tp, messages in (await consumer.getmany(*ends, timeout_ms=500)).items():
            for m in messages:
                if m.offset >= ends[tp]:
                    continue
                try:
                    record = codec.decode(m.value or b"", DlqRecord)
                except CodecError:
                    foreign += 1
                    continue
                letters.append(DeadLetter(m.partition, m.offset, m.timestamp, record))
    return letters, foreign


async def _fetch(settings: Settings, ids: Sequence[str], timeout: float) -> list[DeadLetter]:
    """The dead letters named ``<partition>:<offset>``, in the order given."""
    from aiokafka import TopicPartition

    from agl_stream.domain.dead_letters import DlqInputError, format_id, parse_id
    from agl_stream.kafka.io import make_consumer

    topic = settings.topic("dlq")
    wanted = [parse_id(i) for i in ids]
    ends: dict[TopicPartition, int] = await _partitions(settings, topic)
    for partition, offset in wanted:
        end = ends.get(TopicPartition(topic, partition))
        if end is None or offset >= end:
            raise DlqInputError(
                f"no dead letter {format_id(partition, offset)} on {topic} "
                f"({'no such partition' if end is None else f'partition {partition} ends at offset {end}'})"
            )
    consumer = make_consumer(settings, group_id=None)
    await consumer.start()
    found: dict[tuple[int, int], DeadLetter] = {}
    try:
        for partition, offset in dict.fromkeys(wanted):
            tp = TopicPartition(topic, partition)
            consumer.assign([tp])
            consumer.seek(tp, offset)
            letters, foreign = await _read_until(consumer, {tp: offset + 1}, timeout)
            hit = [d for d in letters if d.offset == offset]
            if not hit:
                why = "not a DLQ record" if foreign else "no record there (deleted by retention, or a marker)"
                raise DlqInputError(f"no dead letter {format_id(partition, offset)} on {topic}: {why}")
            found[(partition, offset)] = hit[0]
    finally:
        await consumer.stop()
    return [found[w] for w in wanted]


def _select(
    ctx: typer.Context,
    source_topic: str | None,
    reason: str | None,
    processor: str | None,
    since: str | None,
    timeout: float,
) -> list[DeadLetter]:
    settings = settings_of(ctx)
    selection = _selection(settings, source_topic, reason, processor, since)
    letters, foreign = asyncio.run(_scan(settings, selection.since, timeout))
    if foreign:
        typer.secho(f"{foreign} record(s) on {settings.topic('dlq')} are not DLQ records: skipped", err=True)
    return [d for d in letters if selection.matches(d)]


def _when(seconds: float) -> str:
    from agl_stream.cli.output import format_time

    return format_time(seconds)


def _cut(text: str, width: int) -> str:
    line = " ".join(text.split())
    return line if len(line) <= width else line[: width - 3] + "..."


@dlq_app.command("list")
def list_cmd(
    ctx: typer.Context,
    source_topic: SourceTopic = None,
    reason: Reason = None,
    processor: Processor = None,
    since: Since = None,
    limit: Annotated[int, typer.Option(min=1, help="At most this many, newest first.")] = 50,
    as_json: Json = False,
    timeout: Timeout = 120.0,
) -> None:
    """List dead letters, newest first.

    Each with its id (<partition>:<offset> on the DLQ topic, for `show` and `resubmit`), when and
    where it came from, which role rejected it and why.
    """
    from agl_stream.cli.output import new_table, show
    from agl_stream.domain.dead_letters import newest_first, summary

    chosen = _select(ctx, source_topic, reason, processor, since, timeout)
    shown = newest_first(chosen, limit)
    if as_json:
        typer.echo(json.dumps([summary(d) for d in shown], indent=2))
        return
    table = new_table("id", "rejected", "source topic p:offset", "by", "error", "bytes", "reason")
    for d in shown:
        r = d.record
        size = f"{r.value_size:,}" if d.complete else f"{len(r.value):,} of {r.value_size:,}"
        table.add_row(
            d.id,
            _when(r.time),
            f"{r.source_topic} {r.source_partition}:{r.source_offset}",
            r.processor,
            r.error_type,
            size,
            _cut(r.reason, 160),
        )
    show(table)
    typer.echo(f"{len(shown)} of {len(chosen)} dead letter(s) shown; `agl-stream dlq show ID` for one")


@dlq_app.command("count")
def count_cmd(
    ctx: typer.Context,
    by: Annotated[
        list[str] | None,
        typer.Option(help="Count by these fields (repeatable): source_topic, processor, error_type, reason."),
    ] = None,
    source_topic: SourceTopic = None,
    reason: Reason = None,
    processor: Processor = None,
    since: Since = None,
    as_json: Json = False,
    timeout: Timeout = 120.0,
) -> None:
    """Count dead letters by source topic, rejecting role and error type (or --by), most first."""
    from agl_stream.cli.output import new_table, show
    from agl_stream.domain.dead_letters import count

    fields = by or ["source_topic", "processor", "error_type"]
    rows = count(_select(ctx, source_topic, reason, processor, since, timeout), fields)
    if as_json:
        payload = [
            {
                **dict(zip(fields, r.group, strict=True)),
                "count": r.count,
                "first_time": r.first_time,
                "last_time": r.last_time,
                "newest_id": r.newest_id,
                "newest_reason": r.newest_reason,
            }
            for r in rows
        ]
        typer.echo(json.dumps(payload, indent=2))
        return
    table = new_table(*fields, "count", "first", "last", "newest", "its reason")
    for r in rows:
        table.add_row(
            *(_cut(g, 80) for g in r.group),
            str(r.count),
            _when(r.first_time),
            _when(r.last_time),
            r.newest_id,
            _cut(r.newest_reason, 80),
        )
    show(table)
    typer.echo(f"{sum(r.count for r in rows)} dead letter(s) in {len(rows)} group(s)")


def _expected_records(settings: Settings, source_topic: str) -> list[str]:
    """The record types of a topic of this stack (its value schema, and single spans on spans)."""
    from agl_stream.topics import load_topic_specs
    from agl_stream.wire.span_records import SPAN

    for spec in load_topic_specs():
        if spec.full_name(settings.topic_prefix) == source_topic:
            return [spec.value_schema, SPAN] if spec.name == "spans" else [spec.value_schema]
    return []


@dlq_app.command("show")
def show_cmd(
    ctx: typer.Context,
    dead_letter: Annotated[str, typer.Argument(metavar="ID", help="<partition>:<offset>, as `list` prints.")],
    max_bytes: Annotated[int, typer.Option(min=0, help="Bytes of an undecodable value to print.")] = 512,
    as_json: Json = False,
    timeout: Timeout = 60.0,
) -> None:
    """Show one dead letter, its record decoded when it decodes.

    Why and where it was rejected, then the rejected record decoded with its source topic's
    schema, or its bytes (hex and escaped) with their size when they do not decode.
    """
    from agl_stream.domain.dead_letters import decode_original, escaped, hexdump, summary
    from agl_stream.wire.codec import Codec

    settings = settings_of(ctx)
    [letter] = asyncio.run(_fetch(settings, [dead_letter], timeout))
    facts = summary(letter)
    decoded = decode_original(letter, Codec.default(), _expected_records(settings, letter.record.source_topic))
    value = letter.record.value
    if as_json:
        payload = {
            **facts,
            "record_name": decoded.record_name,
            "decoded": decoded.value,
            "problem": decoded.problem,
            "value_hex": value[:max_bytes].hex(),
        }
        typer.echo(json.dumps(payload, indent=2))
        return
    typer.echo(f"{'id':>17}: {facts['id']}")
    typer.echo(f"{'rejected':>17}: {_when(letter.record.time)}")
    for name in ("source_topic", "source_partition", "source_offset", "processor", "error_type"):
        typer.echo(f"{name:>17}: {facts[name]}")
    typer.echo(f"{'key':>17}: {facts['key']}")
    typer.echo(
        f"{'size':>17}: {letter.record.value_size:,} bytes ({len(value):,} kept), sha256 {facts['value_sha256']}"
    )
    typer.echo(f"{'reason':>17}: {letter.record.reason}")
    if decoded.record_name is not None:
        typer.echo(f"\nthe record, decoded ({decoded.record_name}):")
        typer.echo(json.dumps(decoded.value, indent=2, ensure_ascii=False))
        if decoded.problem:
            typer.secho(f"note: {decoded.problem}", fg=typer.colors.YELLOW)
        return
    typer.secho(f"\nthe record does not decode: {decoded.problem}", fg=typer.colors.YELLOW)
    typer.echo(f"its first {min(len(value), max_bytes):,} of {len(value):,} bytes kept:")
    for line in hexdump(value, max_bytes):
        typer.echo(line)
    typer.echo(f"escaped: {escaped(value, max_bytes)}")


async def _plan(
    settings: Settings, letters: Sequence[DeadLetter]
) -> tuple[list[Resubmission], list[tuple[DeadLetter, str]]]:
    from agl_stream.domain.dead_letters import NotResubmittableError, plan_resubmission
    from agl_stream.kafka.io import DLQ_KEY_HEAD
    from agl_stream.topics import load_topic_specs

    stack_topics = {spec.full_name(settings.topic_prefix) for spec in load_topic_specs()}
    partitions = {}
    for topic in sorted({d.record.source_topic for d in letters} & stack_topics):
        counted = len(await _partitions(settings, topic))
        if counted:
            partitions[topic] = counted
    planned: list[Resubmission] = []
    refused: list[tuple[DeadLetter, str]] = []
    for letter in letters:
        try:
            planned.append(plan_resubmission(letter, settings.topic("dlq"), partitions, key_limit=DLQ_KEY_HEAD))
        except NotResubmittableError as exc:
            refused.append((letter, str(exc)))
    return planned, refused


async def _send(settings: Settings, planned: Sequence[Resubmission]) -> list[tuple[Resubmission, int, int]]:
    from agl_stream.kafka.io import Outbox, Record

    async with Outbox.started(settings, "dlq-resubmit") as outbox:
        acks = await outbox.send_all(
            Record(p.topic, p.key, p.value, p.partition, headers=list(p.headers)) for p in planned
        )
    return [(p, ack.partition, ack.offset) for p, ack in zip(planned, acks, strict=True)]


@dlq_app.command("resubmit")
def resubmit_cmd(
    ctx: typer.Context,
    dead_letters: Annotated[
        list[str] | None, typer.Argument(metavar="ID", help="<partition>:<offset> of each, as `list` prints.")
    ] = None,
    source_topic: SourceTopic = None,
    reason: Reason = None,
    processor: Processor = None,
    since: Since = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Send without asking.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show what would be sent; send nothing.")] = False,
    timeout: Timeout = 120.0,
) -> None:
    """Send dead letters' original bytes (and key) back to their source topic, to be read again.

    Choose them by ID, or by the filters (all that match). Their consumer validates them again:
    one whose problem was fixed (a missing resource published, a schema now known) goes through,
    one still bad is dead-lettered again, as a new dead letter at a new offset. Refused: a dead
    letter from a topic that is not this stack's, from the DLQ itself, whose record was too large
    to be kept whole, or with no value. Sending one twice sends it twice.
    """
    settings = settings_of(ctx)
    if dead_letters and any(v is not None for v in (source_topic, reason, processor, since)):
        raise typer.BadParameter("give dead letter IDs or filters, not both")
    if dead_letters:
        letters = asyncio.run(_fetch(settings, dead_letters, timeout))
    elif any(v is not None for v in (source_topic, reason, processor, since)):
        letters = _select(ctx, source_topic, reason, processor, since, timeout)
    else:
        raise typer.BadParameter("name the dead letters to resubmit (IDs, or --source-topic/--reason/--since)")
    planned, refused = asyncio.run(_plan(settings, letters))
    for letter, why in refused:
        typer.secho(f"refused {letter.id}: {why}", fg=typer.colors.RED, err=True)
    for p in planned:
        where = f"partition {p.partition}" if p.partition is not None else "the key's partition"
        typer.echo(
            f"{p.letter.id}: {len(p.value):,} bytes -> {p.topic} {where}; "
            f"it was rejected by {p.letter.record.processor}: {_cut(p.letter.record.reason, 160)}"
        )
    if not planned:
        typer.echo("nothing to resubmit")
        raise typer.Exit(1 if refused else 0)
    if dry_run:
        typer.echo(f"dry run: {len(planned)} record(s) would be sent; nothing was")
        raise typer.Exit(1 if refused else 0)
    if not yes and not typer.confirm(
        f"Send {len(planned)} record(s) back to their source topic? Each is validated again by its consumer; "
        "one still bad becomes a new dead letter"
    ):
        typer.echo("nothing sent")
        raise typer.Exit(1)
    for p, partition, offset in asyncio.run(_send(settings, planned)):
        typer.echo(f"sent {p.letter.id} -> {p.topic} partition {partition} offset {offset}")
    typer.echo(
        "Each is read again by its consumer; one still bad shows up again in `agl-stream dlq list` with a new id."
    )
    if refused:
        raise typer.Exit(1)
