"""Dead letters (agl.dlq records) as an operator reads them: selecting, counting, decoding what
they rejected, and deciding whether one may go back to its source topic.

Pure: the records come in already read (``agl-stream dlq``, agl_stream/cli/dlq_cmd.py, reads the
topic), the codec and the stack's topics are arguments. A dead letter is named by its position
on agl.dlq, ``<partition>:<offset>``, the name every command prints and takes.
"""

from __future__ import annotations

import base64
import hashlib
import re
import string
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from agl_stream.errors import AglError, CodecError
from agl_stream.models import DlqRecord
from agl_stream.wire.codec import Codec

RESUBMITTED_HEADER = "agl-dlq-resubmitted-from"
"""Header of a resubmitted record: ``<dlq topic>:<partition>:<offset>`` of the dead letter it
came from (the consumers ignore it; a person reading the source topic can tell)."""


class DlqInputError(AglError, ValueError):
    """A dead letter's name (``<partition>:<offset>``, as `agl-stream dlq list` prints), a time or
    a field to count by that is not understood; the message says what is."""


class NotResubmittableError(AglError):
    """A dead letter that must not go back to its source topic; the message says why."""


@dataclass(frozen=True)
class DeadLetter:
    """One agl.dlq record and where it is on agl.dlq."""

    partition: int
    offset: int
    timestamp_ms: int
    record: DlqRecord

    @property
    def id(self) -> str:
        return format_id(self.partition, self.offset)

    @property
    def complete(self) -> bool:
        """Whether the record holds the whole rejected value (it keeps the first 64 KiB only)."""
        size = self.record.value_size
        return size < 0 or size == len(self.record.value)


def format_id(partition: int, offset: int) -> str:
    return f"{partition}:{offset}"


def parse_id(text: str) -> tuple[int, int]:
    """``"2:17"`` -> ``(2, 17)``."""
    partition, sep, offset = text.strip().partition(":")
    if not sep or not partition.isdigit() or not offset.isdigit():
        raise DlqInputError(
            f"{text!r} names no dead letter: give <partition>:<offset> on the DLQ topic, "
            "as `agl-stream dlq list` prints"
        )
    return int(partition), int(offset)


# -- selecting ----------------------------------------------------------------------------------

_AGO = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhdw])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_since(text: str, now: float) -> float:
    """A point in time as seconds since the epoch: ``30m``, ``2h``, ``7d`` (ago, from ``now``), an
    ISO date or date-time (UTC unless it names a zone), or seconds since the epoch."""
    value = text.strip()
    if match := _AGO.match(value.lower()):
        return now - float(match.group(1)) * _UNIT_S[match.group(2)]
    try:
        return float(value)
    except ValueError:
        pass
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise DlqInputError(
            f"--since {text!r}: give a duration ago (30m, 2h, 7d), an ISO date-time (2025-01-31T12:00) "
            "or seconds since the epoch"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when.timestamp()


def full_topic(name: str, prefix: str) -> str:
    """A topic as the user typed it, in full: a declared short name (``task-requests``, no dot)
    gets the prefix; a name with a dot (``agl.task-requests``, another stack's) is full already."""
    return name if "." in name else f"{prefix}.{name}"


@dataclass(frozen=True)
class Selection:
    """Which dead letters a command is about: all of its conditions hold."""

    source_topic: str | None = None  # full name
    reason: str | None = None  # a substring of the reason or the error type, any case
    processor: str | None = None
    since: float | None = None  # rejected at or after (seconds since the epoch)

    def matches(self, letter: DeadLetter) -> bool:
        record = letter.record
        if self.source_topic is not None and record.source_topic != self.source_topic:
            return False
        if self.processor is not None and record.processor != self.processor:
            return False
        if self.since is not None and record.time < self.since:
            return False
        if self.reason is not None:
            needle = self.reason.casefold()
            return needle in record.reason.casefold() or needle in record.error_type.casefold()
        return True


def newest_first(letters: Iterable[DeadLetter], limit: int | None = None) -> list[DeadLetter]:
    """Newest rejection first (ties: the later position on agl.dlq first), at most ``limit``."""
    ordered = sorted(letters, key=lambda d: (d.record.time, d.timestamp_ms, d.partition, d.offset), reverse=True)
    return ordered if limit is None else ordered[:limit]


# -- counting -----------------------------------------------------------------------------------

COUNT_FIELDS = ("source_topic", "processor", "error_type", "reason")
"""What dead letters can be counted by: DlqRecord fields."""


@dataclass(frozen=True)
class CountRow:
    group: tuple[str, ...]
    count: int
    first_time: float
    last_time: float
    newest_id: str
    newest_reason: str


def count(letters: Iterable[DeadLetter], by: Sequence[str]) -> list[CountRow]:
    """Dead letters per group of ``by`` (fields of :data:`COUNT_FIELDS`), most first, with the
    first and last rejection time and the newest one's name and reason."""
    unknown = [f for f in by if f not in COUNT_FIELDS]
    if unknown or not by:
        raise DlqInputError(f"count by {', '.join(by) or 'nothing'}: choose from {', '.join(COUNT_FIELDS)}")
    groups: dict[tuple[str, ...], list[DeadLetter]] = {}
    for letter in letters:
        key = tuple(str(getattr(letter.record, f)) for f in by)
        groups.setdefault(key, []).append(letter)
    rows = []
    for key, members in groups.items():
        newest = newest_first(members, 1)[0]
        times = [m.record.time for m in members]
        rows.append(CountRow(key, len(members), min(times), max(times), newest.id, newest.record.reason))
    return sorted(rows, key=lambda r: (-r.count, r.group))


# -- showing ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decoded:
    """What the rejected bytes are: the record they decode to with the source topic's schema, or
    why they do not."""

    record_name: str | None
    value: Any  # JSON-ready (bytes as base64 text) when decoded, else None
    problem: str | None


def decode_original(letter: DeadLetter, codec: Codec, expected: Iterable[str] = ()) -> Decoded:
    """Decode the rejected value with the codec (single-object Avro: the writer schema is named
    by the header). ``expected``: the record types of the source topic; a record of another type
    is reported, with its value, as not what the topic carries."""
    record = letter.record
    if not letter.complete:
        return Decoded(
            None,
            None,
            f"only the first {len(record.value):,} of {record.value_size:,} bytes were kept: "
            "the record cannot be decoded",
        )
    try:
        name, datum = codec.decode_dict(record.value)
    except CodecError as exc:
        return Decoded(None, None, f"{type(exc).__name__}: {exc}")
    wanted = set(expected)
    problem = None
    if wanted and name not in wanted:
        problem = f"a {name} record, but {record.source_topic} carries {', '.join(sorted(wanted))}"
    return Decoded(name, jsonable(datum), problem)


def jsonable(value: Any) -> Any:
    """A decoded Avro datum as JSON-ready values: bytes become base64 text, tuples lists."""
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode()
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


_PRINTABLE = frozenset((string.ascii_letters + string.digits + string.punctuation + " ").encode())


def hexdump(data: bytes, limit: int = 512) -> list[str]:
    """``offset  hex bytes  |printable|`` lines, 16 bytes each, of at most the first ``limit`` bytes."""
    lines = []
    for start in range(0, min(len(data), limit), 16):
        chunk = data[start : min(start + 16, limit)]
        hexes = " ".join(f"{b:02x}" for b in chunk)
        text = "".join(chr(b) if b in _PRINTABLE else "." for b in chunk)
        lines.append(f"{start:08x}  {hexes:<47}  |{text}|")
    return lines


def escaped(data: bytes, limit: int = 512) -> str:
    """The bytes as escaped text (printable ASCII as itself, the rest ``\\xNN``), cut at ``limit``."""
    text = "".join(
        chr(b) if b in _PRINTABLE and b != 0x5C else "\\\\" if b == 0x5C else f"\\x{b:02x}" for b in data[:limit]
    )
    return text + ("..." if len(data) > limit else "")


def summary(letter: DeadLetter) -> dict[str, Any]:
    """A dead letter's facts, without its bytes (what `list --json` prints per record)."""
    record = letter.record
    return {
        "id": letter.id,
        "time": record.time,
        "time_iso": datetime.fromtimestamp(record.time, timezone.utc).isoformat(timespec="seconds"),
        "source_topic": record.source_topic,
        "source_partition": record.source_partition,
        "source_offset": record.source_offset,
        "processor": record.processor,
        "error_type": record.error_type,
        "reason": record.reason,
        "key": None if record.key is None else record.key.decode("utf-8", "backslashreplace"),
        "value_size": record.value_size,
        "value_kept": len(record.value),
        "value_sha256": record.value_sha256,
    }


# -- resubmitting -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Resubmission:
    """What resubmitting a dead letter sends: its original key and bytes, to the partition of its
    source topic they were read from (by key when the topic has fewer partitions now)."""

    letter: DeadLetter
    topic: str
    partition: int | None
    key: bytes | None
    value: bytes
    headers: tuple[tuple[str, bytes], ...]


def plan_resubmission(
    letter: DeadLetter, dlq_topic: str, partitions: Mapping[str, int], *, key_limit: int
) -> Resubmission:
    """The record to send back for ``letter``, or :class:`NotResubmittableError` saying why not.

    ``partitions``: this stack's topics (full names) and their partition counts; a source topic
    not among them (another stack's, a reply topic, a typo in a foreign writer) is refused, and
    so is agl.dlq itself. The value must be whole (a dead letter keeps its first 64 KiB; its
    SHA-256 must match) and the key shorter than ``key_limit`` (the bytes a dead letter keeps
    of a key: a key that long may have been cut).
    """
    record = letter.record
    topic = record.source_topic
    where = f"dead letter {letter.id}"
    if topic == dlq_topic:
        raise NotResubmittableError(f"{where} was rejected on {dlq_topic} itself: there is nothing to send it back to")
    if topic not in partitions:
        raise NotResubmittableError(
            f"{where} came from {topic}, which is not one of this stack's topics ({', '.join(sorted(partitions))}); "
            "check --topic-prefix / AGL_TOPIC_PREFIX"
        )
    if not record.value:
        raise NotResubmittableError(f"{where} holds no value (a tombstone or an empty record): nothing to resubmit")
    if not letter.complete:
        raise NotResubmittableError(
            f"{where} keeps only the first {len(record.value):,} of {record.value_size:,} bytes of its record; "
            "the whole record is not on the DLQ (find it on "
            f"{topic} partition {record.source_partition} offset {record.source_offset} while retention keeps it)"
        )
    if record.value_sha256 and hashlib.sha256(record.value).hexdigest() != record.value_sha256:
        raise NotResubmittableError(f"{where}: its bytes do not match the SHA-256 it recorded; not sent")
    if record.key is not None and len(record.key) >= key_limit:
        raise NotResubmittableError(
            f"{where}: its key is {len(record.key)} bytes, the most a dead letter keeps, so it may have been cut"
        )
    partition = record.source_partition if 0 <= record.source_partition < partitions[topic] else None
    origin = f"{dlq_topic}:{letter.partition}:{letter.offset}".encode()
    return Resubmission(letter, topic, partition, record.key, record.value, ((RESUBMITTED_HEADER, origin),))
