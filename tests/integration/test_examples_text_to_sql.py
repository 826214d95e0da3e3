"""The text-to-SQL example end to end: ``Trainer(Baseline).fit(sql_agent, ...)`` on the session's
broker with two runner processes, the model scripted (a deterministic OpenAI-compatible server
answers each question right, wrong, broken-then-fixed or broken), the queries run on the
example's SQLite database in the runners. Checked: the rewards per mode (execution match) from
the run's result and, independently, from ClickHouse; each query execution a span in
``otel_traces`` with the query and its error; the check-and-rewrite turn taken exactly where a
query failed; a model's bad SQL costs reward, never the rollout."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
from rich.console import Console

import agl_stream as agl
from agl_stream.config import Settings
from examples.text_to_sql import sql_agent as example
from tests.integration.helpers import REWARD_BY_MODE, clickhouse
from tests.scripted_openai import scripted_openai

pytestmark = pytest.mark.integration

_TRAIN, _VAL = example.load_tasks(example.TRAIN_FILE), example.load_tasks(example.VAL_FILE)
# What the scripted model does per task: "right" (the gold query), "fixed" (a syntax error, then
# the gold query after the agent shows it the error), "wrong" (a valid query with another
# answer), "broken" (no query, then a query on a table that does not exist).
TRAIN = [(_TRAIN[0], "right"), (_TRAIN[1], "fixed"), (_TRAIN[2], "wrong"), (_TRAIN[3], "broken")]
VAL = [(_VAL[0], "right"), (_VAL[1], "fixed"), (_VAL[2], "wrong")]
BEHAVIOUR = {task["question"]: (task, kind) for task, kind in TRAIN + VAL}
CALLS = {"right": 1, "fixed": 2, "wrong": 1, "broken": 2}  # model calls per rollout
REWARD = {"right": 1.0, "fixed": 1.0, "wrong": 0.0, "broken": 0.0}

EXECUTIONS = """
SELECT RolloutId, SpanAttributes['sql.attempt'], SpanAttributes['sql.query'], SpanAttributes['sql.error']
FROM {db}.otel_traces FINAL WHERE SpanName = 'sql.execute'
ORDER BY RolloutId, SpanAttributes['sql.attempt']
"""


def scripted_model(body: dict[str, Any]) -> str:
    messages = body["messages"]
    task, kind = BEHAVIOUR[messages[1]["content"]]
    turn = sum(1 for m in messages if m["role"] == "assistant")  # 0: the first answer, 1: the rewrite
    gold = f"```sql\n{task['gold_sql']}\n```"
    if kind == "right" or (kind == "fixed" and turn == 1):
        return f"Here it is:\n{gold}"
    if kind == "fixed":
        return "```sql\nSELEC title FROM books\n```"
    if kind == "wrong":
        return "```sql\nSELECT name FROM members WHERE city = 'Oslo'\n```"
    return "I cannot tell." if turn == 0 else "```sql\nSELECT * FROM shelves;\n```"


def test_text_to_sql_example_runs_end_to_end(kafka_bootstrap: str, tmp_path: Path) -> None:
    settings = Settings(
        kafka_bootstrap=kafka_bootstrap, data_dir=tmp_path, topic_prefix=f"s{uuid4().hex[:10]}", gateway_port=0
    )
    with scripted_openai(scripted_model) as model:
        llm = agl.LLM(endpoint=model.base_url, model="scripted", sampling_parameters={"temperature": 0.0})
        trainer = agl.Trainer(
            algorithm=agl.Baseline(),
            n_runners=2,
            initial_resources={"main_llm": llm},
            settings=settings,
            console=Console(quiet=True),
        )
        result = trainer.fit(example.sql_agent, [t for t, _ in TRAIN], [t for t, _ in VAL])
        requests = list(model.requests)

    # Execution match: train right + fixed of 4, val right + fixed of 3; no rollout failed.
    assert {mode: (r.rollouts, r.succeeded, r.failed) for mode, r in result.modes.items()} == {
        "train": (4, 4, 0),
        "val": (3, 3, 0),
    }
    assert result.mean_reward("train") == pytest.approx(0.5)
    assert result.mean_reward("val") == pytest.approx(2 / 3)
    # The agent rewrote exactly the failed queries: one call per task, two where the first failed.
    questions = Counter(r["messages"][1]["content"] for r in requests)
    assert questions == {task["question"]: CALLS[kind] for task, kind in TRAIN + VAL}
    system = requests[0]["messages"][0]["content"]
    assert "CREATE TABLE books" in system and "INSERT" not in system  # the schema, not the data

    db = settings.clickhouse_database
    with clickhouse(settings) as client:
        by_mode = client.query(REWARD_BY_MODE.format(db=db)).result_rows
        inputs = {
            rollout_id: question
            for rollout_id, question in client.query(
                f"SELECT rollout_id, JSONExtractString(input, 'question') FROM {db}.rollouts FINAL "
                "WHERE rollout_id IN {ids:Array(String)}",
                parameters={"ids": result.rollout_ids},
            ).result_rows
        }
        executions = client.query(EXECUTIONS.format(db=db)).result_rows
    # The same rewards per mode from the reward spans in ClickHouse.
    assert [(mode, count) for mode, count, _ in by_mode] == [("train", 4), ("val", 3)]
    assert {mode: mean for mode, _, mean in by_mode} == pytest.approx(
        {mode: result.mean_reward(mode) for mode in ("train", "val")}
    )
    # One sql.execute span per model call, with the query the runner ran and its error.
    assert set(inputs) == set(result.rollout_ids)
    spans: dict[str, list[tuple[str, str, str]]] = {}
    for rollout_id, attempt, query, error in executions:
        spans.setdefault(rollout_id, []).append((attempt, query, error))
    assert set(spans) == set(result.rollout_ids)
    for rollout_id, question in inputs.items():
        task, kind = BEHAVIOUR[question]
        ran = spans[rollout_id]
        assert [attempt for attempt, _, _ in ran] == [str(n) for n in range(1, CALLS[kind] + 1)]
        errors = [error for _, _, error in ran]
        if kind == "right":
            assert ran == [("1", task["gold_sql"], "")]
        elif kind == "fixed":
            assert "syntax error" in errors[0] and ran[1] == ("2", task["gold_sql"], "")
        elif kind == "wrong":
            assert errors == [""]
        else:
            assert errors == ["no query in the reply", "no such table: shelves"]
