"""An LLM call's messages in OpenTelemetry's GenAI conventions (``gen_ai.input.messages``,
``gen_ai.output.messages``): JSON arrays of {role, parts[, finish_reason]}, each part typed (text,
tool_call, tool_call_response, reasoning, or the provider's own type with its value), built from
opentelemetry-util-genai's message types."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

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

from agl_stream.domain.llm_calls.backend import CHAT, CallKind


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
    return json_text([asdict(message, dict_factory=_without_none) for message in messages])


def json_text(value: Any) -> str:
    # allow_nan: logprobs may hold -inf; Python's json reads it back, as the seed's reader does.
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=True)


def json_value(text: Any) -> Any:
    """What a JSON-text attribute (:func:`json_text`'s) holds; None when it is no string or no JSON."""
    if not isinstance(text, str):
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None
