"""``Trainer(algorithm=VERL(config)).fit`` on CPU: the streaming path (triplet builder, batcher,
trainer with the tiny policy, inference server, LLM proxy) started from a seed-style config,
at least one policy update, validation before training and after the last step with its mean
reward from SQL, and no validation rollout in any training batch."""

from __future__ import annotations

import asyncio
from pathlib import Path
from uuid import uuid4

import pytest
from rich.console import Console

import agl_stream as agl
from agl_stream.config import Settings
from agl_stream.demo.task import PROMPTS, digits
from agl_stream.models import TripletBatch, TripletRecord
from agl_stream.wire.codec import Codec
from tests.integration.helpers import clickhouse, read_to_end

pytestmark = pytest.mark.integration

CONFIG = {
    "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
    "data": {"train_batch_size": 2, "max_response_length": 8},
    "actor_rollout_ref": {
        "rollout": {"n": 2},
        "actor": {"optim": {"lr": 1e-2}, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "use_kl_loss": False},
    },
    "trainer": {"total_epochs": 1, "test_freq": 1, "val_before_train": True},
}
TRAIN = [{"prompt": p} for p in PROMPTS[:2]]  # one round: 2 tasks x 2 samples = one batch
VAL = [{"prompt": p} for p in PROMPTS[2:]]


async def _topic(settings: Settings, name: str, model: type[TripletRecord] | type[TripletBatch]) -> list[object]:
    codec = Codec.default()
    return [codec.decode(r.value, model) for r in await read_to_end(settings, settings.topic(name), timeout=60)]


def test_verl_fit_trains_validates_and_never_trains_on_validation(kafka_bootstrap: str, tmp_path: Path) -> None:
    settings = Settings(
        kafka_bootstrap=kafka_bootstrap, data_dir=tmp_path, topic_prefix=f"v{uuid4().hex[:10]}", gateway_port=0
    )
    algorithm = agl.VERL(CONFIG, linger_s=2.0)
    trainer = agl.Trainer(
        algorithm=algorithm, n_runners=1, runner_concurrency=4, settings=settings, console=Console(quiet=True)
    )
    result = trainer.fit(digits, TRAIN, VAL)

    # At least one policy update, on the batch of the one round.
    assert result.policy_version is not None and result.policy_version >= 1
    assert algorithm.policy_version == result.policy_version
    assert result.modes["train"].rollouts == 4 and result.modes["train"].succeeded == 4
    # Validation before training (version 0) and on the final policy, every task once each time.
    validations = algorithm.validations
    assert len(validations) >= 2 and validations[0].policy_version == 0 and validations[-1].policy_version >= 1
    assert all(v.rollouts == len(VAL) and v.succeeded == len(VAL) for v in validations)
    assert all(v.mean_reward is not None and 0.0 <= v.mean_reward <= 1.0 for v in validations)
    assert validations[0].min_version == 0
    assert result.modes["val"].rollouts == len(VAL) * len(validations)
    assert set(algorithm.report) == {"train", "val"}

    # The records on agl.triplets carry their rollout's mode; no batch holds a val rollout.
    records = [r for r in asyncio.run(_topic(settings, "triplets", TripletRecord)) if isinstance(r, TripletRecord)]
    batches = [b for b in asyncio.run(_topic(settings, "triplet-batches", TripletBatch)) if isinstance(b, TripletBatch)]
    db = settings.clickhouse_database
    with clickhouse(settings) as client:
        mode_rows = client.query(
            f"SELECT rollout_id, mode FROM {db}.rollouts FINAL WHERE rollout_id IN {{ids:Array(String)}}",
            parameters={"ids": result.rollout_ids},
        ).result_rows
        modes = {rollout_id: mode for rollout_id, mode in mode_rows}
        val_rows = client.query(
            f"SELECT policy_version, attempts, mean_reward FROM {db}.reward_by_mode_and_version WHERE mode = 'val'"
        ).result_rows
        steps = client.query(f"SELECT count() FROM {db}.trainer_steps FINAL").result_rows[0][0]
    assert {r.rollout_id for r in records} <= set(modes)
    assert all(r.mode == modes[r.rollout_id] for r in records)
    val_ids = {rid for rid, mode in modes.items() if mode == "val"}
    # The first validation starts at version 0 beside the first training round, so on a busy
    # machine a task of it may run on version 1 (its Validation says "ran on v0..v1").
    first_validation = [r for r in records if r.mode == "val" and "-val1-" in r.group_id]
    assert len(first_validation) >= len(VAL)  # built, and refused by the batcher: not in any batch
    assert 0 in {r.policy_version for r in first_validation}
    assert batches and all(r.mode == "train" for b in batches for r in b.records)
    assert not {r.rollout_id for b in batches for r in b.records} & val_ids
    assert sum(b.dropped_eval for b in batches) <= len(val_ids)
    # Validation's mean reward per policy version is in ClickHouse; every step was recorded.
    assert val_rows and sum(int(n) for _, n, _ in val_rows) >= len(VAL)
    assert steps >= 1
