"""LLM calls as spans: the pure half of the LLM proxy (``agl-stream llm-proxy``).

The proxy forwards an agent's OpenAI request to an OpenAI-compatible backend (vLLM) and records
the call as one span of the agent's attempt. Everything here works on plain dicts (the
request body, the backend's JSON) and does no I/O, so the rules below are tested without a
server:

* The backend is always asked for token ids (vLLM's ``return_token_ids``) and, unless turned
  off, for the sampled tokens' logprobs (:func:`backend_request`): training needs the prompt
  and response token ids exactly as the engine saw them, and the behaviour policy's logprobs.
* vLLM (>= 0.10.2) answers chat with top-level ``prompt_token_ids`` and
  ``choices[i].token_ids``; text completions with ``choices[i].prompt_token_ids`` and
  ``choices[i].token_ids``. Streams carry the prompt ids on the first chunk and each chunk's
  new token ids on its choices; :func:`merge_chunks` folds a stream into the non-streaming
  shape, so one extraction serves both.
* A span records the first choice: ``prompt_token_ids``, ``response_token_ids`` and
  ``logprobs.content`` (JSON text of OpenAI's chat logprobs ``content`` list; a text
  completion's legacy ``tokens``/``token_logprobs``/``top_logprobs`` arrays are converted to
  that shape, so readers handle one format), plus the GenAI attributes the triplet adapter
  and SQL users read (see :func:`span_attributes`).
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, TypeAlias, cast

from opentelemetry.trace import format_span_id, format_trace_id, get_current_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.genai.types import (
    GenericPart,
    InputMessage,
    MessagePart,
    OutputMessage,
    Reasoning,
    Text,
    ToolCallRequest,
    ToolCallResponse,
)

from agl_stream.models import OtelResource, Span, SpanStatus
from agl_stream.models.spans import Attributes, AttributeScalar
from agl_stream.wire.semconv import ATTEMPT_ID_KEY, POLICY_VERSION, ROLLOUT_ID_KEY, SEQUENCE_ID_KEY

__all__ = [
    "CHAT",
    "CHAT_SPAN_NAME",
    "COMPLETION",
    "COMPLETION_SPAN_NAME",
    "INPUT_MESSAGES_KEY",
    "OUTPUT_MESSAGES_KEY",
    "SCOPE_NAME",
    "CallError",
    "CallKind",
    "LLMCall",
    "backend_error",
    "backend_request",
    "build_span",
    "error_of_status",
    "logprobs_content",
    "merge_chunks",
    "new_span_id",
    "new_trace_id",
    "parse_sse",
    "slim",
    "span_attributes",
    "token_ids",
]

CallKind: TypeAlias = Literal["chat", "completion"]
CHAT: CallKind = "chat"
COMPLETION: CallKind = "completion"

CHAT_SPAN_NAME = "openai.chat.completion"
"""The seed's name for chat calls, which the triplet adapter matches by default."""
COMPLETION_SPAN_NAME = "openai.completion"
SPAN_NAMES: dict[CallKind, str] = {CHAT: CHAT_SPAN_NAME, COMPLETION: COMPLETION_SPAN_NAME}
OPERATION_NAMES: dict[CallKind, str] = {CHAT: "chat", COMPLETION: "text_completion"}

SCOPE_NAME = "agl_stream.llm_proxy"
SERVICE_NAME = "agl-stream-llm-proxy"
_W3C = TraceContextTextMapPropagator()

# Attributes that tie a span to its attempt (agl_stream.wire.semconv.LightningResourceAttributes);
# the runner's tracer writes them on every span, so proxy spans read the same in SQL.

INPUT_MESSAGES_KEY = "gen_ai.input.messages"
OUTPUT_MESSAGES_KEY = "gen_ai.output.messages"
TOOLS_KEY = "gen_ai.tool.definitions"
TEXT_KEYS = (INPUT_MESSAGES_KEY, OUTPUT_MESSAGES_KEY, TOOLS_KEY)
"""The text attributes :func:`slim` drops: the token ids already say what the model saw."""

# Request parameters copied as ``gen_ai.request.<name>`` when they are numbers.
_REQUEST_NUMBERS = (
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "seed",
    "presence_penalty",
    "frequency_penalty",
)

_INT64 = (-(2**63), 2**63 - 1)  # what a span attribute (an Avro long) holds

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


def new_trace_id() -> str:
    """A random OpenTelemetry trace id (32 hex characters, never all zeros)."""
    while True:
        value = secrets.token_hex(16)
        if value.strip("0"):
            return value


def new_span_id() -> str:
    """A random OpenTelemetry span id (16 hex characters, never all zeros)."""
    while True:
        value = secrets.token_hex(8)
        if value.strip("0"):
            return value


# -- requests ---------------------------------------------------------------------------------


def backend_request(kind: CallKind, body: Mapping[str, Any], *, logprobs: bool = True) -> dict[str, Any]:
    """What the proxy sends the backend for the agent's ``body``: the agent's parameters plus
    ``return_token_ids`` and, with ``logprobs``, the sampled tokens' logprobs.

    An agent that asked for logprobs keeps its own setting (``top_logprobs``, or a text
    completion's ``logprobs: N``); one that turned them off explicitly (``logprobs: false``) is
    respected too. Other fields pass through untouched, vLLM extensions included.
    """
    sent = dict(body)
    sent["return_token_ids"] = True
    if logprobs and sent.get("logprobs") is None:
        # Chat takes a flag; a text completion takes how many alternatives to add (0: none,
        # the sampled token's logprob only).
        sent["logprobs"] = True if kind == CHAT else 0
    return sent


# -- errors -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CallError:
    """A failed call, as the agent sees it (an OpenAI error body) and as the span records it."""

    status: int
    message: str
    type: str
    code: str | int | None = None
    param: str | None = None

    def body(self) -> dict[str, Any]:
        """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_of_status(status: int, message: str, *, code: str | int | None = None, param: str | None = None) -> CallError:
    """A CallError with OpenAI's error ``type`` for the HTTP status."""
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return CallError(status=status, message=message, type=kind, code=code, param=param)


def backend_error(status: int, body: Any, fallback_message: str) -> CallError:
    """The backend's own error, from its response body (bytes, text or parsed JSON).

    Understands OpenAI's shape (``{"error": {...}}``, also vLLM's), vLLM's older flat shape
    (``{"object": "error", "message", "type", "param", "code"}``) and FastAPI's
    ``{"detail": ...}``; anything else keeps ``fallback_message`` (the HTTP client's text) so
    the agent always learns something.
    """
    document = _json_of(body)
    error = document.get("error") if isinstance(document, dict) else None
    if isinstance(error, str):
        error = {"message": error}
    if not isinstance(error, dict) and isinstance(document, dict) and "message" in document:
        error = document
    if not isinstance(error, dict) and isinstance(document, dict) and "detail" in document:
        detail = document["detail"]
        error = {"message": detail if isinstance(detail, str) else json.dumps(detail)}
    if not isinstance(error, dict):
        text = body.decode("utf-8", "replace") if isinstance(body, bytes | bytearray) else body
        plain = text.strip() if isinstance(text, str) else ""
        return error_of_status(status, plain if plain and len(plain) < 2000 else fallback_message)
    message = error.get("message")
    code = error.get("code")
    param = error.get("param")
    result = error_of_status(
        status,
        message if isinstance(message, str) and message else fallback_message,
        code=code if isinstance(code, str | int) and not isinstance(code, bool) else None,
        param=param if isinstance(param, str) else None,
    )
    kind = error.get("type")
    # vLLM names its Python exception ("BadRequestError") where OpenAI puts a snake_case type.
    if isinstance(kind, str) and kind.islower() and kind:
        result = CallError(result.status, result.message, kind, result.code, result.param)
    return result


def _json_of(body: Any) -> Any:
    if isinstance(body, bytes | bytearray | str):
        try:
            return json.loads(body)
        except ValueError:
            return None
    return body


# -- streams ----------------------------------------------------------------------------------


def parse_sse(data: bytes | bytearray | str) -> list[dict[str, Any]]:
    """The JSON objects of a server-sent-event stream's ``data:`` events, up to ``[DONE]``.

    Follows the SSE framing (events end at a blank line; several ``data:`` lines of one event
    are joined with newlines; comments and other fields are skipped). An event that is not a
    JSON object is skipped: the agent got it from LiteLLM already, the span just cannot use it.
    """
    text = data.decode("utf-8", "replace") if isinstance(data, bytes | bytearray) else data
    events: list[dict[str, Any]] = []
    lines: list[str] = []
    for line in [*text.splitlines(), ""]:
        if line:
            if line.startswith("data:"):
                lines.append(line[5:].removeprefix(" "))
            continue
        if not lines:
            continue
        payload = "\n".join(lines)
        lines = []
        if payload.strip() == "[DONE]":
            break
        try:
            event = json.loads(payload)
        except ValueError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


@dataclass
class _Choice:
    index: int
    role: str | None = None
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    logprobs_content: list[Any] | None = None
    legacy_logprobs: dict[str, list[Any]] | None = None
    finish_reason: str | None = None
    stop_reason: Any = None


def merge_chunks(kind: CallKind, chunks: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Fold a stream's chunks into the body the same call would have returned unstreamed.

    Content, reasoning, tool-call arguments, token ids and logprobs are concatenated per choice
    in arrival order; ``prompt_token_ids`` (top level for chat, per choice for text) and the
    other ids come from the first chunk that has them; ``usage`` from the last that has it.
    A chunk carrying ``error`` (vLLM reports failures mid-stream that way) puts it on the result.
    """
    merged: dict[str, Any] = {}
    choices: dict[int, _Choice] = {}
    for chunk in chunks:
        if chunk.get("error"):
            merged["error"] = chunk["error"]
            continue
        for key in ("id", "model", "created", "system_fingerprint"):
            if merged.get(key) is None and chunk.get(key) is not None:
                merged[key] = chunk[key]
        if merged.get("prompt_token_ids") is None and isinstance(chunk.get("prompt_token_ids"), list):
            merged["prompt_token_ids"] = chunk["prompt_token_ids"]
        if chunk.get("usage"):
            merged["usage"] = chunk["usage"]
        for raw in chunk.get("choices") or []:
            if isinstance(raw, Mapping):
                _merge_choice(kind, choices, raw)
    merged["object"] = "chat.completion" if kind == CHAT else "text_completion"
    merged["choices"] = [_finish_choice(kind, choices[i]) for i in sorted(choices)]
    return merged


_LEGACY_LOGPROBS_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def _index(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _merge_choice(kind: CallKind, choices: dict[int, _Choice], raw: Mapping[str, Any]) -> None:
    index = _index(raw.get("index"), 0)
    choice = choices.setdefault(index, _Choice(index=index))
    if kind == CHAT:
        delta = raw.get("delta") or {}
        if isinstance(delta.get("role"), str):
            choice.role = delta["role"]
        if isinstance(delta.get("content"), str):
            choice.text.append(delta["content"])
        reasoning = delta.get("reasoning_content", delta.get("reasoning"))
        if isinstance(reasoning, str):
            choice.reasoning.append(reasoning)
        for call in delta.get("tool_calls") or []:
            _merge_tool_call(choice, call)
    elif isinstance(raw.get("text"), str):
        choice.text.append(raw["text"])
    if isinstance(raw.get("token_ids"), list):
        choice.token_ids = [*(choice.token_ids or []), *raw["token_ids"]]
    if choice.prompt_token_ids is None and isinstance(raw.get("prompt_token_ids"), list):
        choice.prompt_token_ids = raw["prompt_token_ids"]
    logprobs = raw.get("logprobs")
    if isinstance(logprobs, Mapping):
        if kind == CHAT and isinstance(logprobs.get("content"), list):
            choice.logprobs_content = [*(choice.logprobs_content or []), *logprobs["content"]]
        elif kind == COMPLETION:
            legacy = choice.legacy_logprobs or {
                "tokens": [],
                "token_logprobs": [],
                "top_logprobs": [],
                "text_offset": [],
            }
            for key in legacy:
                legacy[key].extend(logprobs.get(key) or [])
            choice.legacy_logprobs = legacy
    if raw.get("finish_reason") is not None:
        choice.finish_reason = raw["finish_reason"]
    if raw.get("stop_reason") is not None:
        choice.stop_reason = raw["stop_reason"]


def _merge_tool_call(choice: _Choice, call: Any) -> None:
    if not isinstance(call, Mapping):
        return
    index = _index(call.get("index"), len(choice.tool_calls))
    empty = {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
    merged = choice.tool_calls.setdefault(index, empty)
    if call.get("id"):
        merged["id"] = call["id"]
    if call.get("type"):
        merged["type"] = call["type"]
    function = call.get("function") or {}
    if isinstance(function.get("name"), str):
        merged["function"]["name"] += function["name"]
    if isinstance(function.get("arguments"), str):
        merged["function"]["arguments"] += function["arguments"]


def _finish_choice(kind: CallKind, choice: _Choice) -> dict[str, Any]:
    result: dict[str, Any] = {"index": choice.index, "finish_reason": choice.finish_reason}
    if kind == CHAT:
        message: dict[str, Any] = {"role": choice.role or "assistant", "content": "".join(choice.text) or None}
        if choice.reasoning:
            message["reasoning_content"] = "".join(choice.reasoning)
        if choice.tool_calls:
            message["tool_calls"] = [choice.tool_calls[i] for i in sorted(choice.tool_calls)]
        result["message"] = message
        result["logprobs"] = {"content": choice.logprobs_content} if choice.logprobs_content is not None else None
    else:
        result["text"] = "".join(choice.text)
        result["logprobs"] = choice.legacy_logprobs
        result["prompt_token_ids"] = choice.prompt_token_ids
    result["token_ids"] = choice.token_ids
    if choice.stop_reason is not None:
        result["stop_reason"] = choice.stop_reason
    return result


# -- extraction -------------------------------------------------------------------------------


def _first_choice(response: Mapping[str, Any]) -> Mapping[str, Any] | None:
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices:
        return None
    first = min((c for c in choices if isinstance(c, Mapping)), key=lambda c: c.get("index", 0), default=None)
    return first


def _int_list(value: Any) -> list[int] | None:
    if not isinstance(value, list):
        return None
    if not all(isinstance(item, int) and not isinstance(item, bool) for item in value):
        return None  # a malformed list would poison training data; better none than wrong
    return list(value)


def token_ids(kind: CallKind, response: Mapping[str, Any]) -> tuple[list[int] | None, list[int] | None]:
    """``(prompt_token_ids, response_token_ids)`` of the first choice; None where the backend gave none."""
    choice = _first_choice(response)
    if kind == CHAT:
        prompt = _int_list(response.get("prompt_token_ids"))
    else:
        prompt = _int_list(choice.get("prompt_token_ids")) if choice is not None else None
        if prompt is None:  # not vLLM's place for it, but harmless to accept
            prompt = _int_list(response.get("prompt_token_ids"))
    completion = _int_list(choice.get("token_ids")) if choice is not None else None
    return prompt, completion


def logprobs_content(kind: CallKind, response: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The first choice's logprobs as OpenAI's chat ``content`` list (text completions converted)."""
    choice = _first_choice(response)
    logprobs = choice.get("logprobs") if choice is not None else None
    if not isinstance(logprobs, Mapping):
        return None
    if isinstance(logprobs.get("content"), list):
        return [dict(item) for item in logprobs["content"] if isinstance(item, Mapping)]
    tokens = logprobs.get("tokens")
    if not isinstance(tokens, list):
        return None
    values = logprobs.get("token_logprobs") or []
    tops = logprobs.get("top_logprobs") or []
    content = []
    for i, token in enumerate(tokens):
        top = tops[i] if i < len(tops) and isinstance(tops[i], Mapping) else {}
        content.append(
            {
                "token": token,
                "logprob": values[i] if i < len(values) else None,
                "bytes": None,
                "top_logprobs": [{"token": t, "logprob": lp, "bytes": None} for t, lp in top.items()],
            }
        )
    return content


# -- messages in the GenAI conventions ------------------------------------------------------
#
# ``gen_ai.input.messages`` / ``gen_ai.output.messages``: JSON arrays of {role, parts[,
# finish_reason]}, each part typed (text, tool_call, tool_call_response, reasoning, or the
# provider's own type with its value), as OpenTelemetry's GenAI semantic conventions define
# them; built from opentelemetry-util-genai's message types.


@dataclass
class ProviderPart(GenericPart):
    """A part the conventions have no type of their own for (images, audio, files, a prompt of
    token ids): the provider's part as it came, under ``value`` (a generic part takes any
    properties)."""

    value: Any = None


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _content_parts(content: Any) -> list[MessagePart]:
    """OpenAI message content (a string, or a list of typed parts) as GenAI parts."""
    if content is None:
        return []
    if isinstance(content, str):
        return [Text(content=content)]
    if isinstance(content, list):
        parts: list[MessagePart] = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(Text(content=part["text"]))
            else:  # images, audio, files: the provider's part as it came
                kind = part.get("type") if isinstance(part, Mapping) else None
                parts.append(ProviderPart(type=str(kind or "unknown"), value=part))
        return parts
    return [ProviderPart(type="unknown", value=content)]


def _tool_calls(message: Mapping[str, Any]) -> list[MessagePart]:
    calls: list[MessagePart] = []
    for call in message.get("tool_calls") or []:
        if not isinstance(call, Mapping):
            continue
        function = _mapping(call.get("function"))
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass  # the model's malformed arguments stay as it wrote them
        name = function.get("name")
        call_id = call.get("id")
        calls.append(
            ToolCallRequest(
                arguments=arguments,
                name=name if isinstance(name, str) else "",
                id=call_id if isinstance(call_id, str) else None,
            )
        )
    return calls


def _message_parts(message: Mapping[str, Any]) -> list[MessagePart]:
    if message.get("role") == "tool":
        call_id = message.get("tool_call_id")
        return [ToolCallResponse(response=message.get("content"), id=call_id if isinstance(call_id, str) else None)]
    parts: list[MessagePart] = []
    for key in ("reasoning_content", "reasoning"):  # vLLM's reasoning parsers
        if isinstance(message.get(key), str) and message[key]:
            parts.append(Reasoning(content=message[key]))
            break
    parts += _content_parts(message.get("content"))
    parts += _tool_calls(message)
    return parts


def input_messages(kind: CallKind, request: Mapping[str, Any]) -> list[InputMessage]:
    """What the agent sent: the chat messages, or a text completion's prompt as one user message."""
    if kind == CHAT:
        messages = request.get("messages")
        return [
            InputMessage(role=str(m.get("role") or "user"), parts=_message_parts(m))
            for m in (messages if isinstance(messages, list) else [])
            if isinstance(m, Mapping)
        ]
    prompt = request.get("prompt")
    if prompt is None:
        return []
    part: MessagePart = Text(content=prompt) if isinstance(prompt, str) else ProviderPart(type="prompt", value=prompt)
    return [InputMessage(role="user", parts=[part])]


def output_messages(kind: CallKind, response: Mapping[str, Any]) -> list[OutputMessage]:
    """What the model answered: one message per choice, with its finish reason."""
    messages = []
    for choice in response.get("choices") or []:
        if not isinstance(choice, Mapping):
            continue
        finish = choice.get("finish_reason")
        finish_reason = finish if isinstance(finish, str) else "error"
        if kind == CHAT:
            message = _mapping(choice.get("message"))
            role = message.get("role")
            role = role if isinstance(role, str) else "assistant"
            messages.append(OutputMessage(role=role, parts=_message_parts(message), finish_reason=finish_reason))
        else:
            text = choice.get("text")
            parts: list[MessagePart] = [Text(content=text)] if isinstance(text, str) else []
            messages.append(OutputMessage(role="assistant", parts=parts, finish_reason=finish_reason))
    return messages


def _without_none(fields: list[tuple[str, Any]]) -> dict[str, Any]:
    return {key: value for key, value in fields if value is not None}


def messages_json(messages: Sequence[InputMessage | OutputMessage]) -> str:
    # Unset optional fields (a message's name, a tool call's id) are left out, not written as null.
    return _json_text([asdict(message, dict_factory=_without_none) for message in messages])


def _json_text(value: Any) -> str:
    # allow_nan: logprobs may hold -inf; Python's json reads it back, as the seed's reader does.
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=True)


# -- spans ------------------------------------------------------------------------------------


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
        attributes[TOOLS_KEY] = _json_text(request["tools"])

    response = call.response or {}
    prompt_ids, response_ids = token_ids(call.kind, response)
    if isinstance(response.get("model"), str):
        attributes["gen_ai.response.model"] = response["model"]
    if isinstance(response.get("id"), str):
        attributes["gen_ai.response.id"] = response["id"]
    finish_reasons = [
        c["finish_reason"]
        for c in response.get("choices") or []
        if isinstance(c, Mapping) and isinstance(c.get("finish_reason"), str)
    ]
    if finish_reasons:
        attributes["gen_ai.response.finish_reasons"] = cast(list[AttributeScalar], finish_reasons)
    usage = response.get("usage") if isinstance(response.get("usage"), Mapping) else {}
    input_tokens = usage.get("prompt_tokens") if usage else None
    output_tokens = usage.get("completion_tokens") if usage else None
    if not isinstance(input_tokens, int) and prompt_ids is not None:
        input_tokens = len(prompt_ids)
    if not isinstance(output_tokens, int) and response_ids is not None:
        output_tokens = len(response_ids)
    if isinstance(input_tokens, int):
        attributes["gen_ai.usage.input_tokens"] = input_tokens
    if isinstance(output_tokens, int):
        attributes["gen_ai.usage.output_tokens"] = output_tokens
    if prompt_ids is not None:
        attributes["prompt_token_ids"] = cast(list[AttributeScalar], prompt_ids)
    if response_ids is not None:
        attributes["response_token_ids"] = cast(list[AttributeScalar], response_ids)
    content = logprobs_content(call.kind, response)
    if content is not None:
        attributes["logprobs.content"] = _json_text(content)
    answered = output_messages(call.kind, response)
    if answered:
        attributes[OUTPUT_MESSAGES_KEY] = messages_json(answered)
    if call.error is not None:
        attributes["error.type"] = call.error.type
        attributes["http.response.status_code"] = call.error.status
    if call.policy_version is not None:
        attributes[POLICY_VERSION] = call.policy_version
    return attributes


def policy_version_of_header(value: str | None) -> int | None:
    """The policy version a backend named in :data:`POLICY_VERSION_HEADER`; None if absent or not a number."""
    if value is None:
        return None
    try:
        return int(value.strip())
    except ValueError:
        return None


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
