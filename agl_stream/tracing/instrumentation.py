"""The openai client's GenAI instrumentation, shared by the tracers of a process.

Two parts: OpenTelemetry's ``OpenAIInstrumentor`` (a span per call, GenAI conventions), and the
W3C trace context on each request the client sends (``traceparent``, ``tracestate``: the
OpenTelemetry HTTP instrumentations' job, done here without their extra span per request), so
the LLM proxy's span of a call is a child of the client's span and joins the attempt's trace.
A header the caller set is left as it is.

``OpenAIInstrumentor`` is a process-wide singleton that patches the openai client once; the
tracers that asked for it hold a reference each and the last one to close removes it (unless
someone else had instrumented openai before us, in which case it is theirs to remove).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, MutableMapping
from typing import Any

from opentelemetry import propagate
from opentelemetry.sdk.trace import TracerProvider

from agl_stream.logs import describe, get_logger

log = get_logger("agl.tracing")

_lock = threading.Lock()
_users = 0
_ours = False
_HEADERS_OWNER = "openai._base_client"
_HEADERS_METHOD = "BaseClient._build_headers"


def _with_trace_context(
    wrapped: Callable[..., MutableMapping[str, str]], _instance: object, args: Any, kwargs: Any
) -> MutableMapping[str, str]:
    headers = wrapped(*args, **kwargs)
    if "traceparent" not in headers:  # httpx headers: case-insensitive
        propagate.inject(headers)
    return headers


def _propagate_trace_context() -> None:
    from wrapt import wrap_function_wrapper

    try:
        wrap_function_wrapper(_HEADERS_OWNER, _HEADERS_METHOD, _with_trace_context)
    except Exception as error:  # the client's private surface moved: calls still make spans
        log.warning(
            "tracing: cannot add trace context to openai requests; the LLM proxy's spans start traces of their own",
            error=describe(error),
        )


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
                    _propagate_trace_context()
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
            import openai._base_client
            from opentelemetry.instrumentation.utils import unwrap

            unwrap(openai._base_client.BaseClient, "_build_headers")  # does nothing when not wrapped
            _ours = False
