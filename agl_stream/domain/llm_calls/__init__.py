"""LLM calls as spans: the pure half of the LLM proxy (``agl-stream llm-proxy``).

The proxy forwards an agent's OpenAI request to an OpenAI-compatible backend (vLLM) and records
the call as one span of the agent's attempt. Everything here works on plain dicts (the request
body, the backend's JSON) and does no I/O, so its rules are tested without a server: ``backend``
(what the backend is asked and answers), ``messages`` (GenAI message shapes), ``spans`` (the span).
"""

from __future__ import annotations

from agl_stream.domain.llm_calls.backend import (
    CHAT,
    COMPLETION,
    CallError,
    CallKind,
    backend_error,
    backend_request,
    error_of_status,
    merge_chunks,
    parse_sse,
    policy_version_of_header,
)
from agl_stream.domain.llm_calls.spans import (
    LLMCall,
    TraceParent,
    build_span,
    slim,
    trace_parent,
)

__all__ = [
    "CHAT",
    "COMPLETION",
    "CallError",
    "CallKind",
    "LLMCall",
    "TraceParent",
    "backend_error",
    "backend_request",
    "build_span",
    "error_of_status",
    "merge_chunks",
    "parse_sse",
    "policy_version_of_header",
    "slim",
    "trace_parent",
]
