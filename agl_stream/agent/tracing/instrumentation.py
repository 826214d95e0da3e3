"""OpenTelemetry's GenAI instrumentations, shared by the tracers of a process.

Concurrency: one process-wide state under a lock. The instrumentors patch libraries once per
process; the tracers that asked for them hold a reference each, and the last one to close
removes them (an instrumentation someone else installed before us is theirs to remove).

What is instrumented (:data:`INSTRUMENTATIONS`), each from OpenTelemetry's GenAI family on one
``opentelemetry-util-genai``, so their spans follow the same conventions as the LLM proxy's:

- the ``openai`` client: a span per call, always. Each request the client sends also carries
  the W3C trace context (``traceparent``, ``tracestate``: the OpenTelemetry HTTP
  instrumentations' job, done here without their extra span per request), so the LLM proxy's
  span of a call is a child of the client's span and joins the attempt's trace. A header the
  caller set is left as it is.
- LangChain / LangGraph (``langchain_core``) and the OpenAI Agents SDK (``agents``): workflow,
  agent and tool spans, and one chat span per model call (LangChain's own; under the Agents
  SDK, the openai client's), the LLM proxy's span of the call under it. These are
  instrumented when the agent imports the framework (a post-import hook), so a runner whose
  agents use neither pays nothing for them. The Agents SDK's own export of traces to OpenAI's
  servers is switched off: its traces go where the attempt's spans go.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from opentelemetry import propagate
from opentelemetry.sdk.trace import TracerProvider

from agl_stream.logs import describe, get_logger

log = get_logger("agl.tracing")


@dataclass(frozen=True)
class Instrumentation:
    """One GenAI instrumentor: ``instrumentor`` (``module:Class``) for the library ``module``."""

    name: str
    module: str
    instrumentor: str
    options: dict[str, Any] = field(default_factory=dict)
    on_import: bool = True
    """Instrument when ``module`` is imported (else at once, when the first tracer starts)."""


OPENAI = Instrumentation(
    "openai", "openai", "opentelemetry.instrumentation.genai.openai:OpenAIInstrumentor", on_import=False
)
INSTRUMENTATIONS = (
    OPENAI,
    Instrumentation(
        "langchain", "langchain_core", "opentelemetry.instrumentation.genai.langchain:LangChainInstrumentor"
    ),
    Instrumentation(
        "openai-agents",
        "agents",
        "opentelemetry.instrumentation.genai.openai_agents:OpenAIAgentsInstrumentor",
        {"disable_openai_trace_export": True},
    ),
)

_lock = threading.RLock()
_users = 0
_provider: TracerProvider | None = None
_ours: dict[str, Any] = {}  # name -> the instrumentor we installed
_hooked: set[str] = set()  # modules with a post-import hook (registered once per process)
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


def _instrument(what: Instrumentation, provider: TracerProvider) -> bool:
    """Install one instrumentor (under the lock); False (logged) when it cannot work here."""
    try:
        module_name, class_name = what.instrumentor.split(":")
        instrumentor = getattr(importlib.import_module(module_name), class_name)()
        if not instrumentor.is_instrumented_by_opentelemetry:
            # Without raise_exception_on_conflict a version conflict is only logged and
            # instrument() quietly does nothing.
            instrumentor.instrument(tracer_provider=provider, raise_exception_on_conflict=True, **what.options)
            _ours[what.name] = instrumentor
            if what is OPENAI:
                _propagate_trace_context()
    except Exception as error:  # ImportError, DependencyConflictError, a broken library
        log.error(
            f"tracing: the {what.name} GenAI instrumentation is unavailable; its calls make no spans",
            error=describe(error),
        )
        return False
    return True


def _on_import(what: Instrumentation) -> Callable[[ModuleType], None]:
    def hook(_module: ModuleType) -> None:
        with _lock:
            if _users > 0 and _provider is not None and what.name not in _ours:
                _instrument(what, _provider)

    return hook


def instrument_genai(provider: TracerProvider) -> bool:
    """Take a reference on the GenAI instrumentations; False (logged) when the openai client's
    cannot work here (the frameworks' are installed when they are imported, or never)."""
    global _users, _provider
    from wrapt import register_post_import_hook

    with _lock:
        if _users == 0:
            _provider = provider
            if not _instrument(OPENAI, provider):
                return False
            for what in INSTRUMENTATIONS:
                if not what.on_import:
                    continue
                if what.module in sys.modules:  # imported before: the hook would not fire again
                    _instrument(what, provider)
                elif what.module not in _hooked:
                    _hooked.add(what.module)
                    register_post_import_hook(_on_import(what), what.module)
        _users += 1
        return True


def uninstrument_genai() -> None:
    """Give back a reference taken by a successful :func:`instrument_genai`."""
    global _users, _provider
    with _lock:
        _users -= 1
        if _users > 0:
            return
        _provider = None
        for name, instrumentor in list(_ours.items()):
            instrumentor.uninstrument()
            del _ours[name]
            if name == OPENAI.name:
                import openai._base_client
                from opentelemetry.instrumentation.utils import unwrap

                unwrap(openai._base_client.BaseClient, "_build_headers")  # does nothing when not wrapped
