"""`agl-stream export` against the real stack: rollouts whose agent made tool-using LLM calls are
exported as TRL SFT and DPO data, loaded with `datasets`, and TRL's SFTTrainer takes a step on it.

Real parts: the broker, rollout processor, gateway (chDB) and a runner running
tests.integration.export_agents:calculator; the export runs as the CLI, in its own process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from uuid import uuid4

import pytest

from agl_stream import connect
from agl_stream.config import Settings
from agl_stream.local import stack
from agl_stream.local.processes import role_environment
from tests.export_spans import SYSTEM, TOOLS
from tests.integration.helpers import start_role, stop_role

pytestmark = pytest.mark.integration

TASKS = [  # two tasks (group ids), each with a right and a wrong rollout
    ("g-sum", {"question": "two plus three", "expression": "2+3", "result": "5", "final": "five", "reward": 1.0}),
    ("g-sum", {"question": "two plus three", "expression": "2+3", "result": "5", "final": "six", "reward": 0.0}),
    ("g-mul", {"question": "two and two", "expression": "2*2", "result": "4", "final": "four", "reward": 1.0}),
    ("g-mul", {"question": "two and two", "expression": "2*2", "result": "4", "final": "one", "reward": 0.25}),
]


@pytest.fixture
def own_stack(kafka_bootstrap: str, tmp_path: Path) -> Iterator[Settings]:
    settings = Settings(
        kafka_bootstrap=kafka_bootstrap, data_dir=tmp_path, topic_prefix=f"x{uuid4().hex[:10]}", gateway_port=0
    )
    stack.up(settings)
    try:
        yield stack.local_stack_settings(settings)
    finally:
        stack.down(settings)


def _export(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agl_stream", "export", *args],
        env=role_environment(settings),
        capture_output=True,
        text=True,
        timeout=300,
    )


async def test_rollouts_export_as_trl_data_and_train_a_step(own_stack: Settings, tmp_path: Path) -> None:
    import datasets  # type: ignore[import-untyped]
    from trl import SFTConfig, SFTTrainer

    from tests.hf_model import build_hf_model_folder

    runner = start_role(own_stack, "runner", "--agent", "tests.integration.export_agents:calculator", log_name="runner")
    try:
        async with connect(**own_stack.model_dump(exclude_none=True)) as store:
            made = await store.enqueue_many_rollouts(
                [{"input": task, "mode": "train", "metadata": {"group_id": group}} for group, task in TASKS]
            )
            finished = await store.wait_for_rollouts(rollout_ids=[r.rollout_id for r in made], timeout=180)
            assert [r.status for r in finished] == ["succeeded"] * len(TASKS)
    finally:
        assert stop_role(runner, timeout=60) == 0
    ids = [r.rollout_id for r in made]

    # SFT, the rewarded ones only, as a datasets folder.
    sft_dir = tmp_path / "sft"
    done = _export(own_stack, str(sft_dir), "--where", "mode = 'train'", "--min-reward", "0.5")
    assert done.returncode == 0, done.stderr
    assert "wrote          2 sft rows" in done.stdout
    sft = datasets.load_from_disk(str(sft_dir))
    assert sorted(sft["rollout_id"]) == sorted([ids[0], ids[2]])
    assert sft["reward"] == [1.0, 1.0] and sft["policy_version"] == [None, None]
    for row in sft:
        task = TASKS[ids.index(row["rollout_id"])][1]
        messages = row["messages"]
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
        assert (messages[0]["content"], messages[1]["content"]) == (SYSTEM, task["question"])
        [call] = messages[2]["tool_calls"]
        assert json.loads(call["function"]["arguments"]) == {"expression": task["expression"]}
        assert (messages[3]["content"], messages[4]["content"]) == (task["result"], task["final"])
        assert json.loads(row["tools"]) == TOOLS

    # DPO pairs as Parquet: per task the right answer against the wrong one.
    dpo_file = tmp_path / "dpo.parquet"
    done = _export(own_stack, str(dpo_file), "--kind", "dpo", "--format", "parquet")
    assert done.returncode == 0, done.stderr
    dpo = datasets.load_dataset("parquet", data_files=str(dpo_file), split="train")
    pairs = {row["group_id"]: row for row in dpo}
    assert set(pairs) == {"g-sum", "g-mul"}
    assert (pairs["g-sum"]["chosen_rollout_id"], pairs["g-sum"]["rejected_rollout_id"]) == (ids[0], ids[1])
    assert (pairs["g-mul"]["chosen_reward"], pairs["g-mul"]["rejected_reward"]) == (1.0, 0.25)
    assert pairs["g-mul"]["chosen"][-1]["content"] == "four" and pairs["g-mul"]["rejected"][-1]["content"] == "one"
    assert [m["role"] for m in pairs["g-sum"]["prompt"]] == ["system", "user"]

    # Chat JSON lines, and the errors a user meets.
    jsonl = tmp_path / "chats.jsonl"
    done = _export(own_stack, str(jsonl), "--format", "jsonl", "--where", f"rollout_id = '{ids[3]}'")
    assert done.returncode == 0, done.stderr
    [line] = [json.loads(text) for text in jsonl.read_text().splitlines()]
    assert (line["rollout_id"], line["reward"]) == (ids[3], 0.25)
    nothing = _export(own_stack, str(tmp_path / "none.jsonl"), "--format", "jsonl", "--policy-version", "7")
    assert nothing.returncode == 1 and "no finished rollout matches --policy-version 7" in nothing.stderr
    exists = _export(own_stack, str(jsonl), "--format", "jsonl")
    assert exists.returncode == 2 and "--overwrite" in exists.stderr
    writes = _export(
        own_stack, str(tmp_path / "w.jsonl"), "--where", "1 = 1) UNION ALL SELECT name FROM system.tables --"
    )
    assert writes.returncode == 1 and "choosing rollouts failed" in writes.stderr

    # A replay re-scores history with another reward: --replay exports its rewards, so the pairs flip.
    from agl_stream.domain.replay import ReplaySettings
    from producers.replay import replay

    await replay(
        own_stack,
        "inverted",
        replay_settings=ReplaySettings(reward="tests.integration.export_agents:inverted_reward"),
        workers=1,
    )
    flipped_file = tmp_path / "flipped.jsonl"
    done = _export(own_stack, str(flipped_file), "--kind", "dpo", "--format", "jsonl", "--replay", "inverted")
    assert done.returncode == 0, done.stderr
    flipped = {row["group_id"]: row for row in map(json.loads, flipped_file.read_text().splitlines())}
    assert (flipped["g-sum"]["chosen_rollout_id"], flipped["g-sum"]["rejected_rollout_id"]) == (ids[1], ids[0])
    assert (flipped["g-mul"]["chosen_reward"], flipped["g-mul"]["rejected_reward"]) == (0.75, 0.0)
    missing = _export(own_stack, str(tmp_path / "m.jsonl"), "--format", "jsonl", "--replay", "nosuch")
    assert missing.returncode == 1 and "run `agl-stream replay nosuch` first" in missing.stderr

    # One TRL SFT step on the exported folder, on CPU with the tiny model.
    model_dir = build_hf_model_folder(tmp_path / "model")
    config = SFTConfig(
        output_dir=str(tmp_path / "trl"),
        max_steps=1,
        per_device_train_batch_size=2,
        max_length=64,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
    )
    trainer = SFTTrainer(model=str(model_dir), args=config, train_dataset=sft)
    result = trainer.train()
    assert result.global_step == 1
    assert trainer.state.log_history[0]["loss"] > 0
