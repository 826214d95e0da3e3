"""LLM calls shaped exactly as the LLM proxy records them, for the export tests and benchmark.

``chat_call`` is one call (an OpenAI request and a vLLM-like answer with token ids) as the proxy's
:class:`LLMCall`; ``tool_episode`` is a calculator agent's two calls (a tool call, then the answer
after the tool's result), the second continuing the first's messages; ``attempt_spans`` turns
calls and a reward into the spans of one attempt (the proxy's call spans and a reward span).
"""

from __future__ import annotations

import json
from typing import Any

from agl_stream.domain.llm_calls import CHAT, LLMCall, build_span
from agl_stream.models import Span
from agl_stream.wire.semconv import AGL_ANNOTATION

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]
SYSTEM = "You are a careful calculator agent."


def chat_call(
    messages: list[dict[str, Any]],
    answer: dict[str, Any],
    *,
    tools: list[dict[str, Any]] | None = None,
    start: float = 1.0,
    prompt_ids: list[int] | None = None,
    version: int | None = None,
) -> LLMCall:
    request: dict[str, Any] = {"model": "agl-tiny", "messages": messages}
    if tools:
        request["tools"] = tools
    response = {
        "id": f"chatcmpl-{abs(hash((json.dumps(messages), start))) % 10**12}",
        "model": "agl-tiny",
        "prompt_token_ids": prompt_ids or [1, 2, 3],
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", **answer},
                "finish_reason": "tool_calls" if answer.get("tool_calls") else "stop",
                "token_ids": [4, 5],
            }
        ],
    }
    return LLMCall(CHAT, request, start, start + 0.5, response=response, policy_version=version)


def tool_episode(
    question: str, expression: str, result: str, final: str, *, version: int | None = None
) -> list[LLMCall]:
    """Two calls: the model asks for the calculator, then answers after the tool's result."""
    asked: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})},
    }
    first = chat_call(asked, {"content": None, "tool_calls": [call]}, tools=TOOLS, start=1.0, version=version)
    followed: list[dict[str, Any]] = [
        *asked,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": result},
    ]
    second = chat_call(followed, {"content": final}, tools=TOOLS, start=2.0, version=version)
    return [first, second]


def reward_span(rollout_id: str, attempt_id: str, sequence_id: int, value: float, at: float) -> Span:
    return Span(
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        sequence_id=sequence_id,
        trace_id="1" * 32,
        span_id=f"{sequence_id:016x}",
        parent_id=None,
        name=AGL_ANNOTATION,
        attributes={"agentlightning.reward.0.name": "primary", "agentlightning.reward.0.value": value},
        start_time=at,
        end_time=at,
    )


def attempt_spans(rollout_id: str, calls: list[LLMCall], reward: float | None, attempt_id: str = "a-1") -> list[Span]:
    spans = [
        build_span(call, rollout_id=rollout_id, attempt_id=attempt_id, sequence_id=i + 1, span_id=f"{i + 1:016x}")
        for i, call in enumerate(calls)
    ]
    if reward is not None:
        spans.append(reward_span(rollout_id, attempt_id, len(calls) + 1, reward, at=max(c.end_time for c in calls) + 1))
    return spans
