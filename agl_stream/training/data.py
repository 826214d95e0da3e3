"""Triplet batches -> VERL ``DataProto``: the tensors VERL's PPO actor reads, one row per triplet.

Layout (as the seed's VERL daemon and VERL's rollout workers build it): ``prompts`` left-padded
to the widest prompt of the batch, ``responses`` right-padded to the widest response, so every
response starts in the same column of ``input_ids``; ``position_ids`` count non-pad tokens from
0 (left padding never shifts where a prompt starts); rewards sit on each row's last response token.

Rewards (``reward_mode``):

- ``"final"`` (default, the seed's daemon): every triplet of an attempt gets the record's
  ``final_reward``, so all calls of one attempt share its outcome.
- ``"triplet"``: a triplet's own ``reward``; a triplet without one gets the record's
  ``final_reward`` (the outcome credits every call that was not rewarded on its own).

Either way a missing reward becomes ``missing_reward`` (0.0, the seed's ``reward_fillna_value``),
counted in ``meta_info["n_missing_rewards"]``; ``missing_reward=None`` rejects the batch instead.

Truncation: a prompt over ``max_prompt_length`` keeps its *last* tokens (those next to the
response); a response over ``max_response_length`` keeps its *first* tokens (with their
logprobs). A row whose prompt was cut was generated from a context the trainer no longer sees,
so by default (``train_truncated_prompts=False``, the seed's ``is_drop_mask``) its
``response_mask`` is all zero: its reward still counts in its group's baseline, but it adds
nothing to the loss. Both kinds are counted in ``meta_info``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from verl import DataProto

from agl_stream.errors import AglError
from agl_stream.models.training import Triplet, TripletBatch, TripletRecord

RewardMode = Literal["final", "triplet"]

# Keys of DataProto.batch that batch_to_dataproto always writes.
TENSOR_KEYS = (
    "prompts",
    "responses",
    "input_ids",
    "attention_mask",
    "position_ids",
    "response_mask",
    "token_level_scores",
    "token_level_rewards",
)
NON_TENSOR_KEYS = ("uid", "rollout_id", "attempt_id", "triplet_index", "policy_version", "resources_id")


class InvalidBatchError(AglError, ValueError):
    """A batch cannot be trained on; ``reason`` says why. Dead-letter the batch, don't retry it."""

    def __init__(
        self,
        reason: str,
        *,
        batch_id: str | None = None,
        rollout_id: str | None = None,
        attempt_id: str | None = None,
        triplet_index: int | None = None,
    ) -> None:
        self.reason = reason
        self.batch_id = batch_id
        self.rollout_id = rollout_id
        self.attempt_id = attempt_id
        self.triplet_index = triplet_index
        where = []
        if batch_id is not None:
            where.append(f"batch {batch_id}")
        if rollout_id is not None:
            where.append(f"rollout {rollout_id} attempt {attempt_id} triplet {triplet_index}")
        super().__init__(f"{reason} ({', '.join(where)})" if where else reason)


@dataclass(frozen=True)
class _Row:
    record: TripletRecord
    index: int
    prompt: list[int]
    response: list[int]
    logprobs: list[float] | None
    reward: float
    reward_missing: bool
    prompt_truncated: bool
    response_truncated: bool


def batch_to_dataproto(
    batch: TripletBatch,
    *,
    pad_token_id: int,
    max_prompt_length: int | None = None,
    max_response_length: int | None = None,
    reward_mode: RewardMode = "final",
    missing_reward: float | None = 0.0,
    train_truncated_prompts: bool = False,
    vocab_size: int | None = None,
) -> DataProto:
    """One DataProto row per triplet of ``batch``, in record order then call order.

    Tensors (B rows, P = widest prompt, R = widest response, both after truncation):
    ``prompts`` (B, P) and ``responses`` (B, R) int64; ``input_ids``, ``attention_mask``,
    ``position_ids`` (B, P+R) int64; ``response_mask`` (B, R) int64; ``token_level_scores`` and
    ``token_level_rewards`` (B, R) float32, equal (no KL-in-reward here); ``old_log_probs`` and
    ``rollout_log_probs`` (B, R) float32 only when every triplet has ``response_logprobs``.
    Non-tensors (object arrays): ``uid`` (the record's group_id: VERL's GRPO groups),
    ``rollout_id``, ``attempt_id``, ``triplet_index``, ``policy_version``, ``resources_id``.
    ``meta_info``: batch id, counts (rows, records, tokens, truncations, missing rewards,
    records without triplets) and the policy versions.

    Records without triplets are skipped (counted); a batch left with no rows, an empty prompt or
    response, a negative (or, with ``vocab_size``, too large) token id, logprobs whose count
    differs from the response's or that are not finite, a non-finite reward, or a missing reward
    with ``missing_reward=None`` raise :class:`InvalidBatchError`.
    """
    if pad_token_id < 0:
        raise ValueError("pad_token_id must be >= 0")
    for name, limit in (("max_prompt_length", max_prompt_length), ("max_response_length", max_response_length)):
        if limit is not None and limit < 1:
            raise ValueError(f"{name} must be at least 1")
    if reward_mode not in ("final", "triplet"):
        raise ValueError(f"reward_mode must be 'final' or 'triplet', not {reward_mode!r}")

    rows: list[_Row] = []
    empty_records = 0
    for record in batch.records:
        if not record.triplets:
            empty_records += 1
            continue
        for index, triplet in enumerate(record.triplets):
            rows.append(
                _row(
                    batch.batch_id,
                    record,
                    index,
                    triplet,
                    max_prompt_length=max_prompt_length,
                    max_response_length=max_response_length,
                    reward_mode=reward_mode,
                    missing_reward=missing_reward,
                    vocab_size=vocab_size,
                )
            )
    if not rows:
        raise InvalidBatchError("the batch has no triplets to train on", batch_id=batch.batch_id)

    n = len(rows)
    width_p = max(len(r.prompt) for r in rows)
    width_r = max(len(r.response) for r in rows)
    prompts = torch.full((n, width_p), pad_token_id, dtype=torch.long)
    responses = torch.full((n, width_r), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((n, width_p), dtype=torch.long)
    response_attention = torch.zeros((n, width_r), dtype=torch.long)
    rewards = torch.zeros((n, width_r), dtype=torch.float32)
    with_logprobs = all(r.logprobs is not None for r in rows)
    logprobs = torch.zeros((n, width_r), dtype=torch.float32) if with_logprobs else None
    for i, row in enumerate(rows):
        p, q = len(row.prompt), len(row.response)
        prompts[i, width_p - p :] = torch.tensor(row.prompt, dtype=torch.long)
        prompt_mask[i, width_p - p :] = 1
        responses[i, :q] = torch.tensor(row.response, dtype=torch.long)
        response_attention[i, :q] = 1
        rewards[i, q - 1] = row.reward
        if logprobs is not None and row.logprobs is not None:
            logprobs[i, :q] = torch.tensor(row.logprobs, dtype=torch.float32)

    attention_mask = torch.cat([prompt_mask, response_attention], dim=1)
    response_mask = response_attention.clone()
    if not train_truncated_prompts:
        for i, row in enumerate(rows):
            if row.prompt_truncated:
                response_mask[i] = 0
    tensors: dict[str, torch.Tensor] = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
        "response_mask": response_mask,
        "token_level_scores": rewards,
        "token_level_rewards": rewards.clone(),
    }
    if logprobs is not None:
        tensors["old_log_probs"] = logprobs
        tensors["rollout_log_probs"] = logprobs.clone()

    non_tensors: dict[str, np.ndarray[Any, Any]] = {
        "uid": _objects([r.record.group_id for r in rows]),
        "rollout_id": _objects([r.record.rollout_id for r in rows]),
        "attempt_id": _objects([r.record.attempt_id for r in rows]),
        "triplet_index": _objects([r.index for r in rows]),
        "policy_version": _objects([r.record.policy_version for r in rows]),
        "resources_id": _objects([r.record.resources_id for r in rows]),
    }
    versions = [r.record.policy_version for r in rows if r.record.policy_version is not None]
    meta_info: dict[str, Any] = {
        "batch_id": batch.batch_id,
        "pad_token_id": pad_token_id,
        "reward_mode": reward_mode,
        "n_rows": n,
        "n_records": len({(r.record.rollout_id, r.record.attempt_id) for r in rows}),
        "n_groups": len({r.record.group_id for r in rows}),
        "n_empty_records": empty_records,
        "n_prompt_tokens": int(prompt_mask.sum()),
        "n_response_tokens": int(response_attention.sum()),
        "n_truncated_prompts": sum(r.prompt_truncated for r in rows),
        "n_truncated_responses": sum(r.response_truncated for r in rows),
        "n_masked_rows": int((response_mask.sum(dim=1) == 0).sum()),
        "n_missing_rewards": sum(r.reward_missing for r in rows),
        "has_old_log_probs": with_logprobs,
        "min_policy_version": min(versions) if versions else None,
        "max_policy_version": max(versions) if versions else None,
    }
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta_info)


def _objects(values: Sequence[Any]) -> np.ndarray[Any, Any]:
    # Built element by element: np.array() on a list of equal-length lists would make a 2-D array.
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out


def _row(
    batch_id: str,
    record: TripletRecord,
    index: int,
    triplet: Triplet,
    *,
    max_prompt_length: int | None,
    max_response_length: int | None,
    reward_mode: RewardMode,
    missing_reward: float | None,
    vocab_size: int | None,
) -> _Row:
    def invalid(reason: str) -> InvalidBatchError:
        return InvalidBatchError(
            reason,
            batch_id=batch_id,
            rollout_id=record.rollout_id,
            attempt_id=record.attempt_id,
            triplet_index=index,
        )

    prompt, response = list(triplet.prompt_token_ids), list(triplet.response_token_ids)
    if not prompt:
        raise invalid("empty prompt: the first response token has no context to be predicted from")
    if not response:
        raise invalid("empty response: nothing to train on")
    for name, ids in (("prompt", prompt), ("response", response)):
        bad = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if bad:
            bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise invalid(f"{name} token id {bad[0]} is not {bound}")
    logprobs = list(triplet.response_logprobs) if triplet.response_logprobs is not None else None
    if logprobs is not None:
        if len(logprobs) != len(response):
            raise invalid(f"{len(logprobs)} response logprobs for {len(response)} response tokens")
        if not all(math.isfinite(v) for v in logprobs):
            raise invalid("a response logprob is not finite")

    reward = triplet.reward if reward_mode == "triplet" else None
    if reward is None:
        reward = record.final_reward
    reward_missing = reward is None
    if reward is None:
        if missing_reward is None:
            raise invalid("no reward (neither the triplet's nor the record's final reward)")
        reward = missing_reward
    if not math.isfinite(reward):
        raise invalid(f"reward {reward} is not finite")

    prompt_truncated = max_prompt_length is not None and len(prompt) > max_prompt_length
    if prompt_truncated:
        assert max_prompt_length is not None
        prompt = prompt[-max_prompt_length:]
    response_truncated = max_response_length is not None and len(response) > max_response_length
    if response_truncated:
        assert max_response_length is not None
        response = response[:max_response_length]
        logprobs = logprobs[:max_response_length] if logprobs is not None else None
    return _Row(
        record=record,
        index=index,
        prompt=prompt,
        response=response,
        logprobs=logprobs,
        reward=float(reward),
        reward_missing=reward_missing,
        prompt_truncated=prompt_truncated,
        response_truncated=response_truncated,
    )
