"""Replay, the functional core: ranges, settings identity, fast span views, reward overrides.

No I/O here (the shell is :mod:`producers.replay`). What makes a replay deterministic
lives here: the settings digest that names a run's records, the canonical order of records and
the digest of the output, each a function of its inputs only.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from agl_stream.domain.adapter import AdapterConfig
from agl_stream.errors import AglError, MalformedRecordError
from agl_stream.models import Span, TripletRecord

RewardFn = Callable[[list[Span]], "float | None"]
IncompletePolicy = Literal["skip", "emit"]

REPLAY_TOPIC_PREFIX = "triplets.replay."
HEADER_SETTINGS = "agl-replay-settings"
"""Header of every replayed record: the digest of the settings that derived it."""
HEADER_ATTEMPT = "agl-replay-attempt"
"""Header of every replayed record: ``rollout_id/attempt_id``, its identity within those settings."""

_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,99}$")
_OFFSETS = re.compile(r"^\s*(\d+)\s*:\s*(\d*)\s*-\s*(\d*)\s*$")
_POSITION = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")
_TRACE_ID = re.compile(r"^[0-9a-f]{32}$")
_SPAN_ID = re.compile(r"^[0-9a-f]{16}$")


class ReplayError(AglError):
    """A replay cannot run as asked (bad name, range, reward function or selection)."""


class RewardError(AglError):
    """A ``--reward`` function raised or returned something that is not a finite number or None."""


# --------------------------------------------------------------------------------------------
# Names and ranges
# --------------------------------------------------------------------------------------------


def replay_topic(prefix: str, name: str) -> str:
    """``<prefix>.triplets.replay.<name>``; the name must be a plain lower-case word."""
    if not _NAME.match(name):
        raise ReplayError(f"replay name {name!r}: use lower-case letters, digits, '-' and '_' (at most 100)")
    return f"{prefix}.{REPLAY_TOPIC_PREFIX}{name}"


def batches_topic_of(prefix: str, name: str) -> str:
    """Where `agl-stream batcher --input-topic <replay topic>` writes the replay's batches."""
    return f"{prefix}.triplet-batches.replay.{name}"


def parse_time(text: str) -> float:
    """Seconds since the epoch from epoch seconds (``1767225600.5``) or ISO 8601 (UTC if naive)."""
    try:
        value = float(text)
    except ValueError:
        try:
            moment = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
        except ValueError as exc:
            raise ReplayError(f"time {text!r} is neither epoch seconds nor ISO 8601") from exc
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=timezone.utc)
        return moment.timestamp()
    if not math.isfinite(value) or value < 0:
        raise ReplayError(f"time {text!r} is not a non-negative number of seconds")
    return value


Bounds = dict[int, tuple[int | None, int | None]]
"""Per partition: (first offset, end offset exclusive); None: the partition's beginning / end."""


@dataclass(frozen=True)
class Selection:
    """Which history to replay: offset bounds and/or a time range of agl.spans, and/or SQL
    returning rollout ids (first column)."""

    offsets: Bounds | None = None
    from_time: float | None = None
    to_time: float | None = None
    sql: str | None = None


def parse_offset_ranges(ranges: Iterable[str] = (), starts: Iterable[str] = (), ends: Iterable[str] = ()) -> Bounds:
    """``P:FROM-TO`` ranges (either side may be empty) plus ``P:OFFSET`` starts and ends.

    TO is exclusive, like a Python slice: ``0:100-200`` is offsets 100..199 of partition 0.
    Partitions named nowhere are not read once any partition is named.
    """
    bounds: Bounds = {}

    def put(partition: int, lo: int | None, hi: int | None, text: str) -> None:
        old_lo, old_hi = bounds.get(partition, (None, None))
        if (lo is not None and old_lo is not None) or (hi is not None and old_hi is not None):
            raise ReplayError(f"offsets {text!r}: partition {partition} is bounded twice on that side")
        new = (lo if lo is not None else old_lo, hi if hi is not None else old_hi)
        if new[0] is not None and new[1] is not None and new[1] < new[0]:
            raise ReplayError(f"offsets {text!r}: partition {partition} ends before it starts")
        bounds[partition] = new

    for text in ranges:
        m = _OFFSETS.match(text)
        if m is None:
            raise ReplayError(f"offsets {text!r}: expected PARTITION:FROM-TO, e.g. 0:100-200")
        put(int(m[1]), int(m[2]) if m[2] else None, int(m[3]) if m[3] else None, text)
    for texts, side in ((starts, 0), (ends, 1)):
        for text in texts:
            m = _POSITION.match(text)
            if m is None:
                raise ReplayError(f"offset {text!r}: expected PARTITION:OFFSET, e.g. 0:100")
            put(int(m[1]), int(m[2]) if side == 0 else None, int(m[2]) if side == 1 else None, text)
    return bounds


def resolve_ranges(
    beginnings: Mapping[int, int],
    ends: Mapping[int, int],
    bounds: Bounds | None = None,
    time_starts: Mapping[int, int | None] | None = None,
    time_ends: Mapping[int, int | None] | None = None,
) -> dict[int, tuple[int, int]]:
    """The offsets to read per partition: the intersection of the history there is
    ``[beginning, end)``, the offset bounds and the time bounds (a time offset of None is the
    end: nothing at or after that time). Empty ranges are kept as (x, x)."""
    resolved: dict[int, tuple[int, int]] = {}
    for partition in sorted(ends):
        if bounds and partition not in bounds:
            continue
        lo, hi = beginnings.get(partition, 0), ends[partition]
        b_lo, b_hi = (bounds or {}).get(partition, (None, None))
        if b_lo is not None:
            lo = max(lo, b_lo)
        if b_hi is not None:
            hi = min(hi, b_hi)
        if time_starts is not None:
            start = time_starts.get(partition)
            lo = max(lo, ends[partition] if start is None else start)
        if time_ends is not None:
            stop = time_ends.get(partition)
            if stop is not None:
                hi = min(hi, stop)
        resolved[partition] = (lo, max(lo, hi))
    unknown = sorted(set(bounds or {}) - set(ends))
    if unknown:
        raise ReplayError(f"offsets name partitions the spans topic does not have: {unknown}")
    return resolved


# --------------------------------------------------------------------------------------------
# Settings identity
# --------------------------------------------------------------------------------------------


class ReplaySettings(BaseModel):
    """What decides a replayed record's content, besides the spans: its identity is
    (these settings' digest, rollout id, attempt id)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    adapter: AdapterConfig = AdapterConfig()
    reward: str | None = None
    incomplete: IncompletePolicy = "skip"

    def digest(self) -> str:
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:32]


# --------------------------------------------------------------------------------------------
# Spans on the hot path
# --------------------------------------------------------------------------------------------

_SPAN_FIELDS = frozenset(Span.model_fields)


def span_view(datum: dict[str, Any]) -> Span:
    """A :class:`Span` over a decoded agl.Span dict, without pydantic validation.

    The Avro schema already guarantees every type the model checks (strings, longs, doubles,
    the attribute union); what it cannot say is checked here: the hex shape of the ids. Nested
    records stay dicts, which the adapter never reads; a user's ``--reward`` function gets
    validated spans instead (:func:`validated_span`).
    """
    trace_id, span_id = datum.get("trace_id"), datum.get("span_id")
    if not isinstance(trace_id, str) or not _TRACE_ID.match(trace_id):
        raise MalformedRecordError(f"agl.Span: trace_id {trace_id!r} is not 32 lower-case hex digits")
    if not isinstance(span_id, str) or not _SPAN_ID.match(span_id):
        raise MalformedRecordError(f"agl.Span: span_id {span_id!r} is not 16 lower-case hex digits")
    span = Span.__new__(Span)
    # What BaseModel.model_construct does, minus its per-field default handling (every field
    # is present in a decoded record): ~1 us instead of ~20 us per span.
    object.__setattr__(span, "__dict__", datum)
    object.__setattr__(span, "__pydantic_fields_set__", set(_SPAN_FIELDS))
    object.__setattr__(span, "__pydantic_extra__", None)
    object.__setattr__(span, "__pydantic_private__", None)
    return span


def validated_span(datum: dict[str, Any]) -> Span:
    try:
        return Span.model_validate(datum)
    except ValueError as exc:
        raise MalformedRecordError(f"agl.Span does not validate: {exc}") from exc


# --------------------------------------------------------------------------------------------
# Reward override
# --------------------------------------------------------------------------------------------


def load_reward(ref: str) -> RewardFn:
    """Import ``pkg.mod:fn``; it is called with the attempt's spans (sequence order)."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise ReplayError(f"--reward {ref!r}: expected pkg.module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ReplayError(f"--reward {ref!r}: cannot import {module_name}: {exc}") from exc
    fn: Any = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
    if not callable(fn):
        raise ReplayError(f"--reward {ref!r}: {attr} is not a function of {module_name}")
    return fn  # type: ignore[no-any-return]


def new_reward(fn: RewardFn, spans: list[Span]) -> float | None:
    """The reward ``fn`` gives an attempt; RewardError when it raises or returns a non-number."""
    try:
        value: Any = fn(spans)
    except Exception as exc:  # a user's function: any failure is this attempt's, not the replay's
        raise RewardError(f"{type(exc).__name__}: {exc}") from exc
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RewardError(f"returned {value!r}, not a finite number or None")
    return float(value)


def with_reward(record: TripletRecord, reward: float | None, *, to_last: bool) -> TripletRecord:
    """The record with ``reward`` as its final reward. A triplet that carried the old final
    reward (``reward_source == "final_reward"``) carries the new one; so does the last triplet
    when it got nothing from reward matching and ``to_last`` (the adapter's
    ``final_reward_to_last``) holds."""
    triplets = list(record.triplets)
    for index, triplet in enumerate(triplets):
        source = triplet.metadata.get("reward_source")
        is_last_open = to_last and index == len(triplets) - 1 and triplet.reward is None
        if source == "final_reward" or is_last_open:
            metadata = {**triplet.metadata, "reward_source": "replay_reward" if reward is not None else None}
            if reward is None:
                metadata["reward_span_id"] = None
            triplets[index] = triplet.model_copy(update={"reward": reward, "metadata": metadata})
    return record.model_copy(update={"final_reward": reward, "triplets": triplets})


# --------------------------------------------------------------------------------------------
# Output: canonical order and digest
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OutRecord:
    """One record to write. ``position`` orders the output: (source partition, offset of the
    span that completed the attempt; for an incomplete attempt, the range end + its last span)."""

    position: tuple[int, int, int]
    rollout_id: str
    attempt_id: str
    key: bytes
    value: bytes
    timestamp_ms: int
    headers: tuple[tuple[str, bytes], ...]

    @property
    def identity(self) -> tuple[bytes, bytes]:
        headers = dict(self.headers)
        return headers[HEADER_SETTINGS], headers[HEADER_ATTEMPT]


def out_record(position: tuple[int, int, int], record: TripletRecord, value: bytes, settings_digest: str) -> OutRecord:
    """Key group id (so a GRPO group meets in one partition, as live), Kafka timestamp the
    attempt's finish time (never the wall clock), identity headers."""
    return OutRecord(
        position=position,
        rollout_id=record.rollout_id,
        attempt_id=record.attempt_id,
        key=record.group_id.encode(),
        value=value,
        timestamp_ms=round(record.finish_time * 1000),
        headers=(
            (HEADER_SETTINGS, settings_digest.encode()),
            (HEADER_ATTEMPT, f"{record.rollout_id}/{record.attempt_id}".encode()),
        ),
    )


def canonical(records: Iterable[OutRecord]) -> list[OutRecord]:
    return sorted(records, key=lambda r: r.position)


def output_digest(records: Sequence[OutRecord]) -> str:
    """SHA-256 over every record's key, value, timestamp and headers, in canonical order."""
    digest = hashlib.sha256()
    for record in records:
        parts = [record.key, record.value, str(record.timestamp_ms).encode()]
        for name, value in record.headers:
            parts += [name.encode(), value]
        for part in parts:
            digest.update(len(part).to_bytes(8, "little"))
            digest.update(part)
    return digest.hexdigest()
