"""The backend's side of an LLM call: what it is asked, how it fails, its streams, its token ids.

* The backend is always asked for token ids (vLLM's ``return_token_ids``) and, unless turned
  off, for the sampled tokens' logprobs (:func:`backend_request`): training needs the prompt
  and response token ids exactly as the engine saw them, and the behaviour policy's logprobs.
* vLLM (>= 0.10.2) answers chat with top-level ``prompt_token_ids`` and
  ``choices[i].token_ids``; text completions with ``choices[i].prompt_token_ids`` and
  ``choices[i].token_ids``. Streams carry the prompt ids on the first chunk and each chunk's
  new token ids on its choices; :func:`merge_chunks` folds a stream into the non-streaming
  shape, so one extraction serves both (:func:`token_ids`, :func:`logprobs_content`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

CallKind: TypeAlias = Literal["chat", "completion"]
CHAT: CallKind = "chat"
COMPLETION: CallKind = "completion"

_ERROR_TYPES = {  # any other 4xx is an invalid_request_error, a 5xx an api_error
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    409: "conflict_error",
    429: "rate_limit_error",
}


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
            legacy = choice.legacy_logprobs or {key: [] for key in _LEGACY_LOGPROBS_KEYS}
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


def policy_version_of_header(value: str | None) -> int | None:
    """The policy version a backend named in its ``POLICY_VERSION_HEADER`` (``agl_stream.wire.semconv``);
    None if absent or not a number."""
    if value is None:
        return None
    try:
        return int(value.strip())
    except ValueError:
        return None
