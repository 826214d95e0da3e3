"""Off-policy correction: importance weights between the trainer's old policy and the serving engine's.

A sample is served by policy version v (its tokens' logprobs, ``rollout_log_probs``, are the
engine's) and trained when the trainer holds version v + k. PPO's ratio is taken against the
trainer's own *old* log-probs (recomputed on the weights held before the step); the gap between
those and the engine's (staleness, and the engine's numerics) is corrected per token by the
importance weight ``exp(old_log_prob - rollout_log_prob)``, passed to VERL's policy loss as its
``rollout_is_weights`` (VERL's decoupled mode, as ``rollout_corr_helper`` computes it):

- ``"truncate"`` (default): truncated IS (TIS), weights capped at ``rollout_is_threshold``
  (VERL's ``compute_rollout_correction_weights`` with a float threshold);
- ``"mask"``: masked IS, weights above the cap set to 0 (the token, or with ``rollout_is=
  "sequence"`` the whole sample, adds nothing to the loss), the others kept as they are;
- ``"none"``: no weights (the ratios are still reported).

``rollout_is``: "token" (default: one ratio per token) or "sequence" (the product over the
sample's loss tokens, VERL's sequence level). Pure functions; the backends call them.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

from agl_stream.rl_options import IMPORTANCE_LEVELS, OFF_POLICY_CORRECTIONS, ImportanceLevel, OffPolicyCorrection


def check_correction(correction: str, level: str, threshold: float) -> None:
    """ValueError for an unknown correction or level, or a cap that is not a finite number > 0."""
    if correction not in OFF_POLICY_CORRECTIONS:
        raise ValueError(f"off_policy_correction must be one of {list(OFF_POLICY_CORRECTIONS)}, not {correction!r}")
    if level not in IMPORTANCE_LEVELS:
        raise ValueError(f"rollout_is must be one of {list(IMPORTANCE_LEVELS)}, not {level!r}")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold):
        raise ValueError(f"rollout_is_threshold must be a finite number, not {threshold!r}")
    if threshold <= 0:
        raise ValueError(f"rollout_is_threshold must be > 0, not {threshold}")


@dataclass(frozen=True)
class ImportanceCorrection:
    """What :func:`importance_correction` gives: ``weights`` (B, R) for VERL's ``rollout_is_weights``
    (None for ``"none"``; 0 off the loss mask) and the metrics of the step."""

    weights: torch.Tensor | None
    metrics: dict[str, float]


def importance_correction(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    correction: OffPolicyCorrection = "truncate",
    level: ImportanceLevel = "token",
    threshold: float = 2.0,
) -> ImportanceCorrection:
    """Importance weights of the loss tokens (``response_mask``) and their metrics.

    Metrics (over loss tokens, of the ratio before any cap): ``is_ratio_mean``, ``is_ratio_max``,
    ``is_ratio_min``; ``is_truncated_share`` ("truncate") or ``is_masked_share`` ("mask"): the
    share of loss tokens whose ratio is above the cap; ``is_weight_mean``: the mean weight applied.
    A batch without loss tokens has no weights to speak of: ratio metrics 1, shares 0.
    """
    check_correction(correction, level, threshold)
    if old_log_prob.shape != rollout_log_prob.shape or old_log_prob.shape != response_mask.shape:
        raise ValueError(
            f"old log-probs {tuple(old_log_prob.shape)}, rollout log-probs {tuple(rollout_log_prob.shape)} and "
            f"response mask {tuple(response_mask.shape)} must have one shape"
        )
    mask = response_mask.float()
    share_key = {"truncate": "is_truncated_share", "mask": "is_masked_share"}.get(correction)
    if not bool(mask.any()):
        metrics = {"is_ratio_mean": 1.0, "is_ratio_max": 1.0, "is_ratio_min": 1.0, "is_weight_mean": 1.0}
        if share_key is not None:
            metrics[share_key] = 0.0
        return ImportanceCorrection(None if correction == "none" else torch.zeros_like(mask), metrics)
    log_ratio = (old_log_prob.float() - rollout_log_prob.float()) * mask
    # VERL's ratio at the chosen level (exp of a log ratio clamped to +-20, 0 off the mask), uncapped.
    raw, _ = compute_rollout_correction_weights(log_ratio, mask, rollout_is=level, rollout_is_threshold=math.inf)
    loss = mask.bool()
    ratios = raw[loss]
    metrics = {
        "is_ratio_mean": float(ratios.mean()),
        "is_ratio_max": float(ratios.max()),
        "is_ratio_min": float(ratios.min()),
    }
    if correction == "none":
        metrics["is_weight_mean"] = 1.0
        return ImportanceCorrection(None, metrics)
    over = raw > threshold
    # Truncation is VERL's TIS line (clamp the masked weights at the cap); masking zeroes them instead.
    weights = raw.clamp(max=threshold) if correction == "truncate" else torch.where(over, torch.zeros_like(raw), raw)
    assert share_key is not None
    metrics[share_key] = float(over[loss].float().mean())
    metrics["is_weight_mean"] = float(weights[loss].mean())
    return ImportanceCorrection(weights.detach(), metrics)


def staleness_histogram(row_versions: Iterable[int | None], trainer_version: int) -> dict[str, float]:
    """Rows per staleness (the trainer's policy version minus the version that served the row):
    ``staleness_<k>`` for each k seen, ``staleness_max`` and ``staleness_mean``; rows without a
    version are ``staleness_unknown``, rows from a version ahead of the trainer ``staleness_ahead``."""
    counts: Counter[int] = Counter()
    unknown = 0
    for version in row_versions:
        if version is None:
            unknown += 1
        else:
            counts[trainer_version - int(version)] += 1
    out: dict[str, float] = {}
    behind = {k: n for k, n in counts.items() if k >= 0}
    for k in sorted(behind):
        out[f"staleness_{k}"] = float(behind[k])
    if counts:
        out["staleness_max"] = float(max(counts))
        out["staleness_mean"] = sum(k * n for k, n in counts.items()) / sum(counts.values())
    ahead = sum(n for k, n in counts.items() if k < 0)
    if ahead:
        out["staleness_ahead"] = float(ahead)
    if unknown:
        out["staleness_unknown"] = float(unknown)
    return out


__all__ = [
    "IMPORTANCE_LEVELS",
    "OFF_POLICY_CORRECTIONS",
    "ImportanceCorrection",
    "ImportanceLevel",
    "OffPolicyCorrection",
    "check_correction",
    "importance_correction",
    "staleness_histogram",
]
