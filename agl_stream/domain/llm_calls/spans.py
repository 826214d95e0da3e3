"""An LLM call as a span of its attempt, and the slimmer copy written when it is too large.

A span records the first choice: ``prompt_token_ids``, ``response_token_ids`` and
``logprobs.content`` (JSON text of OpenAI's chat logprobs ``content`` list; a text completion's
legacy ``tokens``/``token_logprobs``/``top_logprobs`` arrays are converted to that shape, so
readers handle one format), plus the GenAI attributes the triplet adapter and SQL users read
(see :func:`span_attributes`).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from opentelemetry.trace import format_span_id, format_trace_id, get_current_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from agl_stream.domain.llm_calls.backend import CHAT, COMPLETION, CallError, CallKind, logprobs_content, token_ids
from agl_stream.domain.llm_calls.messages import input_messages, json_text, messages_json, output_messages
from agl_stream.models import OtelResource, Span, SpanStatus
from agl_stream.models.spans import Attributes, AttributeScalar
from agl_stream.wire.semconv import ATTEMPT_ID_KEY, POLICY_VERSION, ROLLOUT_ID_KEY, SEQUENCE_ID_KEY

CHAT_SPAN_NAME = "openai.chat.completion"
"""The seed's name for chat calls, which the triplet adapter matches by default."""
COMPLETION_SPAN_NAME = "openai.completion"
SPAN_NAMES: dict[CallKind, str] = {CHAT: CHAT_SPAN_NAME, COMPLETION: COMPLETION_SPAN_NAME}
OPERATION_NAMES: dict[CallKind, str] = {CHAT: "chat", COMPLETION: "text_completion"}

SCOPE_NAME = "agl_stream.llm_proxy"
SERVICE_NAME = "agl-stream-llm-proxy"
_W3C = TraceContextTextMapPropagator()

INPUT_MESSAGES_KEY = "gen_ai.input.messages"
OUTPUT_MESSAGES_KEY = "gen_ai.output.messages"
TOOLS_KEY = "gen_ai.tool.definitions"
TEXT_KEYS = (INPUT_MESSAGES_KEY, OUTPUT_MESSAGES_KEY, TOOLS_KEY)
"""The text attributes :func:`slim` drops: the token ids already say what the model saw."""

# Request parameters copied as ``gen_ai.request.<name>`` when they are numbers.
_REQUEST_NUMBERS = (
    "temperature top_p top_k max_tokens max_completion_tokens n seed presence_penalty frequency_penalty"
).split()

_INT64 = (-(2**63), 2**63 - 1)  # what a span attribute (an Avro long) holds


def new_trace_id() -> str:
    """A random OpenTelemetry trace id (32 hex characters, never all zeros)."""
    return _nonzero_hex(16)


def new_span_id() -> str:
    """A random OpenTelemetry span id (16 hex characters, never all zeros)."""
    return _nonzero_hex(8)


def _nonzero_hex(size: int) -> str:
    while not (value := secrets.token_hex(size)).strip("0"):
        pass
    return value


@dataclass
class LLMCall:
    """One call through the proxy: what the agent asked, what the backend answered, when.

    ``response`` is the backend's JSON (a stream already merged by :func:`merge_chunks`), or
    None when the call failed before an answer; ``error`` is set when it failed (the response
    may then hold what a stream delivered before the failure).
    """

    kind: CallKind
    request: Mapping[str, Any]
    start_time: float
    end_time: float
    response: Mapping[str, Any] | None = None
    error: CallError | None = None
    stream: bool = False
    backend: str | None = None
    policy_version: int | None = None  # the version the backend says answered (vLLM says none)


def _is_attribute_number(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, int) and not isinstance(value, bool) and _INT64[0] <= value <= _INT64[1]


def span_attributes(call: LLMCall) -> Attributes:
    """The span attributes of a call (without the attempt's ids, which :func:`build_span` adds).

    GenAI conventions: ``gen_ai.system`` (``openai``: the protocol; the backend's URL is in
    ``gen_ai.openai.api_base``), ``gen_ai.operation.name``, ``gen_ai.request.model`` and the
    numeric sampling parameters, ``gen_ai.response.model|id|finish_reasons``,
    ``gen_ai.usage.input_tokens|output_tokens`` (the backend's usage, else the token id
    counts). Training: ``prompt_token_ids``, ``response_token_ids``, ``logprobs.content``.
    Content, as JSON text in the GenAI conventions' message shape (``{"role", "parts": [...]}``):
    ``gen_ai.input.messages`` (the messages, or a text completion's prompt as one user message),
    ``gen_ai.output.messages`` (one message per choice, with its ``finish_reason``) and
    ``gen_ai.tool.definitions`` (the tools offered). ``gen_ai.provider.name`` is ``openai``.
    Errors: ``error.type`` and ``http.response.status_code``.
    """
    request = call.request
    attributes: Attributes = {
        "gen_ai.provider.name": "openai",
        "gen_ai.system": "openai",  # the name before gen_ai.provider.name, which older tools read
        "gen_ai.operation.name": OPERATION_NAMES[call.kind],
        "llm.is_streaming": call.stream,
    }
    if isinstance(request.get("model"), str):
        attributes["gen_ai.request.model"] = request["model"]
    for name in _REQUEST_NUMBERS:
        value = request.get(name)
        if _is_attribute_number(value):
            attributes[f"gen_ai.request.{name}"] = value
    if call.backend:
        attributes["gen_ai.openai.api_base"] = call.backend
    sent = input_messages(call.kind, request)
    if sent:
        attributes[INPUT_MESSAGES_KEY] = messages_json(sent)
    if request.get("tools"):
        attributes[TOOLS_KEY] = json_text(request["tools"])

    response = call.response or {}
    for key in ("model", "id"):
        if isinstance(response.get(key), str):
            attributes[f"gen_ai.response.{key}"] = response[key]
    finish_reasons = [
        c["finish_reason"]
        for c in response.get("choices") or []
        if isinstance(c, Mapping) and isinstance(c.get("finish_reason"), str)
    ]
    if finish_reasons:
        attributes["gen_ai.response.finish_reasons"] = cast(list[AttributeScalar], finish_reasons)
    usage: Mapping[str, Any] = response["usage"] if isinstance(response.get("usage"), Mapping) else {}
    prompt_ids, response_ids = token_ids(call.kind, response)
    for side, used, ids in (("input", "prompt_tokens", prompt_ids), ("output", "completion_tokens", response_ids)):
        tokens = usage.get(used)  # the backend's usage, else the token ids counted
        if not isinstance(tokens, int) and ids is not None:
            tokens = len(ids)
        if isinstance(tokens, int):
            attributes[f"gen_ai.usage.{side}_tokens"] = tokens
    for key, ids in (("prompt_token_ids", prompt_ids), ("response_token_ids", response_ids)):
        if ids is not None:
            attributes[key] = cast(list[AttributeScalar], ids)
    content = logprobs_content(call.kind, response)
    if content is not None:
        attributes["logprobs.content"] = json_text(content)
    answered = output_messages(call.kind, response)
    if answered:
        attributes[OUTPUT_MESSAGES_KEY] = messages_json(answered)
    if call.error is not None:
        attributes["error.type"] = call.error.type
        attributes["http.response.status_code"] = call.error.status
    if call.policy_version is not None:
        attributes[POLICY_VERSION] = call.policy_version
    return attributes


@dataclass(frozen=True)
class TraceParent:
    """The caller's span, from a W3C ``traceparent`` header: the call's span becomes its child."""

    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits


def trace_parent(headers: Mapping[str, str]) -> TraceParent | None:
    """The W3C trace context of a request (``traceparent``, keys lower-case), or None when it has
    none or an invalid one (a call is never refused for its trace context)."""
    context = _W3C.extract(headers)
    parent = get_current_span(context).get_span_context()
    if not parent.is_valid:
        return None
    return TraceParent(format_trace_id(parent.trace_id), format_span_id(parent.span_id))


def build_span(
    call: LLMCall,
    *,
    rollout_id: str,
    attempt_id: str,
    sequence_id: int,
    parent: TraceParent | None = None,
    span_id: str | None = None,
) -> Span:
    """The call as a CLIENT span of the attempt, a child of ``parent`` when the caller sent one;
    ERROR status with the message when it failed."""
    attributes = span_attributes(call)
    attributes[ROLLOUT_ID_KEY] = rollout_id
    attributes[ATTEMPT_ID_KEY] = attempt_id
    attributes[SEQUENCE_ID_KEY] = sequence_id
    status = SpanStatus(status_code="OK")
    if call.error is not None:
        status = SpanStatus(status_code="ERROR", description=call.error.message)
    return Span(
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        sequence_id=sequence_id,
        trace_id=parent.trace_id if parent is not None else new_trace_id(),
        span_id=span_id or new_span_id(),
        parent_id=parent.span_id if parent is not None else None,
        name=SPAN_NAMES[call.kind],
        kind="CLIENT",
        status=status,
        attributes=attributes,
        start_time=call.start_time,
        end_time=call.end_time,
        resource=OtelResource(attributes={"service.name": SERVICE_NAME}),
        scope_name=SCOPE_NAME,
    )


def slim(span: Span, keys: Sequence[str] = TEXT_KEYS) -> Span:
    """The span without its text attributes, marked ``agl.truncated``: what is written when the
    whole span is over the broker's message size (the token ids are what training needs)."""
    attributes = {k: v for k, v in span.attributes.items() if k not in keys}
    attributes["agl.truncated"] = True
    return span.model_copy(update={"attributes": attributes})
