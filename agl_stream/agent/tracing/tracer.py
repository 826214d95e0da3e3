"""AttemptTracer: every span made during an attempt, numbered and exported in batches to agl.spans.

Rules (also in docs/design-notes.md):

* Sequence ids are taken when the buffer accepts an ended span, so sequence order is the
  order in which spans completed (a parent after its children), gap-free from
  ``first_sequence_id``: a span that is dropped before it is accepted takes no id. Only a span
  the store refuses after it was numbered (``export_failed``) leaves a hole in what is stored.
* Back-pressure: at most ``max_buffered_spans`` spans may be pending (accepted, not yet
  acknowledged by the broker). A thread that ends a span while the buffer is full waits up to
  ``block_timeout_s`` for room, then the span is dropped. The loop thread never waits (the
  exporter runs on it): its spans are accepted up to twice the bound; the loop is held back at
  attempt boundaries instead (``attempt()`` waits for room before it opens an attempt).
* Flush: leaving ``attempt()`` closes the attempt and waits until the store acknowledged every
  span it accepted (or gave up on it); spans started or ended after that are dropped.
* Export failures: a batch the store cannot take is sent again with ``export_backoff``
  (:data:`agl_stream.retry.FAILOVER` by default: about 30 s, a broker's failover); only then are
  its spans given up (``export_failed``), and each attempt that lost spans so has
  ``AttemptTrace.export_error`` (the runner then gives the attempt back rather than report an
  outcome whose trace is incomplete). An error of the records themselves (too large, not
  encodable) is not retried: the batch is split to isolate the bad span, which is dropped.
* Nothing is lost silently: drops are counted per kind (``stats()``, ``AttemptTrace.dropped``)
  and logged, the first of a kind at once and then at most every ``_LOG_EVERY_S`` seconds,
  plus one warning per attempt that lost any. Spans that end outside any attempt are not
  exported; they are only counted (``untracked``), since a process makes such spans legitimately.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from aiokafka.errors import MessageSizeTooLargeError
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider

from agl_stream.agent.tracing import instrumentation
from agl_stream.agent.tracing.buffer import AttemptState, AttemptTrace, Item, Outcome, SpanBuffer, SpanKey
from agl_stream.agent.tracing.export_policy import Cut, ExportPolicy
from agl_stream.agent.tracing.processor import AttemptSpanProcessor, current_attempt, install
from agl_stream.errors import AglError
from agl_stream.logs import describe, get_logger
from agl_stream.models import Span
from agl_stream.retry import FAILOVER, Backoff, retrying
from agl_stream.wire.spans import span_from_otel

log = get_logger("agl.tracing")

_LOG_EVERY_S = 10.0
RECORD_ERRORS: tuple[type[Exception], ...] = (MessageSizeTooLargeError, AglError, ValueError, TypeError)
"""Errors of a span export that come from the records themselves (too large, not convertible or
encodable): retrying the same spans cannot help (the tracer splits the batch to isolate the bad
span; the runner fails an attempt whose returned spans raise one)."""


class SpanSink(Protocol):
    """Where batches go: ``AglStore.export_spans`` (returns once the broker acknowledged them)."""

    async def export_spans(self, spans: Sequence[Span]) -> None: ...


@dataclass(frozen=True)
class TracerStats:
    """Counters of one tracer (``untracked`` is process-wide: the processor is shared)."""

    exported: int
    pending: int
    late: int  # started after its attempt closed, or ended after it while waiting for room
    unfinished: int  # still open when its attempt closed
    overflow: int  # the buffer stayed full
    invalid: int  # could not be converted to a Span
    export_failed: int  # the store refused them after retries
    blocked: int  # times a thread waited for room
    untracked: int  # ended outside any attempt: not exported


def _exception_of(task: asyncio.Task[None]) -> BaseException | None:
    return None if task.cancelled() else task.exception()


class _DropLog:
    """Warns about dropped spans without flooding: per kind, the first at once, then totals."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._since: dict[str, int] = {}

    def note(self, kind: str, state: AttemptState, count: int = 1, error: BaseException | None = None) -> None:
        now = time.monotonic()
        with self._lock:
            self._since[kind] = self._since.get(kind, 0) + count
            last = self._last.get(kind)
            if last is not None and now - last < _LOG_EVERY_S:
                return
            self._last[kind] = now
            dropped, self._since[kind] = self._since[kind], 0
        log.warning(
            "tracing: spans dropped",
            kind=kind,
            dropped=dropped,
            rollout=state.trace.rollout_id,
            attempt=state.trace.attempt_id,
            error=None if error is None else describe(error),
        )


class AttemptTracer:
    """Traces attempts into a :class:`SpanSink` (the store). Start it on the loop that runs attempts."""

    def __init__(
        self,
        store: SpanSink,
        *,
        max_buffered_spans: int = 10_000,
        batch_size: int = 512,
        flush_interval_s: float = 0.1,
        instrument_genai: bool = True,
        block_timeout_s: float = 30.0,
        export_backoff: Backoff = FAILOVER,
    ) -> None:
        self._sink = store
        self._policy = ExportPolicy(batch_size=batch_size, flush_interval_s=flush_interval_s)
        self._buffer = SpanBuffer(self._policy, max_buffered_spans, 2 * max_buffered_spans)
        self._instrument_genai = instrument_genai
        self._block_timeout_s = block_timeout_s
        self._export_backoff = export_backoff
        self._drops = _DropLog()
        self._attempts: dict[tuple[str, str], AttemptState] = {}
        self._flushing = 0  # attempts (or close) waiting for a flush: cut batches at once
        self._state = "new"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._wakeup = asyncio.Event()
        self._room = asyncio.Event()
        self._exporter: asyncio.Task[None] | None = None
        self._processor: AttemptSpanProcessor | None = None
        self._provider: TracerProvider | None = None
        self.genai_instrumented = False

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def tracer_provider(self) -> TracerProvider:
        """The provider whose spans are traced (the global one unless another API implementation holds it)."""
        if self._provider is None:
            raise RuntimeError("AttemptTracer.start() first")
        return self._provider

    async def start(self) -> None:
        if self._state != "new":
            raise RuntimeError(f"this tracer is {self._state}")
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._processor, self._provider = install()
        if self._instrument_genai:
            self.genai_instrumented = instrumentation.instrument_genai(self._provider)
        # A context of its own: spans the export itself makes (an instrumented HTTP or Kafka
        # client) must not count as an attempt's, whatever context start() was called from.
        self._exporter = asyncio.create_task(
            self._export_loop(), name="agl-tracer-export", context=contextvars.Context()
        )
        self._exporter.add_done_callback(self._exporter_done)
        self._state = "running"

    async def close(self) -> None:
        """Close the attempts still open (their open spans count as unfinished), export everything, stop."""
        if self._state != "running":
            self._state = "closed"
            return
        self._state = "closing"
        for state in list(self._attempts.values()):
            self._close_attempt(state)
        self._flushing += 1
        self._wake()
        try:
            assert self._exporter is not None
            await self._exporter
        finally:
            self._flushing -= 1
            self._state = "closed"
            if self.genai_instrumented:
                instrumentation.uninstrument_genai()
                self.genai_instrumented = False

    async def __aenter__(self) -> AttemptTracer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _exporter_done(self, task: asyncio.Task[None]) -> None:
        error = _exception_of(task)
        if error is not None:
            log.error("tracing: the span exporter failed; spans are no longer exported", exc_info=error)

    def stats(self) -> TracerStats:
        counts = self._buffer.counts
        return TracerStats(
            exported=counts.exported,
            pending=self._buffer.pending,
            late=counts.late,
            unfinished=counts.unfinished,
            overflow=counts.overflow,
            invalid=counts.invalid,
            export_failed=counts.export_failed,
            blocked=counts.blocked,
            untracked=self._processor.untracked if self._processor is not None else 0,
        )

    # -- attempts --------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def attempt(
        self, rollout_id: str, attempt_id: str, *, first_sequence_id: int = 1, policy_version: int | None = None
    ) -> AsyncIterator[AttemptTrace]:
        """Trace the spans started in this context (and in tasks and threads that copy it) as the attempt's.

        ``policy_version``: the policy the attempt runs with, written on each of its spans.

        On exit the attempt is closed and its spans flushed: when this returns, the store has
        acknowledged every span in ``trace.spans`` (``trace.dropped`` counts the others).
        """
        if self._state != "running":
            raise RuntimeError(f"the tracer is {self._state}, not running")
        if first_sequence_id < 1:
            raise ValueError("sequence ids start at 1")
        if (rollout_id, attempt_id) in self._attempts:
            raise ValueError(f"attempt {attempt_id} of {rollout_id} is already being traced")
        # The loop's back-pressure: spans ended on the loop never wait, new attempts do.
        while self._buffer.pending >= self._buffer.max_spans:
            self._room.clear()
            await self._exporter_or(self._room)
        trace = AttemptTrace(
            rollout_id=rollout_id,
            attempt_id=attempt_id,
            next_sequence_id=first_sequence_id,
            policy_version=policy_version,
        )
        state = AttemptState(trace, self)
        self._attempts[(rollout_id, attempt_id)] = state
        token = current_attempt.set(state)
        try:
            yield trace
        finally:
            with contextlib.suppress(ValueError):  # exited in another context than entered: nothing to undo
                current_attempt.reset(token)
            self._close_attempt(state)
            await self._flush(state)
            if trace.dropped:
                # The drop log is rate-limited; this line makes every attempt's loss visible.
                log.warning(
                    "tracing: attempt lost spans",
                    rollout=rollout_id,
                    attempt=attempt_id,
                    dropped=trace.dropped,
                    exported=len(trace.spans),
                )

    def _close_attempt(self, state: AttemptState) -> None:
        self._attempts.pop((state.trace.rollout_id, state.trace.attempt_id), None)
        unfinished = self._buffer.close(state)
        if unfinished:
            assert self._processor is not None
            self._processor.forget(unfinished)
            self._drops.note("unfinished", state, len(unfinished))

    async def _flush(self, state: AttemptState) -> None:
        if self._buffer.pending_of(state) == 0:
            state.trace.spans.sort(key=lambda span: span.sequence_id)
            return
        self._flushing += 1
        self._wake()
        try:
            await self._exporter_or(state.drained)
        finally:
            self._flushing -= 1
        state.trace.spans.sort(key=lambda span: span.sequence_id)

    async def _exporter_or(self, event: asyncio.Event) -> None:
        """Wait for ``event``, unless the exporter stopped first (then nothing would ever set it)."""
        assert self._exporter is not None
        waiting = asyncio.ensure_future(event.wait())
        try:
            await asyncio.wait({waiting, self._exporter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiting.cancel()
        if not event.is_set():
            raise RuntimeError("the span exporter stopped") from _exception_of(self._exporter)

    # -- the processor's side (any thread) ------------------------------------------------

    def span_started(self, state: AttemptState, key: SpanKey) -> bool:
        if self._buffer.started(state, key):
            return True
        self._drops.note("late", state)
        return False

    def span_ended(self, state: AttemptState, key: SpanKey, span: ReadableSpan) -> None:
        trace = state.trace
        try:
            converted = span_from_otel(span, trace.rollout_id, trace.attempt_id, 0)  # numbered when accepted
        except Exception as error:
            if self._buffer.reject(state, key):
                self._drops.note("invalid", state, error=error)
            return
        on_loop = threading.get_ident() == self._loop_thread
        outcome = self._buffer.offer(state, key, converted, block=not on_loop, timeout=self._block_timeout_s)
        if outcome is Outcome.WAKE:
            self._wake()
        elif outcome in (Outcome.LATE, Outcome.OVERFLOW):
            self._drops.note(outcome.value, state)

    def _wake(self) -> None:
        if threading.get_ident() == self._loop_thread:
            self._wakeup.set()
            return
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing is left to wake
            self._loop.call_soon_threadsafe(self._wakeup.set)

    # -- the exporter (on the loop) -------------------------------------------------------

    async def _export_loop(self) -> None:
        while True:
            # Cleared before looking, so a wake-up for what arrives after the look is kept.
            self._wakeup.clear()
            queued, age = self._buffer.snapshot()
            decision = self._policy.decide(queued, age, flushing=self._flushing > 0)
            if isinstance(decision, Cut):
                await self._export(self._buffer.take(decision.count))
                continue
            if self._state == "closing" and self._buffer.pending == 0:
                return
            try:
                await asyncio.wait_for(self._wakeup.wait(), decision.seconds)
            except TimeoutError:
                pass

    async def _export(self, items: list[Item]) -> None:
        """Export with retries for transient errors; a record error splits the batch to isolate the bad span."""
        try:
            await retrying(
                lambda: self._sink.export_spans([span for _, span in items]),
                backoff=self._export_backoff,
                what="exporting spans",
                final=RECORD_ERRORS,
                spans=len(items),
            )
        except asyncio.CancelledError:
            raise
        except RECORD_ERRORS as error:
            if len(items) > 1:
                # A partial send before the error is re-sent here: otel_traces is a
                # ReplacingMergeTree on the span's ids and reads use FINAL.
                half = len(items) // 2
                await self._export(items[:half])
                await self._export(items[half:])
                return
            self._settle(items, exported=False, error=error)
        except Exception as error:  # every try failed: the store is unreachable
            for state, _ in items:
                state.trace.export_error = describe(error)
            self._settle(items, exported=False, error=error)
        else:
            self._settle(items, exported=True)

    def _settle(self, items: list[Item], *, exported: bool, error: BaseException | None = None) -> None:
        for state in self._buffer.settle(items, exported=exported):
            state.drained.set()
        if not exported:
            lost: dict[AttemptState, int] = {}
            for state, _ in items:
                lost[state] = lost.get(state, 0) + 1
            for state, count in lost.items():
                self._drops.note("export_failed", state, count, error=error)
        if self._buffer.pending < self._buffer.max_spans:
            self._room.set()
