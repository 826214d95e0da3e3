"""Policy backends: what a trainer calls with each batch (:class:`PolicyBackend`), and the RL maths
both backends share. The torch backend (``torch_backend.py``) is VERL's PPO actor update without
Ray or FSDP, for one process on a CPU or one GPU; the verl backend drives VERL's FSDP engine. The
RL maths is VERL's own, called, not re-derived:

- advantages: ``verl.trainer.ppo.core_algos.get_adv_estimator_fn(name)`` with the keyword
  arguments VERL's ``ray_trainer.compute_advantage`` passes (``token_level_rewards``,
  ``response_mask``, ``index`` = the ``uid`` groups, ``config`` = an ``AlgoConfig``, plus
  ``norm_adv_by_std_in_grpo`` for the GRPO estimators);
- policy loss: ``get_policy_loss_fn(loss_mode)`` ("vanilla": PPO clip with dual clip) with a
  ``verl.workers.config.ActorConfig`` whose ``global_batch_info`` is set per mini-batch as
  VERL's ``workers.utils.losses.ppo_loss`` does, so gradients accumulated over micro-batches
  equal one pass over the whole mini-batch;
- the entropy bonus: ``core_algos.agg_loss``; log-probs and entropy:
  ``verl.utils.torch_functional.logprobs_from_logits`` / ``entropy_from_logits``.

Advantage and loss at the rollout's level (``agl_stream.training.levels``) and off-policy
correction (``agl_stream.training.off_policy``) are pure functions both backends call here.

``algorithm``: "grpo" uses VERL's "grpo" estimator (reward minus its group's mean, over the
group's std). "ppo" means PPO-clip without a critic (none is trained here): VERL's
"reinforce_plus_plus" estimator (discounted returns with gamma 1, whitened over the whole
batch; no groups needed). ``adv_estimator`` picks any other critic-free VERL estimator by name.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from verl import DataProto
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo.core_algos import get_adv_estimator_fn
from verl.workers.config import PolicyLossConfig

from agl_stream.rl_options import RLOptions, resolve_estimator
from agl_stream.training.data import InvalidBatchError
from agl_stream.training.levels import check_levels, rollout_advantages, verl_loss_agg_mode
from agl_stream.training.off_policy import check_correction, importance_correction, staleness_histogram

TRAINER_STATE_FILE = "trainer_state.pt"

_REQUIRED_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask", "token_level_rewards")


@runtime_checkable
class PolicyBackend(Protocol):
    """What the trainer process drives: one ``step`` per batch, ``save`` to publish a version."""

    @property
    def policy_version(self) -> int:
        """The version of the weights held now; each ``step`` that changed the weights adds one."""
        ...

    def step(self, data: DataProto) -> dict[str, float]:
        """Train on one batch (a :func:`agl_stream.training.batch_to_dataproto` result); return metrics."""
        ...

    def save(self, directory: str | Path) -> None:
        """Write a checkpoint an inference server can load (and this backend can resume from)."""
        ...


def prepare_batch(data: DataProto) -> dict[str, torch.Tensor]:
    """``data``'s tensors on the CPU, checked for the layout every backend needs, plus
    ``prompt_lengths`` and ``response_lengths`` per row. Raises :class:`InvalidBatchError`."""
    if data.batch is None:
        raise InvalidBatchError("the DataProto has no tensors")
    keys = set(data.batch.keys())
    missing = [k for k in _REQUIRED_KEYS if k not in keys]
    if missing:
        raise InvalidBatchError(f"the DataProto lacks {', '.join(missing)}")
    batch: dict[str, torch.Tensor] = {k: data.batch[k].cpu() for k in keys}
    rows, width = batch["input_ids"].shape
    if rows == 0:
        raise InvalidBatchError("the DataProto has no rows")
    response_width = batch["responses"].shape[1]
    prompt_width = width - response_width
    if prompt_width < 1:
        raise InvalidBatchError("input_ids must hold a prompt before the responses")
    if not torch.equal(batch["input_ids"][:, prompt_width:], batch["responses"]):
        raise InvalidBatchError("input_ids must end with responses (prompt left-padded, response right-padded)")
    attention = batch["attention_mask"]
    batch["prompt_lengths"] = attention[:, :prompt_width].sum(dim=1)
    batch["response_lengths"] = attention[:, prompt_width:].sum(dim=1)
    if bool((batch["prompt_lengths"] == 0).any()) or bool((batch["response_lengths"] == 0).any()):
        raise InvalidBatchError("every row needs a non-empty prompt and response")
    return batch


def compute_advantages(
    data: DataProto,
    batch: dict[str, torch.Tensor],
    *,
    estimator: str,
    algo_config: AlgoConfig,
    norm_adv_by_std_in_grpo: bool = True,
    advantage_level: str = "rollout",
    rollouts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Advantages (B, R) for a :func:`prepare_batch` result: the batch's own ``advantages`` if it has
    them, else VERL's ``estimator`` called as ``ray_trainer.compute_advantage`` calls it (``index``
    = the ``uid`` groups). With ``advantage_level="rollout"`` and a rollout of several rows
    (``rollouts``: :func:`agl_stream.training.levels.rollout_index`), over one representative row
    per rollout (:func:`agl_stream.training.levels.rollout_advantages`). Shared by every backend,
    so they train on the same numbers."""
    if "advantages" in batch:
        return batch["advantages"].float()
    uid = data.non_tensor_batch.get("uid")
    if uid is None and estimator not in ("reinforce_plus_plus",):
        raise InvalidBatchError(f"advantage estimator {estimator!r} needs the 'uid' groups")

    def estimate(rewards: torch.Tensor, mask: torch.Tensor, index: Any) -> torch.Tensor:
        kwargs: dict[str, Any] = {"token_level_rewards": rewards, "response_mask": mask, "config": algo_config}
        if index is not None:
            kwargs["index"] = index
        if estimator.startswith("grpo"):
            kwargs["norm_adv_by_std_in_grpo"] = norm_adv_by_std_in_grpo
        try:
            advantages, _returns = get_adv_estimator_fn(estimator)(**kwargs)
        except ValueError as error:  # e.g. REINFORCE++ whitening over a single loss token
            raise InvalidBatchError(f"advantage estimator {estimator!r} cannot use this batch: {error}") from error
        return advantages.float()

    rewards = batch["token_level_rewards"].float()
    if advantage_level == "rollout" and rollouts is not None and rollouts.unique().numel() < rollouts.numel():
        groups = uid if uid is not None else np.full(len(rollouts), None, dtype=object)
        return rollout_advantages(rewards, batch["response_mask"], groups, rollouts, estimate)
    return estimate(rewards, batch["response_mask"], uid)


def actor_options(options: RLOptions) -> dict[str, Any]:
    """The fields of VERL's actor config that ``options`` sets, as every backend sets them."""
    clip_low, clip_high = options.clip_ratio_low, options.clip_ratio_high
    return {
        "rollout_n": 1,
        "ppo_mini_batch_size": options.mini_batch_size or 1,
        "clip_ratio": options.clip_ratio,
        "clip_ratio_low": options.clip_ratio if clip_low is None else clip_low,
        "clip_ratio_high": options.clip_ratio if clip_high is None else clip_high,
        "clip_ratio_c": options.clip_ratio_c,
        # VERL's policy loss aggregates rollout-mean as token-sum of weighted losses (levels.py).
        "loss_agg_mode": verl_loss_agg_mode(options.loss_agg_mode),
        "entropy_coeff": options.entropy_coeff,
        "ppo_epochs": options.ppo_epochs,
        "shuffle": options.shuffle,
        "policy_loss": PolicyLossConfig(loss_mode=options.loss_mode),
    }


def advantages_for(
    data: DataProto, batch: dict[str, torch.Tensor], options: RLOptions, rollouts: torch.Tensor
) -> torch.Tensor:
    """:func:`compute_advantages` with the estimator settings of ``options`` (what every backend trains on)."""
    algo_config = AlgoConfig(
        adv_estimator=options.estimator, gamma=options.gamma, norm_adv_by_std_in_grpo=options.norm_adv_by_std_in_grpo
    )
    return compute_advantages(
        data,
        batch,
        estimator=options.estimator,
        algo_config=algo_config,
        norm_adv_by_std_in_grpo=options.norm_adv_by_std_in_grpo,
        advantage_level=options.advantage_level,
        rollouts=rollouts,
    )


def step_metrics(
    batch: dict[str, torch.Tensor],
    advantages: torch.Tensor,
    sums: dict[str, float],
    *,
    updates: int,
    skipped: int,
    seconds: float,
    epochs: int,
    recomputed: bool,
    lr: float,
    policy_version: int,
    **extra: float,
) -> dict[str, float]:
    """What a backend's ``step`` reports: the mean of its mini-batch losses (``sums`` over
    ``updates + skipped`` optimizer steps) and the batch's advantages, rewards, sizes and speed."""
    n = max(1, updates + skipped)
    response_mask = batch["response_mask"]
    tokens = float(batch["attention_mask"].sum())
    metrics = {key: value / n for key, value in sums.items()}
    for key in ("loss", "pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "entropy", "grad_norm"):
        metrics.setdefault(key, 0.0)
    in_loss = response_mask.bool()
    metrics.update(
        {
            "advantage_mean": float(advantages[in_loss].mean()) if in_loss.any() else 0.0,
            "advantage_abs_mean": float(advantages[in_loss].abs().mean()) if in_loss.any() else 0.0,
            "reward_mean": float(batch["token_level_rewards"].sum(dim=1).mean()),
            "response_length_mean": float(batch["response_lengths"].float().mean()),
            "rows": float(batch["input_ids"].shape[0]),
            "tokens": tokens,
            "response_tokens": float(response_mask.sum()),
            "seconds": seconds,
            "tokens_per_s": tokens * epochs / seconds if seconds > 0 else 0.0,
            "updates": float(updates),
            "skipped_updates": float(skipped),
            "recomputed_old_log_probs": float(recomputed),
            "lr": lr,
            "policy_version": float(policy_version),
            **extra,
        }
    )
    return metrics


def check_common_options(options: RLOptions) -> None:
    """The checks every backend's options need (estimator, lr, epochs, mini-batches, clipping)."""
    resolve_estimator(options.algorithm, options.adv_estimator)
    if options.lr <= 0:
        raise ValueError("lr must be > 0")
    if options.ppo_epochs < 1:
        raise ValueError("ppo_epochs must be at least 1")
    if options.mini_batch_size is not None and options.mini_batch_size < 1:
        raise ValueError("mini_batch_size must be at least 1 (or None: the whole batch)")
    if options.max_grad_norm <= 0:
        raise ValueError("max_grad_norm must be > 0")
    check_levels(options.advantage_level, options.loss_agg_mode, options.estimator, options.gamma)
    check_correction(options.off_policy_correction, options.rollout_is, options.rollout_is_threshold)


def row_versions(data: DataProto) -> list[int | None]:
    """The policy version that served each row (the non-tensor ``policy_version``; None where unknown)."""
    versions = data.non_tensor_batch.get("policy_version")
    if versions is None:
        return [None] * len(data)
    return [None if v is None else int(v) for v in versions]


def old_log_probs_and_weights(
    batch: dict[str, torch.Tensor], options: Any, compute_log_probs: Callable[[dict[str, torch.Tensor]], torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float], bool]:
    """The old-policy log-probs a step trains against, the importance weights for the loss (None
    without the engine's ``rollout_log_probs``), their metrics, and whether the old log-probs were
    recomputed (``compute_log_probs``: the backend's own forward pass). Correcting needs the
    trainer's own old log-probs, so it recomputes them; otherwise the batch's are used unless
    ``options.recompute_old_log_probs``. Shared by every backend."""
    engine_log_probs = batch.get("rollout_log_probs")
    correct = options.off_policy_correction != "none" and engine_log_probs is not None
    recompute = options.recompute_old_log_probs or "old_log_probs" not in batch or correct
    old_log_probs = compute_log_probs(batch) if recompute else batch["old_log_probs"].float()
    if engine_log_probs is None:
        return old_log_probs, None, {}, recompute
    result = importance_correction(
        old_log_probs,
        engine_log_probs.float(),
        batch["response_mask"],
        correction=options.off_policy_correction,
        level=options.rollout_is,
        threshold=options.rollout_is_threshold,
    )
    return old_log_probs, result.weights, result.metrics, recompute


def off_policy_metrics(
    versions: list[int | None], policy_version: int, rollouts: torch.Tensor, correction: dict[str, float]
) -> dict[str, float]:
    """The step's off-policy figures: the importance-ratio metrics, the staleness histogram (rows
    per trainer version minus serving version, before the step) and the number of rollouts."""
    return {
        **correction,
        **staleness_histogram(versions, policy_version),
        "rollouts": float(rollouts.unique().numel()),
    }
