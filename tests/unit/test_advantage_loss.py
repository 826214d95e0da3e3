"""Advantage and loss at the rollout's level (agl_stream.training.levels) against VERL's own functions."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from verl import DataProto
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo.core_algos import agg_loss, compute_grpo_outcome_advantage, get_adv_estimator_fn

from agl_stream.models.training import Triplet, TripletBatch, TripletRecord
from agl_stream.training import batch_to_dataproto
from agl_stream.training.backend import compute_advantages, prepare_batch
from agl_stream.training.levels import (
    VERL_LOSS_AGG_MODES,
    aggregate_loss,
    check_levels,
    policy_loss_mode,
    rollout_advantages,
    rollout_index,
    rollout_mean_weights,
)

PROMPT = [5, 6, 7]


def _batch(rollouts: list[tuple[str, float, list[list[int]]]]) -> DataProto:
    """One record per (group, final reward, responses of its samples)."""
    records = [
        TripletRecord(
            rollout_id=f"r{i}",
            attempt_id="a",
            group_id=group,
            triplets=[Triplet(prompt_token_ids=PROMPT, response_token_ids=r) for r in responses],
            final_reward=reward,
            policy_version=0,
            finish_time=0.0,
        )
        for i, (group, reward, responses) in enumerate(rollouts)
    ]
    return batch_to_dataproto(TripletBatch(batch_id="b", records=records, created_time=0.0), pad_token_id=0)


def _advantages(data: DataProto, estimator: str = "grpo", level: str = "rollout") -> torch.Tensor:
    return compute_advantages(
        data,
        prepare_batch(data),
        estimator=estimator,
        algo_config=AlgoConfig(adv_estimator=estimator),
        advantage_level=level,
        rollouts=rollout_index(data),
    )


def _per_rollout(data: DataProto, advantages: torch.Tensor) -> list[float]:
    """The one advantage each rollout's loss tokens hold (checked to be one), by rollout."""
    index, mask = rollout_index(data), data.batch["response_mask"].bool()
    out = []
    for r in range(int(index.max()) + 1):
        values = advantages[index == r][mask[index == r]]
        assert torch.all(values == values[0]), "one advantage per rollout"
        out.append(float(values[0]))
    return out


REWARDS = [("g0", 1.0), ("g0", 0.0), ("g0", 0.5), ("g1", 0.25), ("g1", 0.75)]


def test_one_sample_per_rollout_is_verls_grpo_exactly() -> None:
    data = _batch([(g, reward, [[10 + i, 11]]) for i, (g, reward) in enumerate(REWARDS)])
    expected, _ = compute_grpo_outcome_advantage(
        data.batch["token_level_rewards"], data.batch["response_mask"], data.non_tensor_batch["uid"]
    )
    assert torch.equal(_advantages(data), expected)
    assert torch.equal(_advantages(data, level="sample"), expected)
    # The representative-row path itself gives the same numbers (it is not only skipped).
    estimate = _estimate("grpo")
    by_rollout = rollout_advantages(
        data.batch["token_level_rewards"],
        data.batch["response_mask"],
        data.non_tensor_batch["uid"],
        rollout_index(data),
        estimate,
    )
    assert torch.equal(by_rollout, expected)


def _estimate(estimator: str) -> Any:
    def run(rewards: torch.Tensor, mask: torch.Tensor, index: np.ndarray[Any, Any]) -> torch.Tensor:
        kwargs: dict[str, Any] = {"token_level_rewards": rewards, "response_mask": mask, "index": index}
        kwargs["config"] = AlgoConfig(adv_estimator=estimator)
        return get_adv_estimator_fn(estimator)(**kwargs)[0]

    return run


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "opo", "reinforce_plus_plus_baseline", "grpo_passk"])
def test_many_samples_per_rollout_weigh_as_one(estimator: str) -> None:
    """Rollout 0 has five samples in one run and one in the other: the advantages per rollout are the
    same, and equal what one row per rollout gives (with the rollout's loss tokens)."""
    one = _batch([(g, reward, [[10 + i, 11, 12, 13, 14]]) for i, (g, reward) in enumerate(REWARDS)])
    five = _batch(
        [
            (g, reward, [[10 + i], [11], [12], [13], [14]] if i == 0 else [[10 + i, 11, 12, 13, 14]])
            for i, (g, reward) in enumerate(REWARDS)
        ]
    )
    assert len(five) == len(one) + 4
    assert _per_rollout(five, _advantages(five, estimator)) == pytest.approx(
        _per_rollout(one, _advantages(one, estimator)), abs=1e-6
    )
    # Per sample, rollout 0's five rows would be five members of g0, moving its mean and std.
    if estimator == "grpo":
        sample = _advantages(five, level="sample")
        assert float(sample[1, 0]) != pytest.approx(_per_rollout(one, _advantages(one))[1], abs=1e-3)


def test_a_rollouts_score_is_its_last_samples_reward_and_inserted_tokens_get_nothing() -> None:
    data = _batch([("g", 1.0, [[10], [11, 12]]), ("g", 0.0, [[13]])])
    advantages = _advantages(data)
    # GRPO over two rollouts scoring 1 and 0: +-1/sqrt(2) (std of two values with Bessel's correction).
    assert _per_rollout(data, advantages) == pytest.approx([2**-0.5, -(2**-0.5)], rel=1e-5)
    assert float(advantages[0, 1]) == 0.0  # padding of the first sample's one-token response


def test_unknown_levels_and_modes_are_refused() -> None:
    with pytest.raises(ValueError, match="advantage_level"):
        check_levels("task", "token-mean", "grpo", 1.0)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        check_levels("rollout", "episode-mean", "grpo", 1.0)
    with pytest.raises(ValueError, match="gamma"):
        check_levels("rollout", "token-mean", "reinforce_plus_plus", 0.9)
    check_levels("sample", "rollout-mean", "reinforce_plus_plus", 0.9)


# -- loss aggregation -----------------------------------------------------------------------------


def _loss_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    loss = torch.randn((4, 6), generator=generator)
    mask = torch.tensor(
        [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.long
    )
    return loss, mask


@pytest.mark.parametrize("mode", VERL_LOSS_AGG_MODES)
@pytest.mark.parametrize(
    "info", [{}, {"dp_size": 1, "batch_num_tokens": 11, "global_batch_size": 3, "loss_scale_factor": 6}]
)
def test_verls_modes_are_verls_agg_loss(mode: str, info: dict[str, Any]) -> None:
    loss, mask = _loss_inputs()
    assert torch.equal(aggregate_loss(loss, mask, mode, **info), agg_loss(loss, mask, mode, **info))


def test_rollout_mean_is_the_mean_over_rollouts_of_their_token_means() -> None:
    loss, mask = _loss_inputs()
    rollouts = torch.tensor([0, 0, 1, 2])  # rollout 0 has two samples, rollout 2 no loss token
    weights = rollout_mean_weights(mask, rollouts)
    got = aggregate_loss(loss, mask, "rollout-mean", rollout_weights=weights)
    r0 = (loss[0, :3].sum() + loss[1].sum()) / 9
    r1 = loss[2, 1:3].sum() / 2
    assert float(got) == pytest.approx(float((r0 + r1) / 2), rel=1e-6)
    assert float(weights.sum()) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="rollout weights"):
        aggregate_loss(loss, mask, "rollout-mean")


def test_duplicating_a_rollouts_samples_does_not_change_its_weight() -> None:
    loss, mask = _loss_inputs()
    rollouts = torch.tensor([0, 0, 1, 2])
    base = aggregate_loss(loss, mask, "rollout-mean", rollout_weights=rollout_mean_weights(mask, rollouts))
    # Rollout 1's sample three times over: still one rollout, same token mean.
    loss3, mask3 = torch.cat([loss, loss[2:3], loss[2:3]]), torch.cat([mask, mask[2:3], mask[2:3]])
    rollouts3 = torch.tensor([0, 0, 1, 2, 1, 1])
    tripled = aggregate_loss(loss3, mask3, "rollout-mean", rollout_weights=rollout_mean_weights(mask3, rollouts3))
    assert float(tripled) == pytest.approx(float(base), rel=1e-6)
    # token-mean is moved by the copies: that is what rollout-mean is for.
    assert float(agg_loss(loss3, mask3, "token-mean")) != pytest.approx(float(agg_loss(loss, mask, "token-mean")))


def test_rollout_mean_reaches_verls_policy_loss_as_weighted_token_sum() -> None:
    loss, mask = _loss_inputs()
    weights = rollout_mean_weights(mask, torch.tensor([0, 0, 1, 2]))
    is_weights = torch.full_like(weights, 0.5)
    assert policy_loss_mode("token-mean", is_weights, None) == ("token-mean", is_weights)
    mode, combined = policy_loss_mode("rollout-mean", is_weights, weights)
    assert mode == "token-sum" and combined is not None and torch.equal(combined, is_weights * weights)
    assert torch.equal(
        agg_loss(loss * combined, mask, mode),
        aggregate_loss(loss * is_weights, mask, "rollout-mean", rollout_weights=weights),
    )
