"""The apo_classify example's pure parts: reading a label from an answer, its data, its resources."""

from __future__ import annotations

import pytest

import agl_stream as agl
from examples.apo_classify.classify_agent import (
    LABELS,
    PROMPT_RESOURCE,
    SEED_PROMPT,
    TRAIN_FILE,
    VAL_FILE,
    initial_resources,
    load_tasks,
    read_label,
)


@pytest.mark.parametrize(
    ("answer", "label"),
    [
        ("Positive", "positive"),
        ("negative.", "negative"),
        ("  NEUTRAL\n", "neutral"),
        ("The sentiment is clearly positive: the reviewer loves it.", "positive"),
        ("Negative, not positive.", "negative"),  # several labels: the one it starts with
        ("It is positive in parts and negative in others.", None),  # ambiguous
        ("I cannot tell.", None),
        ("", None),
        ("positively", None),  # a label word, not a word that contains one
    ],
)
def test_read_label(answer: str, label: str | None) -> None:
    assert read_label(answer) == label


def test_the_shipped_data_is_balanced_and_well_formed() -> None:
    train, val = load_tasks(TRAIN_FILE), load_tasks(VAL_FILE)
    assert (len(train), len(val)) == (18, 12)
    for tasks in (train, val):
        assert all(set(t) == {"id", "text", "label"} and t["label"] in LABELS for t in tasks)
        assert sorted(t["label"] for t in tasks) == sorted(list(LABELS) * (len(tasks) // 3))
    ids = [t["id"] for t in train + val]
    assert len(set(ids)) == len(ids)


def test_the_initial_resources_hold_the_model_and_the_seed_prompt() -> None:
    resources = initial_resources("http://127.0.0.1:8000/v1", "m", api_key="k")
    prompt = resources[PROMPT_RESOURCE]
    assert isinstance(prompt, agl.PromptTemplate) and prompt.template == SEED_PROMPT
    assert prompt.format(text="Nice.").endswith("Nice.")
    llm = resources["main_llm"]
    assert isinstance(llm, agl.LLM) and (llm.endpoint, llm.model, llm.api_key) == ("http://127.0.0.1:8000/v1", "m", "k")
