"""A keypad agent: three turns of typing a code, with the keypad's feedback between them.

The environment is a keypad that accepts digits only. The agent is asked for a code
(``task["prompt"]``); after each answer the keypad reports how many of the typed keys it read
as digits (``"3/8 digits ok. next:"``) and asks again, for :data:`TURNS` turns in all. The
reward is the mean over the turns of each answer's digit fraction (:func:`episode_reward`):
computed from what the agent typed, partial credit on every turn, 0 for empty answers.

Every model call is one chat request whose messages are the whole conversation so far (the
first prompt, every answer as an assistant turn, every feedback as a user turn), so with a
ChatML template each call's prompt is the previous call's prompt + response + the inserted
end-of-turn and feedback tokens: `agl-stream triplets --aggregation trajectory` merges the three
calls of a rollout into one sample (response mask 0 on the feedback), `transition` keeps three.
The task is sized for the tiny CPU policy the demo trains (character tokens, a few versions to
learn it); it runs against any OpenAI-compatible endpoint. The module is pure apart from
:func:`keypad_agent`, which calls the model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from opentelemetry import trace

import agl_stream as agl
from agl_stream.demo.task import digit_reward
from agl_stream.models import LLM

HERE = Path(__file__).resolve().parent
TRAIN_FILE = HERE / "data" / "train.jsonl"
VAL_FILE = HERE / "data" / "val.jsonl"

TURNS = 3
"""Model calls per rollout: the first answer, then one more after each feedback."""
MAX_TOKENS = 8
"""Completion length of one turn (the tiny policy's answers are characters)."""


def feedback(answer: str) -> str:
    """What the keypad says after ``answer``: how many of its keys were digits, and to type again."""
    digits = sum(ch.isdigit() for ch in answer)
    return f"{digits}/{len(answer)} digits ok. next:"


def episode_reward(answers: list[str]) -> float:
    """The mean over the turns of each answer's digit fraction (0.0 without answers)."""
    return sum(digit_reward(a) for a in answers) / len(answers) if answers else 0.0


def conversation(prompt: str, answers: list[str]) -> list[dict[str, str]]:
    """The chat messages of the next call after ``answers``: the prompt, then per answer the
    assistant turn and the keypad's feedback (a user turn)."""
    messages = [{"role": "user", "content": prompt}]
    for answer in answers:
        messages.append({"role": "assistant", "content": answer})
        messages.append({"role": "user", "content": feedback(answer)})
    return messages


def load_tasks(path: Path) -> list[dict[str, Any]]:
    """The tasks of a JSON-lines file (blank lines skipped)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -- the agent ------------------------------------------------------------------------------------


def _sampling(llm: LLM) -> dict[str, Any]:
    """The call's sampling arguments: the resource's, with a bound on the completion length."""
    allowed = ("temperature", "top_p", "max_tokens", "seed")
    sampling = {k: v for k, v in llm.sampling_parameters.items() if k in allowed}
    sampling.setdefault("max_tokens", MAX_TOKENS)
    sampling.setdefault("temperature", 1.0)
    return sampling


@agl.rollout
async def keypad_agent(task: dict[str, Any], llm: LLM) -> float:
    """Type a code :data:`TURNS` times, reading the keypad's feedback in between; the reward is
    :func:`episode_reward` of the answers."""
    from openai import AsyncOpenAI  # imported in the runner only: the trainer process never needs it

    tracer = trace.get_tracer("examples.keypad")
    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key or "none", max_retries=2)
    answers: list[str] = []
    try:
        for _ in range(TURNS):
            reply = await client.chat.completions.create(
                model=llm.model,
                messages=conversation(task["prompt"], answers),  # type: ignore[arg-type]
                **_sampling(llm),
            )
            answer = reply.choices[0].message.content or ""
            answers.append(answer)
            with tracer.start_as_current_span("keypad") as span:  # the environment's step
                span.set_attribute("tool.name", "keypad")
                span.set_attribute("tool.arguments", answer)
                span.set_attribute("tool.result", feedback(answer))
    finally:
        await client.close()
    return episode_reward(answers)
