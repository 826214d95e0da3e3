"""Replay, the functional core: ranges, settings identity, reward overrides, one partition's derivation.

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
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict

from agl_stream.domain.adapter import AdapterConfig
from agl_stream.domain.adapter.lean import LeanSpan
from agl_stream.domain.adapter.span_decoder import SpanRecordDecoder
from agl_stream.domain.adapter.triplet_encoder import TripletRecordEncoder
from agl_stream.domain.fold import fold
from agl_stream.domain.trace_collector import (
    ReadyAttempt,
    TraceCollector,
    resources_id_of,
    spans_by_attempt,
    triplet_record,
)
from agl_stream.errors import AglError, CodecError
from agl_stream.models import ResourcesUpdate, RolloutEvent, RolloutState, Span, TripletRecord
from agl_stream.wire.codec import Codec
from agl_stream.wire.span_records import spans_of

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


# --------------------------------------------------------------------------------------------
# One partition's derivation
# --------------------------------------------------------------------------------------------

_REASONS_KEPT = 5
STATE_TOKEN = -1
"""The collector token of rollout states (spans carry their offset)."""


@dataclass
class Problems:
    """Bad input met on the way: counted, the first reasons kept (never dropped silently)."""

    count: int = 0
    reasons: list[str] = field(default_factory=list)

    def add(self, reason: str) -> None:
        self.count += 1
        if len(self.reasons) < _REASONS_KEPT:
            self.reasons.append(reason)

    def absorb(self, other: Problems) -> None:
        self.count += other.count
        self.reasons = (self.reasons + other.reasons)[:_REASONS_KEPT]


@dataclass
class Tally:
    """What one partition's derivation counted."""

    spans: int = 0
    attempts: int = 0
    incomplete: int = 0
    incomplete_skipped: int = 0
    unfinished_attempts: int = 0
    malformed_spans: Problems = field(default_factory=Problems)  # records of agl.spans (a batch counts once)
    bad_events: Problems = field(default_factory=Problems)
    reward_errors: Problems = field(default_factory=Problems)

    def absorb(self, other: Tally) -> None:
        """Add what ``other`` counted (one partition's derivation into a whole replay's)."""
        for name in (f.name for f in fields(Tally)):
            mine = getattr(self, name)
            if isinstance(mine, Problems):
                mine.absorb(getattr(other, name))
            else:
                setattr(self, name, mine + getattr(other, name))


class PartitionReplay:
    """The pure part of replaying one partition: its rollout events are folded with the
    processor's fold and every state goes into the live builder's :class:`TraceCollector`; then
    the span records go in, and each attempt the collector hands out becomes an
    :class:`OutRecord` through the live builder's :func:`triplet_record`.

    The hot path never builds a span model: records are read into LeanSpans by
    :class:`SpanRecordDecoder` (the adapter's own input) and the output is written by
    :class:`TripletRecordEncoder` (the codec's bytes). A ``--reward`` function needs span models,
    so with one the spans are decoded and validated by the codec instead.
    """

    def __init__(
        self,
        partition: int,
        settings: ReplaySettings,
        resources: Mapping[str, ResourcesUpdate],
        codec: Codec,
        *,
        spans_topic: str = "agl.spans",
        events_topic: str = "agl.rollouts",
    ) -> None:
        self.partition = partition
        self.settings = settings
        self.settings_digest = settings.digest()
        self.resources = resources
        self.codec = codec
        self.spans_topic, self.events_topic = spans_topic, events_topic
        self.reward_fn = load_reward(settings.reward) if settings.reward else None
        self.decoder = SpanRecordDecoder(codec)
        self.encoder = TripletRecordEncoder(codec)
        self.collector: TraceCollector[int] = TraceCollector(max_spans=1 << 62, remember=1 << 62)
        self.states: dict[str, RolloutState] = {}
        self.tally = Tally()
        self.records: list[OutRecord] = []

    def add_event(self, offset: int, value: bytes) -> None:
        """One record of agl.rollouts, in partition order."""
        try:
            event = self.codec.decode(value, RolloutEvent)
        except CodecError as error:
            self.tally.bad_events.add(f"{self.events_topic}[{self.partition}]@{offset}: {error}")
            return
        result = fold(self.states.get(event.rollout_id), event)
        if result.state is None:  # rejected or ignored: the processor dead-lettered/skipped it too
            return
        self.states[event.rollout_id] = result.state
        self.collector.add_state(result.state, STATE_TOKEN, 0.0)

    def _spans_of(self, value: bytes) -> Sequence[Span | LeanSpan]:
        """Lean spans read from the bytes; validated models where a ``--reward`` function reads
        them (what the live builder reads)."""
        if self.reward_fn is None:
            return self.decoder.decode(value)
        return spans_of(self.codec, value)

    def add_spans(self, offset: int, value: bytes) -> None:
        """One record of agl.spans (an agl.Span or an agl.SpanBatch, good or bad as a whole)."""
        try:
            spans = self._spans_of(value)
        except CodecError as error:
            self.tally.malformed_spans.add(f"{self.spans_topic}[{self.partition}]@{offset}: {error}")
            return
        self.tally.spans += len(spans)
        for group in spans_by_attempt(spans):
            ready, _ = self.collector.add_spans(group, offset, 0.0)
            for attempt in ready:
                self._derive((0, offset), attempt)

    def finish(self) -> list[OutRecord]:
        """The partition's records, after what is left: attempts whose spans did not all arrive
        in the range (a boundary cut through them, or spans were lost), and attempts never
        finished in the history read."""
        for entry in list(self.collector.pending.values()):
            if not entry.spans:
                continue  # finished, but none of its spans is in the range: not part of this replay
            if entry.finished is None:
                self.tally.unfinished_attempts += 1
                continue
            self.tally.incomplete += 1
            if self.settings.incomplete == "skip":
                self.tally.incomplete_skipped += 1
                continue
            spans = sorted(entry.spans.values(), key=lambda s: (s.sequence_id, s.span_id))
            last = max(t for t in entry.tokens if t != STATE_TOKEN)
            self._derive((1, last), ReadyAttempt(entry.finished, spans, False, entry.tokens))
        self.collector.pending.clear()
        return self.records

    def _derive(self, position: tuple[int, int], attempt: ReadyAttempt[int]) -> None:
        if not attempt.spans:
            return  # finished with no spans expected: nothing of it is in any range
        self.tally.attempts += 1
        resources_id = resources_id_of(attempt.finished)
        snapshot = self.resources.get(resources_id) if resources_id else None
        record, _ = triplet_record(attempt.finished, attempt.spans, self.settings.adapter, snapshot)
        if self.reward_fn is not None:
            try:
                reward = new_reward(self.reward_fn, cast(list[Span], list(attempt.spans)))
            except RewardError as error:
                self.tally.reward_errors.add(f"{record.rollout_id}/{record.attempt_id}: {error}")
                return
            record = with_reward(record, reward, to_last=self.settings.adapter.final_reward_to_last)
        value = self.encoder.encode(record)
        self.records.append(out_record((self.partition, *position), record, value, self.settings_digest))
