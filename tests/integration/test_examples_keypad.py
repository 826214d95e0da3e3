"""The keypad example end to end with trajectory aggregation: ``Trainer(VERL).fit(keypad_agent, ...)``
on CPU (the tiny policy served by the inference server, the LLM proxy, the triplet builder with
``agentlightning.trace_aggregator.level = trajectory``, the batcher, the torch trainer).

Each rollout makes three model calls, each prompt the previous one + its response + the keypad's
feedback, so the triplet builder makes one sample of them, masked 0 on the inserted feedback. The
one break the tiny policy can cause: a response holding the ``<|im_start|>`` token, which the
reply's text (and so the next prompt) leaves out: a drift, and a new sample after it. The test
checks that every record is exactly that: three calls in all, one sample unless a response
before the last broke it there, and the keypad's feedback inserted between the calls.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from uuid import uuid4

import pytest
from rich.console import Console

import agl_stream as agl
from agl_stream.config import Settings
from agl_stream.models import TripletBatch, TripletRecord
from agl_stream.policy.model import IM_START_TOKEN, build_tokenizer
from agl_stream.wire.codec import Codec
from examples.keypad import keypad_agent as example
from tests.integration.helpers import read_to_end

pytestmark = pytest.mark.integration

CONFIG = {
    "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
    "data": {"train_batch_size": 2, "max_prompt_length": 512, "max_response_length": 512},
    "actor_rollout_ref": {
        "rollout": {"n": 4},
        "actor": {"optim": {"lr": 5e-2}, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "use_kl_loss": False},
    },
    "trainer": {"total_epochs": 1, "test_freq": 0, "val_before_train": False},
    "agentlightning": {"trace_aggregator": {"level": "trajectory"}},
}
TRAIN = example.load_tasks(example.TRAIN_FILE)[:2]  # one round: 2 tasks x 4 samples = one batch
VAL = example.load_tasks(example.VAL_FILE)[:1]


async def _topic(settings: Settings, name: str, model: type[TripletRecord] | type[TripletBatch]) -> list[object]:
    codec = Codec.default()
    return [codec.decode(r.value, model) for r in await read_to_end(settings, settings.topic(name), timeout=60)]


def test_keypad_trains_on_one_masked_sample_per_rollout(kafka_bootstrap: str, tmp_path: Path) -> None:
    settings = Settings(
        kafka_bootstrap=kafka_bootstrap, data_dir=tmp_path, topic_prefix=f"k{uuid4().hex[:10]}", gateway_port=0
    )
    algorithm = agl.VERL(CONFIG, linger_s=2.0)
    trainer = agl.Trainer(
        algorithm=algorithm, n_runners=1, runner_concurrency=8, settings=settings, console=Console(quiet=True)
    )
    result = trainer.fit(example.keypad_agent, TRAIN, VAL)

    assert result.policy_version is not None and result.policy_version >= 1
    assert result.modes["train"].rollouts == 8 and result.modes["train"].succeeded == 8
    records = [r for r in asyncio.run(_topic(settings, "triplets", TripletRecord)) if isinstance(r, TripletRecord)]
    train = [r for r in records if r.rollout_id in set(result.rollout_ids) and r.triplets]
    assert len(train) >= 8
    tokenizer = build_tokenizer()
    im_start = tokenizer.convert_tokens_to_ids(IM_START_TOKEN)
    for record in train:
        samples = record.triplets
        assert sum(s.calls for s in samples) == example.TURNS, record
        for index, sample in enumerate(samples):
            assert sample.response_mask is not None and len(sample.response_mask) == len(sample.response_token_ids)
            generated = [t for t, m in zip(sample.response_token_ids, sample.response_mask, strict=True) if m]
            inserted = [t for t, m in zip(sample.response_token_ids, sample.response_mask, strict=True) if not m]
            if index < len(samples) - 1:  # a break: only a response holding <|im_start|> makes one
                assert im_start in generated, (record.rollout_id, index)
            if sample.calls > 1:  # the keypad's feedback sits between the merged calls, masked 0
                assert (
                    tokenizer.decode(inserted, skip_special_tokens=True).count("digits ok. next:") == sample.calls - 1
                )
            else:
                assert not inserted
        # The reward is the episode's, computed from what the agent typed: within [0, 1].
        assert record.final_reward is not None and 0.0 <= record.final_reward <= 1.0
    batched = {
        rollout_id
        for batch in asyncio.run(_topic(settings, "triplet-batches", TripletBatch))
        if isinstance(batch, TripletBatch)
        for rollout_id in (r.rollout_id for r in batch.records)
    }
    assert {r.rollout_id for r in train} <= batched
