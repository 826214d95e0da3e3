"""The openai client's GenAI instrumentation, shared by the tracers of a process.

``OpenAIInstrumentor`` is a process-wide singleton that patches the openai client once; the
tracers that asked for it hold a reference each and the last one to close removes it (unless
someone else had instrumented openai before us, in which case it is theirs to remove).
"""

from __future__ import annotations

import threading

from opentelemetry.sdk.trace import TracerProvider

from agl_stream.logs import describe, get_logger

log = get_logger("agl.tracing")

_lock = threading.Lock()
_users = 0
_ours = False


def instrument_openai(provider: TracerProvider) -> bool:
    """Take a reference on the openai instrumentation; False (logged) when it cannot work here."""
    global _users, _ours
    with _lock:
        if _users == 0:
            try:
                from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor  # type: ignore[import-untyped]

                instrumentor = OpenAIInstrumentor()
                if not instrumentor.is_instrumented_by_opentelemetry:
                    # Without raise_exception_on_conflict a version conflict is only logged and
                    # instrument() quietly does nothing.
                    instrumentor.instrument(tracer_provider=provider, raise_exception_on_conflict=True)
                    _ours = True
            except Exception as error:  # ImportError, DependencyConflictError, a broken openai
                log.error(
                    "tracing: the openai GenAI instrumentation is unavailable; openai calls make no spans",
                    error=describe(error),
                )
                return False
        _users += 1
        return True


def uninstrument_openai() -> None:
    """Give back a reference taken by a successful :func:`instrument_openai`."""
    global _users, _ours
    with _lock:
        _users -= 1
        if _users == 0 and _ours:
            from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor

            OpenAIInstrumentor().uninstrument()
            _ours = False
