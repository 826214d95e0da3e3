"""The agent of the export tests (loaded by runner processes as ``tests.integration.export_agents:calculator``).

It records two LLM calls exactly as the LLM proxy would (tests/export_spans.py: a calculator tool
call, then the answer after the tool's result) and returns the task's reward, so an export of its
rollouts has known chats, tool calls and rewards.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opentelemetry import trace

from agl_stream.agent.emitters import find_final_reward
from agl_stream.agent.litagent import rollout
from agl_stream.domain.llm_calls.spans import SPAN_NAMES, span_attributes
from agl_stream.models import Span
from tests.export_spans import tool_episode


@rollout
async def calculator(task: dict[str, Any]) -> float:
    tracer = trace.get_tracer("tests.export_agents")
    for call in tool_episode(task["question"], task["expression"], task["result"], task["final"]):
        with tracer.start_as_current_span(SPAN_NAMES[call.kind]) as span:
            span.set_attributes(span_attributes(call))  # type: ignore[arg-type]
    return float(task["reward"])


def inverted_reward(spans: Sequence[Span]) -> float | None:
    """A replay's ``--reward``: one minus the reward the agent gave (so a replay re-ranks its rollouts)."""
    given = find_final_reward(spans)
    return None if given is None else 1.0 - given
