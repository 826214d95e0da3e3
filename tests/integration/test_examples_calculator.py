"""The calculator example end to end, trained one step: ``Trainer(VERL).fit(calculator_agent, ...)``
on the session's broker with two runner processes.

The tiny CPU policy cannot call tools, so a scripted OpenAI-compatible server plays the model:
it asks the calculator for the task's expression, then answers with the tool's value (or that
value plus one: a wrong answer). It returns vLLM-style token ids valid for the tiny policy's
vocabulary, and the run's LLM proxy forwards to it instead of the inference server, so the real
streaming path runs: every model call is a proxy span (with the tools offered and the tool call
made), the agent's calculator evaluations are spans, the triplet builder turns each rollout's
two calls into two triplets, the batcher forms the GRPO batch, and the torch trainer takes one
step on it and publishes policy version 1. Validation runs before training and on the final
policy; its mean reward is known (one of the two validation tasks is answered right).
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
from rich.console import Console

import agl_stream as agl
from agl_stream.algorithm.base import RoleSpec
from agl_stream.config import Settings
from examples.calculator import calc_agent as example
from tests.integration.helpers import clickhouse
from tests.scripted_openai import scripted_openai, tool_call

pytestmark = pytest.mark.integration

CONFIG = {
    "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
    "data": {"train_batch_size": 2, "max_prompt_length": 256, "max_response_length": 64},
    "actor_rollout_ref": {
        "rollout": {"n": 2},
        "actor": {"optim": {"lr": 1e-2}, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "use_kl_loss": False},
    },
    "trainer": {"total_epochs": 1, "test_freq": 1, "val_before_train": True},
}
_TRAIN, _VAL = example.load_tasks(example.TRAIN_FILE), example.load_tasks(example.VAL_FILE)
TRAIN = _TRAIN[:2]  # one round: 2 tasks x 2 samples = one batch, one policy update
VAL = _VAL[:2]
VAL_RIGHT = {VAL[0]["question"]}  # validation: the first task right, the second wrong (mean 0.5)
TASKS = {task["question"]: task for task in TRAIN + VAL}


class Script:
    """The scripted model. Training tasks are answered right on every other first call, so each
    GRPO group (one task, two samples) holds one right and one wrong answer: advantages that
    are not all zero, and a train mean reward of exactly 0.5 whoever runs which sample."""

    def __init__(self) -> None:
        self.starts: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.answers: list[tuple[str, str]] = []  # (question, final answer)

    def reply(self, body: dict[str, Any]) -> str | dict[str, Any]:
        messages = body["messages"]
        question = messages[1]["content"]
        task = TASKS[question]
        tools = [m for m in messages if m["role"] == "tool"]
        if not tools:
            with self.lock:
                sample = self.starts[question]
                self.starts[question] += 1
            arguments = json.dumps({"expression": task["expression"]})
            return {"content": None, "tool_calls": [tool_call(f"call-{sample}", "calculator", arguments)]}
        sample = int(tools[-1]["tool_call_id"].split("-")[1])
        value = tools[-1]["content"]
        right = question in VAL_RIGHT if question not in {t["question"] for t in TRAIN} else sample % 2 == 0
        answer = value if right else example.format_number(float(value) + 1)
        with self.lock:
            self.answers.append((question, answer))
        return f"The calculator says {value}.\nANSWER: {answer}"


def _ids(text: str) -> list[int]:
    # Ids 4..63: the tiny policy's 64-token vocabulary without its 4 special tokens.
    return [4 + ord(char) % 60 for char in text]


def token_ids(body: dict[str, Any], message: dict[str, Any]) -> tuple[list[int], list[int]]:
    """The prompt's last 120 characters and the answer (content or tool call) as ids, then <eos>."""
    prompt = "\n".join(str(m.get("content") or "") for m in body["messages"])[-120:]
    calls = message.get("tool_calls") or []
    answer = str(message.get("content") or "") or "".join(c["function"]["arguments"] for c in calls)
    return _ids(prompt), [*_ids(answer[:60]), 1]


class ScriptedVERL(agl.VERL):
    """VERL whose LLM proxy forwards to the scripted model: no inference server is started (the
    tiny policy it would serve cannot call tools); everything else is VERL's own."""

    def __init__(self, config: dict[str, Any], backend_url: str, **options: Any) -> None:
        super().__init__(config, **options)
        self.backend_url = backend_url

    def roles(self, settings: Settings) -> Sequence[RoleSpec]:
        specs = []
        for spec in super().roles(settings):
            if spec.name == "inference":
                continue
            if spec.name == "llm-proxy":
                args = list(spec.args)
                backend = args.index("--backend") + 1
                args[backend] = f"{args[backend].split('=', 1)[0]}={self.backend_url}"
                spec = RoleSpec(spec.name, tuple(args), spec.health_url)
            specs.append(spec)
        return specs


def test_calculator_example_trains_one_step_on_its_tool_call_triplets(kafka_bootstrap: str, tmp_path: Path) -> None:
    settings = Settings(
        kafka_bootstrap=kafka_bootstrap, data_dir=tmp_path, topic_prefix=f"c{uuid4().hex[:10]}", gateway_port=0
    )
    script = Script()
    with scripted_openai(script.reply, token_ids) as model:
        algorithm = ScriptedVERL(CONFIG, model.base_url, linger_s=2.0)
        trainer = agl.Trainer(
            algorithm=algorithm, n_runners=2, runner_concurrency=2, settings=settings, console=Console(quiet=True)
        )
        result = trainer.fit(example.calculator_agent, TRAIN, VAL)
        requests = list(model.requests)

    # One policy update, on the one batch; train mean 0.5 by construction, every rollout succeeded.
    assert result.policy_version is not None and result.policy_version >= 1
    assert result.modes["train"].rollouts == 4 and result.modes["train"].succeeded == 4
    assert result.mean_reward("train") == pytest.approx(0.5)
    # Validation before training and on the final policy: one task of two right each time.
    validations = algorithm.validations
    assert len(validations) >= 2 and validations[0].policy_version == 0 and validations[-1].policy_version >= 1
    assert all(v.rollouts == 2 and v.succeeded == 2 and v.mean_reward == pytest.approx(0.5) for v in validations)
    assert result.mean_reward("val") == pytest.approx(0.5)
    # The agent offered the tool, and sent the calculator's value back as the tool's answer.
    assert all(r["tools"][0]["function"]["name"] == "calculator" for r in requests)
    assert len(requests) == 2 * (4 + 2 * len(validations))  # a tool call and an answer per rollout
    values = {q: example.format_number(example.evaluate(task["expression"])) for q, task in TASKS.items()}
    right = Counter(q for q, answer in script.answers if answer == values[q])
    assert right == {TRAIN[0]["question"]: 1, TRAIN[1]["question"]: 1, VAL[0]["question"]: len(validations)}

    db = settings.clickhouse_database
    ids = {"ids": result.rollout_ids}
    with clickhouse(settings) as client:
        modes: dict[str, str] = {
            rollout_id: mode
            for rollout_id, mode in client.query(
                f"SELECT rollout_id, mode FROM {db}.rollouts FINAL WHERE rollout_id IN {{ids:Array(String)}}",
                parameters=ids,
            ).result_rows
        }
        proxy_spans = client.query(
            f"SELECT RolloutId, SpanAttributes['gen_ai.tool.definitions'], SpanAttributes['gen_ai.output.messages'] "
            f"FROM {db}.otel_traces FINAL WHERE has(mapKeys(SpanAttributes), 'prompt_token_ids') "
            "AND RolloutId IN {ids:Array(String)}",
            parameters=ids,
        ).result_rows
        tool_spans = client.query(
            f"SELECT RolloutId, SpanAttributes['tool.arguments'], SpanAttributes['tool.result'] "
            f"FROM {db}.otel_traces FINAL WHERE SpanName = 'calculator' AND RolloutId IN {{ids:Array(String)}}",
            parameters=ids,
        ).result_rows
        triplets = client.query(
            f"SELECT rollout_id, triplet_index, prompt_token_ids, response_token_ids, final_reward "
            f"FROM {db}.triplets FINAL WHERE rollout_id IN {{ids:Array(String)}} ORDER BY rollout_id, triplet_index",
            parameters=ids,
        ).result_rows
        batched = {
            rollout
            for (rollouts,) in client.query(f"SELECT rollout_ids FROM {db}.batches FINAL").result_rows
            for rollout in rollouts
        }
        steps = client.query(f"SELECT count() FROM {db}.trainer_steps FINAL").result_rows[0][0]
        val_rows = client.query(
            f"SELECT sum(attempts), sum(mean_reward * attempts) / sum(attempts) "
            f"FROM {db}.reward_by_mode_and_version WHERE mode = 'val'"
        ).result_rows
    train_ids = {rid for rid, mode in modes.items() if mode == "train"}
    assert len(train_ids) == 4 and len(modes) == 4 + 2 * len(validations)

    # Every model call is a proxy span with the tools offered; the first of each rollout made the tool call.
    calls = Counter(rid for rid, _, _ in proxy_spans)
    assert calls == {rid: 2 for rid in modes}
    assert all(json.loads(tools)[0]["function"]["name"] == "calculator" for _, tools, _ in proxy_spans)
    made = [json.loads(completion)[0] for _, _, completion in proxy_spans]
    assert sum(1 for message in made if any(p["type"] == "tool_call" for p in message["parts"])) == len(modes)
    # Every evaluation is a span: the task's expression in, its value out.
    assert Counter(rid for rid, _, _ in tool_spans) == {rid: 1 for rid in modes}
    for _, arguments, value in tool_spans:
        expression = json.loads(arguments)["expression"]
        assert value == example.format_number(example.evaluate(expression))

    # Two triplets per training rollout (the tool call, the answer), ids as the model returned them.
    per_rollout = Counter(rid for rid, *_ in triplets if rid in train_ids)
    assert per_rollout == {rid: 2 for rid in train_ids}
    assert all(all(4 <= t < 64 for t in prompt) and response[-1] == 1 for _, _, prompt, response, _ in triplets)
    final = {rid: reward for rid, _, _, _, reward in triplets if rid in train_ids}
    assert sorted(final.values()) == [0.0, 0.0, 1.0, 1.0]  # one right, one wrong sample per group
    # The four training rollouts were trained on (one step at least); no validation rollout was.
    assert train_ids <= batched and not batched - train_ids
    assert steps >= 1
    assert val_rows[0][0] == 2 * len(validations) and val_rows[0][1] == pytest.approx(0.5)
