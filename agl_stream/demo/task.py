"""The demo's toy task: answer with digits.

A prompt asks for digits; the reward is the fraction of the answer's characters that are
digits (partial credit, so every sample says how close it was: measured here, an exact-match
reward barely moves a tiny random policy in 20 steps). A random policy
over the 64-symbol alphabet scores about 0.15; GRPO raises it within minutes on CPU.
"""

from __future__ import annotations

from typing import Any

from agl_stream.agent.litagent import rollout
from agl_stream.models import LLM

PROMPTS = ("write digits:", "numbers please:", "say a number:", "digits only:")
MAX_TOKENS = 8


def digit_reward(answer: str) -> float:
    """Fraction of the answer's characters that are digits (0 for an empty answer)."""
    return sum(ch.isdigit() for ch in answer) / len(answer) if answer else 0.0


@rollout
async def digits(task: dict[str, Any], llm: LLM) -> float:
    """One sampled answer through the LLM proxy; its digit fraction is the final reward."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key or "none", max_retries=2)
    try:
        reply = await client.chat.completions.create(
            model=llm.model,
            messages=[{"role": "user", "content": task["prompt"]}],
            max_tokens=MAX_TOKENS,
            temperature=1.0,
        )
    finally:
        await client.close()
    return digit_reward(reply.choices[0].message.content or "")
