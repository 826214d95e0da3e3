"""Agents for benchmarks/runners.py (loaded by runner processes as ``benchmarks.bench_agents:<name>``)."""

from __future__ import annotations

from typing import Any

from opentelemetry import trace

from agl_stream.agent.litagent import rollout

_PAYLOAD = "x" * 2048  # a span of ~2-3 KB once encoded: a typical LLM call span with its messages


@rollout
async def trivial(task: Any) -> float:
    """The no-op agent: one reward span."""
    return 1.0


@rollout
async def chatty(task: dict[str, Any]) -> float:
    """``task["spans"]`` spans of ~2.5 KB each, as an agent with many LLM and tool calls makes."""
    tracer = trace.get_tracer("bench")
    for i in range(task["spans"]):
        with tracer.start_as_current_span("llm.call") as span:
            span.set_attribute("gen_ai.prompt", _PAYLOAD)
            span.set_attribute("step", i)
    return 1.0


@rollout
async def ten_calls(task: dict[str, Any]) -> float:
    """Ten LLM-call spans shaped like the proxy's (token ids, response id, logprobs), then a reward."""
    tracer = trace.get_tracer("bench")
    for call in range(10):
        with tracer.start_as_current_span("openai.chat.completion") as span:
            span.set_attribute("gen_ai.response.id", f"chatcmpl-{task['i']}-{call}")
            span.set_attribute("prompt_token_ids", list(range(100 + call, 164 + call)))
            span.set_attribute("response_token_ids", list(range(16)))
    return 1.0


@rollout
async def two_calls(task: dict[str, Any]) -> float:
    """Two LLM-call spans shaped like the proxy's, then a reward: a small multi-call agent whose
    rollouts become triplets (benchmarks/soak.py)."""
    tracer = trace.get_tracer("bench")
    for call in range(2):
        with tracer.start_as_current_span("openai.chat.completion") as span:
            span.set_attribute("gen_ai.response.id", f"chatcmpl-{task['i']}-{call}")
            span.set_attribute("prompt_token_ids", list(range(100 + call, 164 + call)))
            span.set_attribute("response_token_ids", list(range(16)))
    return 1.0
