"""The bounded, thread-safe span buffer between the ends of spans and the exporter.

Spans end on any thread (the event loop, agent threads); the exporter runs on the loop. Every
mutation of the queue, of an attempt's bookkeeping and of the counters happens under one
condition variable, which is also what a thread waits on when the buffer is full.
"""

from __future__ import annotations

import asyncio
import enum
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeAlias

from opentelemetry.sdk.trace import ReadableSpan

from agl_stream.agent.tracing.export_policy import ExportPolicy
from agl_stream.models import Span
from agl_stream.wire.semconv import (
    ATTEMPT_ID_KEY,
    POLICY_VERSION,
    ROLLOUT_ID_KEY,
    SEQUENCE_ID_KEY,
)

SpanKey: TypeAlias = tuple[int, int]
"""(trace_id, span_id) of an OpenTelemetry span: how its start and its end are matched."""


@dataclass
class AttemptTrace:
    """What the runner sees of one attempt's tracing.

    ``spans`` are the spans the store acknowledged (in sequence order once the attempt exited);
    ``next_sequence_id`` is the id the next span would have taken (number spans you add yourself
    from it: ids taken by spans that were then lost are not reused); ``dropped`` counts this
    attempt's spans that were lost (late, unfinished, overflow, invalid, export failed);
    ``export_error`` says why spans of it could not be exported after every retry (the store
    unreachable: the trace is incomplete), None when every export got through or failed only
    for its records (a span too large).
    """

    rollout_id: str
    attempt_id: str
    next_sequence_id: int = 1
    spans: list[Span] = field(default_factory=list)
    dropped: int = 0
    policy_version: int | None = None  # tagged on every span (POLICY_VERSION) when known
    export_error: str | None = None


class SpanOwner(Protocol):
    """The tracer an attempt belongs to, as the span processor sees it. Neither method may raise."""

    def span_started(self, state: AttemptState, key: SpanKey) -> bool: ...

    def span_ended(self, state: AttemptState, key: SpanKey, span: ReadableSpan) -> None: ...


class AttemptState:
    """One attempt's bookkeeping inside a tracer; guarded by the buffer's lock."""

    def __init__(self, trace: AttemptTrace, owner: SpanOwner) -> None:
        self.trace = trace
        self.owner = owner  # the tracer whose buffer holds this attempt's spans
        self.open: set[SpanKey] = set()  # started, not yet ended
        self.pending = 0  # accepted, neither acknowledged nor dropped yet
        self.closed = False
        self.drained = asyncio.Event()  # set (on the loop) once closed and nothing is pending


class Outcome(enum.Enum):
    ACCEPTED = "accepted"
    WAKE = "accepted, wake the exporter"
    GONE = "already accounted for"  # its attempt closed while it was open: counted as unfinished
    LATE = "late"
    OVERFLOW = "overflow"


@dataclass
class Counts:
    exported: int = 0
    late: int = 0
    unfinished: int = 0
    overflow: int = 0
    invalid: int = 0
    export_failed: int = 0
    blocked: int = 0  # times a thread had to wait for room


Item: TypeAlias = tuple[AttemptState, Span]


class SpanBuffer:
    """Spans accepted and not yet settled, at most ``max_spans`` for threads, ``hard_max`` for the loop."""

    def __init__(
        self, policy: ExportPolicy, max_spans: int, hard_max: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if max_spans < 1 or hard_max < max_spans:
            raise ValueError("need 1 <= max_spans <= hard_max")
        self.policy = policy
        self.max_spans = max_spans
        self.hard_max = hard_max
        self.counts = Counts()
        self._clock = clock
        self._cond = threading.Condition()
        self._queue: deque[tuple[float, AttemptState, Span]] = deque()
        self._pending = 0

    @property
    def pending(self) -> int:
        """Spans accepted and not yet acknowledged or dropped (queued or being exported)."""
        return self._pending

    def started(self, state: AttemptState, key: SpanKey) -> bool:
        """A span of ``state`` started; False (counted late) when the attempt already closed."""
        with self._cond:
            if state.closed:
                self.counts.late += 1
                state.trace.dropped += 1
                return False
            state.open.add(key)
            return True

    def offer(self, state: AttemptState, key: SpanKey, span: Span, *, block: bool, timeout: float) -> Outcome:
        """Accept an ended span and give it the attempt's next sequence id.

        ``block``: the caller may wait up to ``timeout`` for the pending count to fall under
        ``max_spans``; a caller that may not block (the loop thread) is held to ``hard_max``.
        The sequence id is taken only once the span is accepted, so ids stay gap-free.
        """
        with self._cond:
            if key not in state.open:
                return Outcome.GONE
            state.open.discard(key)
            if block and self._pending >= self.max_spans and not state.closed:
                self.counts.blocked += 1
                self._cond.wait_for(lambda: self._pending < self.max_spans or state.closed, timeout)
            if state.closed:  # closed while this thread waited for room
                self.counts.late += 1
                state.trace.dropped += 1
                return Outcome.LATE
            if self._pending >= (self.max_spans if block else self.hard_max):
                self.counts.overflow += 1
                state.trace.dropped += 1
                return Outcome.OVERFLOW
            trace = state.trace
            sequence_id = trace.next_sequence_id
            trace.next_sequence_id += 1
            span.sequence_id = sequence_id
            span.attributes[ROLLOUT_ID_KEY] = trace.rollout_id
            span.attributes[ATTEMPT_ID_KEY] = trace.attempt_id
            span.attributes[SEQUENCE_ID_KEY] = sequence_id
            if trace.policy_version is not None:
                span.attributes.setdefault(POLICY_VERSION, trace.policy_version)
            self._queue.append((self._clock(), state, span))
            self._pending += 1
            state.pending += 1
            return Outcome.WAKE if self.policy.wakes(len(self._queue)) else Outcome.ACCEPTED

    def reject(self, state: AttemptState, key: SpanKey) -> bool:
        """An ended span that cannot be converted: counted invalid (False if already accounted for)."""
        with self._cond:
            if key not in state.open:
                return False
            state.open.discard(key)
            self.counts.invalid += 1
            state.trace.dropped += 1
            return True

    def close(self, state: AttemptState) -> list[SpanKey]:
        """Close an attempt: later spans are late; the spans still open are counted unfinished (returned)."""
        with self._cond:
            state.closed = True
            unfinished = list(state.open)
            state.open.clear()
            self.counts.unfinished += len(unfinished)
            state.trace.dropped += len(unfinished)
            self._cond.notify_all()  # threads waiting for room on this attempt give up now
            return unfinished

    def snapshot(self) -> tuple[int, float]:
        """Queued spans and the age of the oldest (0 when none)."""
        with self._cond:
            if not self._queue:
                return 0, 0.0
            return len(self._queue), self._clock() - self._queue[0][0]

    def take(self, count: int) -> list[Item]:
        """The ``count`` oldest queued spans (they stay pending until settled)."""
        with self._cond:
            return [self._queue.popleft()[1:] for _ in range(min(count, len(self._queue)))]

    def settle(self, items: list[Item], *, exported: bool) -> list[AttemptState]:
        """Spans acknowledged (or given up); returns the closed attempts that have nothing pending now."""
        drained: list[AttemptState] = []
        with self._cond:
            for state, span in items:
                state.pending -= 1
                if exported:
                    state.trace.spans.append(span)
                else:
                    state.trace.dropped += 1
                if state.closed and state.pending == 0:
                    drained.append(state)
            if exported:
                self.counts.exported += len(items)
            else:
                self.counts.export_failed += len(items)
            self._pending -= len(items)
            self._cond.notify_all()
        return drained

    def pending_of(self, state: AttemptState) -> int:
        with self._cond:
            return state.pending
