"""A sentiment classifier whose prompt APO improves: one model call per task, reward by label match.

The agent formats the ``PromptTemplate`` resource with the task's ``text``, sends it to the
``LLM`` resource as one user message and reads a label (positive, negative or neutral) from the
answer (:func:`read_label`): the reward is 1.0 when it is the task's label, else 0.0. It logs
what the model said and what was expected as a message span, which is what APO's critique
model reads about each run.

Tasks are JSON objects ``{"id", "text", "label"}`` (``data/*.jsonl``, written for this example).
The seed prompt (:data:`SEED_PROMPT`) is vague on purpose: it names neither the labels nor the
answer's form, so a model tends to answer with a paragraph APO's edits can fix.
The module is pure apart from :func:`classify_agent`, which calls the model.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI

import agl_stream as agl

HERE = Path(__file__).resolve().parent
TRAIN_FILE = HERE / "data" / "train.jsonl"
VAL_FILE = HERE / "data" / "val.jsonl"

LABELS = ("positive", "negative", "neutral")

PROMPT_RESOURCE = "classify_prompt"
"""The name of the prompt in the resources (the one APO edits)."""

SEED_PROMPT = "What do you make of this review?\n\n{text}"
"""The prompt APO starts from: ``{text}`` is the task's sentence."""

MAX_TOKENS = 64
"""Completion tokens per call unless the LLM resource's sampling parameters say otherwise."""


def load_tasks(path: Path | str) -> list[dict[str, Any]]:
    """The tasks of a JSON-lines file."""
    with open(path, encoding="utf-8") as file:
        return [json.loads(line) for line in file if line.strip()]


def read_label(answer: str) -> str | None:
    """The label an answer gives: the only label word in it, or the label it starts with when
    it names several ("Negative, not positive"); None when it names none or is ambiguous."""
    words = re.findall(r"[a-z]+", answer.lower())
    named = [word for word in words if word in LABELS]
    if not named:
        return None
    if len(set(named)) == 1:
        return named[0]
    return words[0] if words and words[0] in LABELS else None


def initial_resources(
    endpoint: str, model: str, *, api_key: str | None = None, temperature: float = 0.0, prompt: str = SEED_PROMPT
) -> dict[str, Any]:
    """The resources the run starts from: the agent's model and the seed prompt."""
    return {
        "main_llm": agl.LLM(
            endpoint=endpoint,
            model=model,
            api_key=api_key,
            sampling_parameters={"temperature": temperature, "max_tokens": MAX_TOKENS},
        ),
        PROMPT_RESOURCE: agl.PromptTemplate(template=prompt, engine="f-string"),
    }


@agl.rollout
async def classify_agent(task: dict[str, Any], prompt_template: agl.PromptTemplate, llm: agl.LLM) -> float:
    """Classify ``task["text"]`` with the prompt; the reward is 1.0 for the task's label."""
    prompt = prompt_template.format(text=task["text"])
    sampling = {"max_tokens": MAX_TOKENS, **(llm.sampling_parameters or {})}
    # A client per rollout, closed with it: the agent is pickled to the runner processes, and
    # an open client neither pickles nor outlives the rollout's event loop.
    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key or "none", max_retries=1)
    try:
        response = await client.chat.completions.create(
            model=llm.model, messages=[{"role": "user", "content": prompt}], **sampling
        )
    finally:
        await client.close()
    answer = (response.choices[0].message.content if response.choices else None) or ""
    label = read_label(answer)
    agl.emit_message(f"model answered {answer[:300]!r}; read as {label or 'no label'}; expected {task['label']}")
    return 1.0 if label == task["label"] else 0.0
