"""Off-policy correction (agl_stream.training.off_policy): importance weights, their metrics, staleness."""

from __future__ import annotations

import math

import pytest
import torch
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

from agl_stream.training.off_policy import check_correction, importance_correction, staleness_histogram

# Two samples: ratios exp(0.5), exp(-0.3) | exp(1.0), exp(0.1), a padding token (mask 0).
OLD = torch.tensor([[-1.0, -2.3, 0.0], [-0.5, -1.9, 0.0]])
ROLLOUT = torch.tensor([[-1.5, -2.0, 0.0], [-1.5, -2.0, -9.0]])
MASK = torch.tensor([[1, 1, 0], [1, 1, 0]])


def test_truncate_is_verls_token_tis() -> None:
    got = importance_correction(OLD, ROLLOUT, MASK, correction="truncate", threshold=2.0)
    expected, _ = compute_rollout_correction_weights(
        (OLD - ROLLOUT) * MASK, MASK.float(), rollout_is="token", rollout_is_threshold=2.0
    )
    assert got.weights is not None and torch.allclose(got.weights, expected)
    ratios = [math.exp(0.5), math.exp(-0.3), math.exp(1.0), math.exp(0.1)]
    assert got.metrics["is_ratio_mean"] == pytest.approx(sum(ratios) / 4, rel=1e-5)
    assert got.metrics["is_ratio_max"] == pytest.approx(math.e, rel=1e-5)
    assert got.metrics["is_ratio_min"] == pytest.approx(math.exp(-0.3), rel=1e-5)
    assert got.metrics["is_truncated_share"] == 0.25
    assert got.metrics["is_weight_mean"] == pytest.approx((sum(ratios) - math.e + 2.0) / 4, rel=1e-5)
    assert float(got.weights[1, 2]) == 0.0  # off the mask


def test_mask_zeroes_the_weights_above_the_cap_and_keeps_the_others() -> None:
    got = importance_correction(OLD, ROLLOUT, MASK, correction="mask", threshold=2.0)
    assert got.weights is not None
    assert float(got.weights[1, 0]) == 0.0
    assert float(got.weights[0, 0]) == pytest.approx(math.exp(0.5), rel=1e-6)
    assert got.metrics["is_masked_share"] == 0.25 and "is_truncated_share" not in got.metrics


def test_sequence_level_weighs_and_masks_whole_samples() -> None:
    got = importance_correction(OLD, ROLLOUT, MASK, correction="mask", level="sequence", threshold=2.0)
    assert got.weights is not None
    # Sample 0: exp(0.5 - 0.3) = 1.22 kept on both tokens; sample 1: exp(1.1) = 3.0 > 2, masked whole.
    assert torch.allclose(got.weights[0, :2], torch.full((2,), math.exp(0.2)))
    assert torch.equal(got.weights[1], torch.zeros(3))
    assert got.metrics["is_masked_share"] == 0.5


def test_none_reports_the_ratios_without_weights_and_nothing_in_the_loss_is_ratio_one() -> None:
    got = importance_correction(OLD, ROLLOUT, MASK, correction="none")
    assert got.weights is None and got.metrics["is_ratio_max"] == pytest.approx(math.e, rel=1e-5)
    empty = importance_correction(OLD, ROLLOUT, torch.zeros_like(MASK))
    assert empty.metrics["is_ratio_mean"] == 1.0 and empty.metrics["is_truncated_share"] == 0.0


def test_bad_settings_and_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="off_policy_correction"):
        check_correction("clip", "token", 2.0)
    with pytest.raises(ValueError, match="rollout_is must"):
        check_correction("truncate", "turn", 2.0)
    for cap in (0.0, -1.0, math.inf, True):
        with pytest.raises(ValueError, match="rollout_is_threshold"):
            check_correction("truncate", "token", cap)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one shape"):
        importance_correction(OLD, ROLLOUT[:, :2], MASK)


def test_staleness_histogram_counts_rows_per_version_behind() -> None:
    assert staleness_histogram([5, 5, 4, 2, None], 5) == {
        "staleness_0": 2.0,
        "staleness_1": 1.0,
        "staleness_3": 1.0,
        "staleness_max": 3.0,
        "staleness_mean": 1.0,
        "staleness_unknown": 1.0,
    }
    assert staleness_histogram([6], 5) == {"staleness_max": -1.0, "staleness_mean": -1.0, "staleness_ahead": 1.0}
    assert staleness_histogram([], 0) == {}
