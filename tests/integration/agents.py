"""Agents the runner tests run (loaded by runner processes as ``tests.integration.agents:<name>``).

``scripted`` does what the task says, so one runner serves every scenario:
``{"kind": "ok", "i": n}``          two nested spans and a message, reward ``n % 2``
``{"kind": "raise"}``               raises ValueError (the attempt fails)
``{"kind": "sleep_first", "seconds": s}``  the first attempt works for ``s`` seconds, later ones finish at once
``{"kind": "sleep", "seconds": s}``  every attempt works for ``s`` seconds, then succeeds
``{"kind": "spans"}``               returns a list of OpenTelemetry spans instead of tracing them
"""

from __future__ import annotations

import asyncio
from typing import Any

from opentelemetry import trace

from agl_stream.agent.emitters import emit_message
from agl_stream.agent.litagent import rollout
from agl_stream.models import LLM, Rollout


@rollout
async def scripted(task: dict[str, Any], rollout: Rollout) -> Any:
    kind = task.get("kind", "ok")
    attempt = getattr(rollout, "attempt", None)
    if kind == "raise":
        raise ValueError(f"scripted failure of {rollout.rollout_id}")
    if kind == "sleep_first" and attempt is not None and attempt.sequence_id == 1:
        await asyncio.sleep(task["seconds"])  # the agent's own work, not synchronisation
    if kind == "sleep":
        await asyncio.sleep(task["seconds"])
    tracer = trace.get_tracer("tests.agents")
    with tracer.start_as_current_span("agent.step") as step:
        step.set_attribute("task.i", task.get("i", -1))
        with tracer.start_as_current_span("tool.call") as tool:
            tool.set_attribute("tool.name", "calculator")
    emit_message(f"finished {rollout.rollout_id}")
    return float(task.get("i", 1) % 2)


@rollout
def sync_scripted(task: dict[str, Any]) -> float:
    """A plain function: runs in a thread, traced all the same."""
    with trace.get_tracer("tests.agents").start_as_current_span("sync.step"):
        pass
    return 1.0


@rollout
async def needs_llm(task: dict[str, Any], llm: LLM) -> float:
    """Reports the LLM it was given (as a message) and rewards the expected model."""
    emit_message(f"{llm.model} at {llm.endpoint}")
    return 1.0 if llm.model == task["expected_model"] else 0.0


@rollout
async def llm_like(task: dict[str, Any]) -> None:
    """Two LLM-call spans shaped like the proxy's (token ids, response id), then a reward span."""
    from agl_stream.agent.emitters import emit_reward

    tracer = trace.get_tracer("tests.agents")
    base = int(task["i"]) * 10
    for call in range(2):
        with tracer.start_as_current_span("openai.chat.completion") as span:
            span.set_attribute("gen_ai.response.id", f"chatcmpl-{task['i']}-{call}")
            span.set_attribute("prompt_token_ids", [base + call, base + call + 1])
            span.set_attribute("response_token_ids", [base + call + 2])
    emit_reward(float(task["i"]) / 10)
    return None


@rollout
async def ask_model(task: dict[str, Any], llm: LLM) -> float:
    """One chat call through the LLM resource (the proxy on this attempt's URL); reward = answer length / 10.

    The answer's text goes into a message span, so a test can compare it with the triplet.
    """
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key or "none", max_retries=0)
    try:
        reply = await client.chat.completions.create(
            model=llm.model,
            messages=[{"role": "user", "content": task["question"]}],
            max_tokens=6,
            temperature=1.0,
            seed=int(task.get("seed", 0)),
        )
    finally:
        await client.close()
    text = reply.choices[0].message.content or ""
    emit_message(text)
    return len(text) / 10
