"""Collecting each attempt's spans until the attempt is finished and all of them are in (pure).

The triplet builder reads two co-partitioned topics, ``agl.spans`` and ``agl.rollout-state``,
and must turn *all* the spans of an attempt into triplets, once, after the attempt finished.
The two topics are read in no particular order relative to each other, so completeness comes
from a count: every writer of spans also folds a heartbeat with the number it wrote, and the
attempt's finishing state carries the sum (``RolloutState.span_counts``). An attempt is
*ready* when it has finished and that many distinct spans have arrived, or ``settle_s`` after
it finished, whichever is first (a writer that retried a batch reports some spans twice; the
state may also have been judged by the watchdog while spans were still on their way).

Spans of an attempt that never finishes are *evicted* ``max_wait_s`` after its last span, and
the oldest unfinished attempts are evicted when more than ``max_spans`` spans are held: memory
stays bounded, and the evictions are counted.

Every span and state comes with an opaque ``token`` (the processor's handle to acknowledge the
input record); a ready or evicted attempt hands back the tokens of everything it consumed, so
the input is committed only once the attempt's output is durable.

Which states finish an attempt: a finished attempt (succeeded, failed, timeout, unresponsive)
not handed out yet, whose ``end_time`` is the state's cause time (the fold stamps it when the
status changes) or whose spans are being held. After a restart, later states of a rollout
still list attempts finished long ago; those match neither rule and are not emitted again.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeAlias, TypeVar

from agl_stream.domain.adapter import AdapterConfig, AdapterResult, extract_triplets
from agl_stream.domain.adapter.lean import LeanSpan
from agl_stream.models import Attempt, ResourcesUpdate, Rollout, RolloutState, Span, TripletRecord

Token = TypeVar("Token")
AnySpan: TypeAlias = Span | LeanSpan
"""What the collector holds: span models, or the LeanSpans the adapter reads (the live builder
and the replay both hand it LeanSpans; a replay with a ``--reward`` function, models)."""

FINISHED_ATTEMPT_STATUSES = frozenset({"succeeded", "failed", "timeout", "unresponsive"})


def finishes(state: RolloutState, attempt: Attempt) -> bool:
    """Whether ``state`` is the one in which ``attempt`` finished: the fold stamps a finished
    attempt's end time with the cause time of the state it finished in."""
    return (
        attempt.status in FINISHED_ATTEMPT_STATUSES and attempt.end_time is not None
        and attempt.end_time == state.cause_time
    )  # fmt: skip


def finishes_an_attempt(state: RolloutState) -> bool:
    return any(finishes(state, attempt) for attempt in state.attempts)


@dataclass(frozen=True)
class FinishedAttempt:
    """What the finishing state says about an attempt."""

    rollout: Rollout
    attempt: Attempt
    expected_spans: int
    finish_time: float


@dataclass
class _Pending(Generic[Token]):
    spans: dict[tuple[int, str], AnySpan] = field(default_factory=dict)  # (sequence_id, span_id): dedup
    tokens: list[Token] = field(default_factory=list)
    last_activity: float = 0.0
    finished: FinishedAttempt | None = None
    finished_at: float = 0.0  # collector clock when the finishing state arrived


@dataclass(frozen=True)
class ReadyAttempt(Generic[Token]):
    finished: FinishedAttempt
    spans: list[AnySpan]  # in sequence order
    complete: bool  # False: settled before the expected count arrived
    tokens: list[Token]


@dataclass(frozen=True)
class EvictedAttempt(Generic[Token]):
    rollout_id: str
    attempt_id: str
    spans: int
    reason: str
    tokens: list[Token]


@dataclass
class CollectorStats:
    ready: int = 0
    incomplete: int = 0
    evicted: int = 0
    evicted_spans: int = 0
    duplicate_spans: int = 0


class TraceCollector(Generic[Token]):
    def __init__(
        self, *, settle_s: float = 5.0, max_wait_s: float = 600.0, max_spans: int = 200_000, remember: int = 100_000
    ) -> None:
        self.settle_s = settle_s
        self.max_wait_s = max_wait_s
        self.max_spans = max_spans
        self.pending: OrderedDict[tuple[str, str], _Pending[Token]] = OrderedDict()  # oldest activity first
        self.held_spans = 0
        self.handed_out: OrderedDict[tuple[str, str], None] = OrderedDict()  # bounded memory of emitted attempts
        self.remember = remember
        self.stats = CollectorStats()

    # -- input ------------------------------------------------------------------------------

    def add_span(self, span: AnySpan, token: Token, now: float) -> tuple[list[ReadyAttempt[Token]], list[Token]]:
        """A span arrived. Returns attempts now ready, and tokens to acknowledge at once
        (spans of attempts already handed out: late duplicates, nothing to do)."""
        return self.add_spans([span], token, now)

    def add_spans(
        self, spans: Sequence[AnySpan], token: Token, now: float
    ) -> tuple[list[ReadyAttempt[Token]], list[Token]]:
        """Spans of one attempt that came in one input record (an agl.SpanBatch): like
        :meth:`add_span` for each, with the record's token held once by the attempt."""
        if not spans:
            return [], [token]
        key = (spans[0].rollout_id, spans[0].attempt_id)
        if any((span.rollout_id, span.attempt_id) != key for span in spans):
            raise ValueError("add_spans takes spans of one attempt; group them first (spans_by_attempt)")
        if key in self.handed_out:
            self.stats.duplicate_spans += len(spans)
            return [], [token]
        entry = self._entry(key, now)
        for span in spans:
            span_key = (span.sequence_id, span.span_id)
            if span_key in entry.spans:
                self.stats.duplicate_spans += 1
            else:
                entry.spans[span_key] = span
                self.held_spans += 1
        entry.tokens.append(token)
        ready = self._ready_if_complete(key, entry)
        return ready, []

    def add_state(self, state: RolloutState, token: Token, now: float) -> tuple[list[ReadyAttempt[Token]], list[Token]]:
        """A rollout state arrived: attempts it finishes become ready when complete."""
        ready: list[ReadyAttempt[Token]] = []
        claimed_token = False
        for attempt in state.attempts:
            key = (state.rollout.rollout_id, attempt.attempt_id)
            if attempt.status not in FINISHED_ATTEMPT_STATUSES or key in self.handed_out:
                continue
            entry = self.pending.get(key)
            if entry is None and not finishes(state, attempt):
                continue  # finished long ago (a state replayed after a restart), or never ours
            entry = self._entry(key, now)
            if entry.finished is None:
                entry.finished = FinishedAttempt(
                    rollout=state.rollout,
                    attempt=attempt,
                    expected_spans=state.span_counts.get(attempt.attempt_id, 0),
                    finish_time=attempt.end_time or state.cause_time,
                )
                entry.finished_at = now
            if not claimed_token:  # the state record is acknowledged with (one of) its attempts
                entry.tokens.append(token)
                claimed_token = True
            ready += self._ready_if_complete(key, entry)
        return ready, ([] if claimed_token else [token])

    # -- time -------------------------------------------------------------------------------

    def tick(self, now: float) -> tuple[list[ReadyAttempt[Token]], list[EvictedAttempt[Token]]]:
        ready: list[ReadyAttempt[Token]] = []
        evicted: list[EvictedAttempt[Token]] = []
        for key, entry in list(self.pending.items()):
            if entry.finished is not None and now - entry.finished_at >= self.settle_s:
                ready.append(self._hand_out(key, entry, complete=len(entry.spans) >= entry.finished.expected_spans))
            elif entry.finished is None and now - entry.last_activity >= self.max_wait_s:
                evicted.append(self._evict(key, entry, f"no finishing state within {self.max_wait_s:g}s"))
        while self.held_spans > self.max_spans and self.pending:
            # Unfinished attempts go first (oldest activity first); a finished one is emitted
            # as it is rather than dropped.
            unfinished = next(((k, e) for k, e in self.pending.items() if e.finished is None), None)
            if unfinished is not None:
                evicted.append(self._evict(*unfinished, f"over {self.max_spans} spans held"))
            else:
                key, entry = next(iter(self.pending.items()))
                ready.append(self._hand_out(key, entry, complete=False))
        return ready, evicted

    # -- internals --------------------------------------------------------------------------

    def _entry(self, key: tuple[str, str], now: float) -> _Pending[Token]:
        entry = self.pending.get(key)
        if entry is None:
            entry = self.pending[key] = _Pending()
        else:
            self.pending.move_to_end(key)
        entry.last_activity = now
        return entry

    def _ready_if_complete(self, key: tuple[str, str], entry: _Pending[Token]) -> list[ReadyAttempt[Token]]:
        if entry.finished is not None and len(entry.spans) >= entry.finished.expected_spans:
            return [self._hand_out(key, entry, complete=True)]
        return []

    def _forget(self, key: tuple[str, str], entry: _Pending[Token]) -> None:
        del self.pending[key]
        self.held_spans -= len(entry.spans)
        self.handed_out[key] = None
        while len(self.handed_out) > self.remember:
            self.handed_out.popitem(last=False)

    def _hand_out(self, key: tuple[str, str], entry: _Pending[Token], *, complete: bool) -> ReadyAttempt[Token]:
        assert entry.finished is not None
        self._forget(key, entry)
        self.stats.ready += 1
        if not complete:
            self.stats.incomplete += 1
        spans = sorted(entry.spans.values(), key=lambda s: (s.sequence_id, s.span_id))
        return ReadyAttempt(entry.finished, spans, complete, entry.tokens)

    def _evict(self, key: tuple[str, str], entry: _Pending[Token], reason: str) -> EvictedAttempt[Token]:
        self._forget(key, entry)
        self.stats.evicted += 1
        self.stats.evicted_spans += len(entry.spans)
        return EvictedAttempt(key[0], key[1], len(entry.spans), reason, entry.tokens)


_S = TypeVar("_S", Span, LeanSpan, AnySpan)


def spans_by_attempt(spans: Iterable[_S]) -> list[list[_S]]:
    """Spans grouped by (rollout, attempt), groups in order of first appearance, each in the
    given order: what :meth:`TraceCollector.add_spans` takes, from one input record."""
    groups: dict[tuple[str, str], list[_S]] = {}
    for span in spans:
        groups.setdefault((span.rollout_id, span.attempt_id), []).append(span)
    return list(groups.values())


def group_id_of(rollout: Rollout) -> str:
    """The task identity that makes several rollouts one GRPO group.

    ``metadata["group_id"]`` when the producer of the task set one; otherwise a digest of the
    task input (canonical JSON) and mode, so rollouts of the same task group by themselves.
    """
    metadata: Any = rollout.metadata or {}
    given = metadata.get("group_id") if isinstance(metadata, dict) else None
    if isinstance(given, str) and given:
        return given
    canonical = json.dumps([rollout.input, rollout.mode], sort_keys=True, separators=(",", ":"), default=str)
    return "g-" + hashlib.sha256(canonical.encode()).hexdigest()[:16]


def resources_id_of(finished: FinishedAttempt) -> str | None:
    """The resources snapshot the attempt ran with: the one the runner recorded on the attempt
    (``metadata["resources_id"]``), else the rollout's."""
    metadata = finished.attempt.metadata if isinstance(finished.attempt.metadata, dict) else {}
    found = metadata.get("resources_id") or finished.rollout.resources_id
    return found if isinstance(found, str) else None


def triplet_record(
    finished: FinishedAttempt, spans: Sequence[AnySpan], adapter: AdapterConfig, snapshot: ResourcesUpdate | None
) -> tuple[TripletRecord, AdapterResult]:
    """The record of one finished attempt (pure): shared by the live builder and the replay, so
    both derive the same bytes from the same spans and settings."""
    result = extract_triplets(spans, adapter)
    record = TripletRecord(
        rollout_id=finished.rollout.rollout_id,
        attempt_id=finished.attempt.attempt_id,
        group_id=group_id_of(finished.rollout),
        resources_id=resources_id_of(finished),
        policy_version=snapshot.policy_version if snapshot is not None else None,
        triplets=result.triplets,
        final_reward=result.final_reward,
        finish_time=finished.finish_time,
        mode=finished.rollout.mode,  # the batcher refuses val/test records: never trained on
    )
    return record, result
