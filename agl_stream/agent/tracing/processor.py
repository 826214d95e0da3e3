"""The OpenTelemetry-facing part: which attempt a span belongs to, decided when it starts.

One :class:`AttemptSpanProcessor` serves the whole process (OpenTelemetry's global tracer
provider can be set once, and an SDK provider cannot drop a processor again); the attempt a
span belongs to is the :data:`current_attempt` of the context it *starts* in, and that
attempt's tracer receives it when it ends, on whatever thread ends it.
"""

from __future__ import annotations

import threading
from contextvars import ContextVar

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace import Span as SdkSpan
from opentelemetry.trace import SpanContext

from agl_stream.agent.tracing.buffer import ATTEMPT_ID_KEY, ROLLOUT_ID_KEY, AttemptState, SpanKey
from agl_stream.logs import get_logger

log = get_logger("agl.tracing")

current_attempt: ContextVar[AttemptState | None] = ContextVar("agl_stream_current_attempt", default=None)
"""The attempt whose spans the current context makes (set by ``AttemptTracer.attempt``)."""


def span_key(context: SpanContext) -> SpanKey:
    return context.trace_id, context.span_id


class AttemptSpanProcessor(SpanProcessor):
    """Tags the spans started inside an attempt and hands them to its tracer when they end.

    Called synchronously on the threads that start and end spans, so it never raises into
    them (an exception would surface in user code) and takes no lock of its own: the dict
    operations are atomic, the tracer does the rest under its buffer's lock.
    """

    def __init__(self) -> None:
        self._open: dict[SpanKey, AttemptState] = {}
        self._count_lock = threading.Lock()
        self.untracked = 0  # spans that ended outside any attempt (process-wide)

    def on_start(self, span: SdkSpan, parent_context: Context | None = None) -> None:
        state = current_attempt.get()
        if state is None:
            return
        try:
            key = span_key(span.get_span_context())
            # Registered before the owner sees it, so a close in between finds and forgets it.
            self._open[key] = state
            if not state.owner.span_started(state, key):
                self._open.pop(key, None)
                return
            # On the live span (unlike the sequence id, which is only known at the end), so
            # other processors and exporters see them too.
            span.set_attribute(ROLLOUT_ID_KEY, state.trace.rollout_id)
            span.set_attribute(ATTEMPT_ID_KEY, state.trace.attempt_id)
        except Exception:
            log.exception("tracing: could not tag a starting span")

    def on_end(self, span: ReadableSpan) -> None:
        context = span.context
        key = span_key(context) if context is not None else None
        state = self._open.pop(key, None) if key is not None else None
        if key is None or state is None:
            with self._count_lock:
                self.untracked += 1
            return
        try:
            state.owner.span_ended(state, key, span)
        except Exception:
            log.exception("tracing: could not take an ended span")

    def forget(self, keys: list[SpanKey]) -> None:
        """Spans of a closed attempt that never ended: their end, if it comes, is untracked."""
        for key in keys:
            self._open.pop(key, None)

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        # Flushing is per attempt and asynchronous (AttemptTracer); nothing is held here.
        return True


_install_lock = threading.Lock()
_installed: tuple[AttemptSpanProcessor, TracerProvider] | None = None


def install() -> tuple[AttemptSpanProcessor, TracerProvider]:
    """The process's processor and the provider it is on, installed on first use.

    With no global provider yet, ours becomes the global one. An SDK provider someone else
    installed gets our processor added. Any other global provider cannot take a processor:
    ours then stays private, and only spans made through it (``AttemptTracer.tracer_provider``,
    the openai instrumentation) are traced (a warning says so).
    """
    global _installed
    with _install_lock:
        if _installed is not None:
            return _installed
        processor = AttemptSpanProcessor()
        current = trace.get_tracer_provider()
        if isinstance(current, TracerProvider):
            current.add_span_processor(processor)
            provider = current
        else:
            provider = TracerProvider()
            provider.add_span_processor(processor)
            if isinstance(current, trace.ProxyTracerProvider):
                trace.set_tracer_provider(provider)
            if trace.get_tracer_provider() is not provider:
                log.warning(
                    "tracing: the global tracer provider is not an OpenTelemetry SDK provider, so spans made "
                    "through the global API are not traced; use AttemptTracer.tracer_provider",
                    global_provider=type(trace.get_tracer_provider()).__name__,
                )
        _installed = processor, provider
        return _installed
