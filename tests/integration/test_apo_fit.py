"""``Trainer.fit(APO)`` end to end on the session's broker: the apo_classify example's agent in
two runner processes, and one scripted OpenAI-compatible server as the agent's model, the
critique model and the edit model (the test decides every answer).

The script: the agent's model gives the right label only when the prompt asks for one word,
and otherwise always says "Positive." (right for half the validation tasks); the critique
model says to ask for one word; the edit model adds that instruction to the template it was
given. So one round must find a better prompt: score 0.5 -> 1.0, read from SQL by the run and
again here, independently, from ClickHouse by resources id.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
from rich.console import Console

import agl_stream as agl
from agl_stream.config import Settings
from agl_stream.local.processes import role_alive
from examples.apo_classify.classify_agent import (
    PROMPT_RESOURCE,
    SEED_PROMPT,
    TRAIN_FILE,
    VAL_FILE,
    classify_agent,
    initial_resources,
    load_tasks,
)
from tests.integration.helpers import clickhouse
from tests.scripted_openai import scripted_openai

pytestmark = pytest.mark.integration

INSTRUCTION = "Answer with one word: positive, negative or neutral."
CRITIQUE = "1. The template never says which labels exist or how to answer: ask for exactly one word."

# Small on purpose (make test's budget): 2 training tasks for the one critique, 4 validation
# tasks of which 2 are positive (the seed prompt's "Positive." is right for those).
TRAIN = load_tasks(TRAIN_FILE)[:2]
VAL = [t for t in load_tasks(VAL_FILE) if t["label"] == "positive"][:2] + [
    t for t in load_tasks(VAL_FILE) if t["label"] != "positive"
][:2]
LABEL_OF = {task["text"]: task["label"] for task in [*TRAIN, *VAL]}

# An independent reading: per resources id, the validation rollouts and their mean final
# reward (the latest reward span of each rollout; one without a reward counts 0).
SCORES_BY_RESOURCES = """
SELECT r.resources_id AS resources_id, count() AS rollouts, sum(ifNull(t.reward, 0)) / count() AS score
FROM (SELECT rollout_id, resources_id FROM {db}.rollouts FINAL WHERE mode = 'val') AS r
LEFT JOIN (
    SELECT RolloutId, argMax(toFloat64(SpanAttributes['agentlightning.reward.0.value']), SequenceId) AS reward
    FROM {db}.otel_traces FINAL
    WHERE has(mapKeys(SpanAttributes), 'agentlightning.reward.0.value')
    GROUP BY RolloutId
) AS t ON t.RolloutId = r.rollout_id
GROUP BY r.resources_id
"""

LATEST_RESOURCES = "SELECT resources_id, resources FROM {db}.resources FINAL ORDER BY kafka_offset DESC LIMIT 1"


def _content(body: dict[str, Any]) -> str:
    return "\n".join(str(m.get("content") or "") for m in body.get("messages", []))


def reply(body: dict[str, Any]) -> str:
    """The three scripted models, told apart by the model name."""
    text = _content(body)
    if body["model"] == "critic":
        return CRITIQUE
    if body["model"] == "editor":
        template = re.search(r"<template>\n(.*?)\n</template>", text, re.DOTALL)
        assert template is not None, text
        return f"Here is the revised template:\n<prompt>\n{template.group(1)}\n{INSTRUCTION}\n</prompt>"
    sentence = next(s for s in LABEL_OF if s in text)
    return LABEL_OF[sentence].capitalize() if "one word" in text else "Positive."


def test_one_apo_round_finds_a_better_prompt_scored_from_sql(kafka_bootstrap: str, tmp_path: Path) -> None:
    settings = Settings(
        kafka_bootstrap=kafka_bootstrap, data_dir=tmp_path, topic_prefix=f"a{uuid4().hex[:10]}", gateway_port=0
    )
    with scripted_openai(reply) as server:
        algorithm = agl.APO(
            gradient_model="critic",
            apply_edit_model="editor",
            gradient_base_url=server.base_url,
            gradient_batch_size=2,
            val_batch_size=len(VAL),
            beam_width=1,
            branch_factor=1,
            beam_rounds=1,
            rollout_batch_timeout=120.0,
        )
        trainer = agl.Trainer(
            algorithm=algorithm,
            n_runners=2,
            initial_resources=initial_resources(server.base_url, "agent-model"),
            settings=settings,
            console=Console(quiet=True),
        )
        result = trainer.fit(classify_agent, TRAIN, VAL)
        requests = list(server.requests)

    best = algorithm.get_best_prompt()
    assert best.template == f"{SEED_PROMPT}\n{INSTRUCTION}"
    assert (algorithm.seed_score, algorithm.best_score) == (0.5, 1.0)
    seed_id = algorithm.history[0].resources_id
    assert algorithm.best_resources_id is not None and algorithm.best_resources_id != seed_id
    # Every scoring: the seed before the search, the new prompt in round 1; the seed was not
    # run again in round 1 (already scored on these validation tasks).
    assert [(h.round, h.resources_id, h.prompt, h.score, h.tasks, h.full) for h in algorithm.history] == [
        (0, seed_id, SEED_PROMPT, 0.5, 4, True),
        (1, algorithm.best_resources_id, best.template, 1.0, 4, True),
    ]
    assert {mode: r.rollouts for mode, r in result.modes.items()} == {"train": 2, "val": 8}

    # The critique read the training rollouts (their tasks, rewards and logged answers); the
    # edit was asked with the critique; the agent's model saw both prompts.
    models = [body["model"] for body in requests]
    assert models.count("critic") == 1 and models.count("editor") == 1 and models.count("agent-model") == 10
    critique_request = _content(next(b for b in requests if b["model"] == "critic"))
    assert all(task["text"] in critique_request for task in TRAIN)
    assert f"<template>\n{SEED_PROMPT}\n</template>" in critique_request
    assert "model answered 'Positive.'; read as positive; expected negative" in critique_request
    assert CRITIQUE in _content(next(b for b in requests if b["model"] == "editor"))

    # The same scores read here from ClickHouse, by resources id; the best prompt is the
    # latest published resources, with the agent's LLM beside it.
    db = settings.clickhouse_database
    with clickhouse(settings) as client:
        scores = {rid: (n, score) for rid, n, score in client.query(SCORES_BY_RESOURCES.format(db=db)).result_rows}
        latest_id, latest = client.query(LATEST_RESOURCES.format(db=db)).result_rows[0]
    assert scores == {seed_id: (4, pytest.approx(0.5)), algorithm.best_resources_id: (4, pytest.approx(1.0))}
    assert latest_id == algorithm.best_resources_id
    published = json.loads(latest)
    assert published[PROMPT_RESOURCE]["template"] == best.template
    assert published["main_llm"]["model"] == "agent-model"

    assert {name: pid for name, pid in result.pids.items() if role_alive(pid)} == {}
