"""Advantage and loss at the rollout's level: pure tensor functions both backends call.

With trajectory aggregation one rollout (one attempt of one task) can become several training
samples (DataProto rows). VERL's estimators and ``agg_loss`` see rows, so a rollout with five
samples would count five times in its group's mean and std and weigh five times as much in the
loss. Two settings put the rollout back where it belongs:

- ``advantage_level="rollout"`` (default): one score per rollout (the reward of its last sample:
  with ``reward_mode="final"`` every sample carries the rollout's final reward), VERL's estimator
  run on one representative row per rollout (:func:`rollout_advantages`), and that one
  advantage applied to every loss token of all the rollout's samples. ``"sample"``: VERL's
  estimator on the rows as they are (each row a group member). With one sample per rollout the
  two are the same numbers.
- ``loss_agg_mode="rollout-mean"``: the mean over rollouts of each rollout's token-mean (over the
  loss tokens of all its samples), so a ten-turn rollout weighs what a one-turn rollout does.
  It is a per-token weight (:func:`rollout_mean_weights`: ``1 / (rollouts x the rollout's loss
  tokens)``, summing to 1 over a mini-batch) applied through VERL's ``token-sum`` aggregation;
  VERL's own modes go to ``verl.trainer.ppo.core_algos.agg_loss`` unchanged
  (:func:`aggregate_loss`, :func:`policy_loss_mode`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from verl import DataProto
from verl.trainer.ppo.core_algos import agg_loss

from agl_stream.rl_options import ADVANTAGE_LEVELS, LOSS_AGG_MODES, ROLLOUT_MEAN, VERL_LOSS_AGG_MODES, AdvantageLevel

# An estimator as the backends call it: (token_level_rewards, response_mask, uid groups) -> advantages.
Estimate = Callable[[torch.Tensor, torch.Tensor, np.ndarray[Any, Any]], torch.Tensor]


def check_levels(advantage_level: str, loss_agg_mode: str, estimator: str, gamma: float) -> None:
    """ValueError for an unknown level or mode, or a rollout level the estimator has no form of."""
    if advantage_level not in ADVANTAGE_LEVELS:
        raise ValueError(f"advantage_level must be one of {list(ADVANTAGE_LEVELS)}, not {advantage_level!r}")
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {list(LOSS_AGG_MODES)}, not {loss_agg_mode!r}")
    if advantage_level == "rollout" and estimator == "reinforce_plus_plus" and gamma != 1.0:
        raise ValueError(
            "advantage_level 'rollout' gives every token of a rollout one advantage; REINFORCE++ with "
            f"gamma {gamma} discounts per token, which has no such form: use gamma 1 or advantage_level 'sample'"
        )


def rollout_index(data: DataProto) -> torch.Tensor:
    """(B,) long: rows of one rollout attempt (same ``rollout_id`` and ``attempt_id``) share a number,
    0, 1, ... in order of first appearance. Without those non-tensors every row is a rollout of its own."""
    rows = len(data)
    rollout_ids = data.non_tensor_batch.get("rollout_id")
    attempt_ids = data.non_tensor_batch.get("attempt_id")
    if rollout_ids is None or attempt_ids is None:
        return torch.arange(rows)
    numbers: dict[tuple[Any, Any], int] = {}
    out = [numbers.setdefault((r, a), len(numbers)) for r, a in zip(rollout_ids, attempt_ids, strict=True)]
    return torch.tensor(out, dtype=torch.long)


def rollout_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    uid: np.ndarray[Any, Any],
    rollouts: torch.Tensor,
    estimate: Estimate,
) -> torch.Tensor:
    """Advantages (B, R) with one number per rollout, by VERL's estimator over rollouts.

    ``rollouts``: :func:`rollout_index`. Each rollout becomes one representative row: its score
    (the summed reward of its last row) on the last of as many loss tokens as all its samples have
    (so a length-weighted estimator such as OPO, or REINFORCE++'s whitening over tokens, sees the
    rollout's real length), in the group (``uid``) of its rows. ``estimate`` runs on those rows;
    the advantage at the representative's first token goes to every loss token of the rollout's
    samples. A rollout with no loss token still counts in its group's baseline and trains nothing.
    """
    rows = token_level_rewards.shape[0]
    if rollouts.shape != (rows,):
        raise ValueError(f"rollouts must have one entry per row ({rows}), got shape {tuple(rollouts.shape)}")
    count = int(rollouts.max()) + 1 if rows else 0
    last = torch.zeros(count, dtype=torch.long).scatter_reduce(
        0, rollouts, torch.arange(rows), reduce="amax", include_self=False
    )  # each rollout's last row
    scores = token_level_rewards.sum(dim=-1)[last]
    tokens = torch.zeros(count, dtype=torch.long).index_add_(0, rollouts, response_mask.sum(dim=-1).long())
    width = max(1, int(tokens.max()))
    rep_mask = (torch.arange(width).unsqueeze(0) < tokens.unsqueeze(1)).to(response_mask.dtype)
    rep_rewards = torch.zeros((count, width), dtype=token_level_rewards.dtype)
    rep_rewards[torch.arange(count), (tokens - 1).clamp(min=0)] = scores
    rep_uid = np.empty(count, dtype=object)
    for i, row in enumerate(last.tolist()):
        rep_uid[i] = uid[row]
    per_rollout = estimate(rep_rewards, rep_mask, rep_uid)[:, 0]
    return per_rollout[rollouts].unsqueeze(-1) * response_mask


def rollout_mean_weights(loss_mask: torch.Tensor, rollouts: torch.Tensor) -> torch.Tensor:
    """(B, R) float weights of ``rollout-mean``: ``1 / (n x T_r)`` on each loss token of rollout r,
    where ``n`` counts the rollouts with a loss token in these rows and ``T_r`` is rollout r's loss
    tokens in them; 0 elsewhere. They sum to 1, so ``sum(loss x weights)`` is the mean over rollouts
    of each rollout's token-mean. Computed over a whole mini-batch, then sliced per micro-batch."""
    mask = loss_mask.float()
    count = int(rollouts.max()) + 1 if rollouts.numel() else 0
    tokens = torch.zeros(count, dtype=torch.float32).index_add_(0, rollouts, mask.sum(dim=-1))
    present = int((tokens > 0).sum())
    if present == 0:
        return torch.zeros_like(mask)
    per_row = torch.where(tokens > 0, 1.0 / (present * tokens.clamp(min=1.0)), torch.zeros_like(tokens))[rollouts]
    return mask * per_row.unsqueeze(-1)


def verl_loss_agg_mode(loss_agg_mode: str) -> str:
    """The VERL mode that carries ``loss_agg_mode``: itself, or ``token-sum`` for ``rollout-mean``
    (whose weights then ride on the per-token losses)."""
    return "token-sum" if loss_agg_mode == ROLLOUT_MEAN else loss_agg_mode


def policy_loss_mode(
    loss_agg_mode: str, is_weights: torch.Tensor | None, rollout_weights: torch.Tensor | None
) -> tuple[str, torch.Tensor | None]:
    """What VERL's policy loss function is called with for ``loss_agg_mode``: its own modes as they
    are (with the importance weights); ``rollout-mean`` as ``token-sum`` with the rollout weights
    folded into ``rollout_is_weights`` (VERL multiplies the per-token losses by them)."""
    if loss_agg_mode != ROLLOUT_MEAN:
        return loss_agg_mode, is_weights
    if rollout_weights is None:
        raise ValueError("loss_agg_mode 'rollout-mean' needs the rollout weights (rollout_mean_weights)")
    return verl_loss_agg_mode(loss_agg_mode), rollout_weights if is_weights is None else is_weights * rollout_weights


def aggregate_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    rollout_weights: torch.Tensor | None = None,
    **global_batch_info: Any,
) -> torch.Tensor:
    """A scalar loss from per-token ``loss_mat``: VERL's ``agg_loss`` for its modes (with
    ``global_batch_info``: ``dp_size``, ``batch_num_tokens``, ``global_batch_size``,
    ``loss_scale_factor``); ``rollout-mean`` as the ``token-sum`` of ``loss_mat x rollout_weights``."""
    mode, weights = policy_loss_mode(loss_agg_mode, None, rollout_weights)
    if weights is not None:
        loss_mat = loss_mat * weights
    return agg_loss(loss_mat=loss_mat, loss_mask=loss_mask, loss_agg_mode=mode, **global_batch_info)


__all__ = [
    "ADVANTAGE_LEVELS",
    "LOSS_AGG_MODES",
    "ROLLOUT_MEAN",
    "VERL_LOSS_AGG_MODES",
    "AdvantageLevel",
    "aggregate_loss",
    "check_levels",
    "policy_loss_mode",
    "rollout_advantages",
    "rollout_index",
    "rollout_mean_weights",
    "verl_loss_agg_mode",
]
