"""The ``torch`` policy backend: GRPO/PPO updates in plain PyTorch on the tiny policy (CPU or one
GPU), using VERL's advantage estimators and policy loss."""

from __future__ import annotations

import math
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import verl.utils.torch_functional as verl_F
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from verl import DataProto
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.workers.config import ActorConfig

from agl_stream.policy import load_checkpoint, save_checkpoint
from agl_stream.rl_options import ROLLOUT_MEAN, RLOptions
from agl_stream.training.backend import (
    TRAINER_STATE_FILE,
    actor_options,
    advantages_for,
    check_common_options,
    off_policy_metrics,
    old_log_probs_and_weights,
    prepare_batch,
    row_versions,
    step_metrics,
)
from agl_stream.training.levels import (
    aggregate_loss,
    policy_loss_mode,
    rollout_index,
    rollout_mean_weights,
)


@dataclass(frozen=True, kw_only=True)
class TorchBackendOptions(RLOptions):
    """The hyperparameters of a :class:`TorchPolicyBackend` (saved with its checkpoints): the
    shared :class:`~agl_stream.rl_options.RLOptions` and this engine's own."""

    micro_batch_size: int = 8  # rows per forward/backward pass
    eps: float = 1e-8
    recompute_old_log_probs: bool = False
    mixed_precision: bool = False  # bf16 autocast on CUDA (fp32 master weights)


class TorchPolicyBackend:
    """Trains ``model`` (a HF causal LM) in place with VERL's advantage estimators and policy loss.

    One :meth:`step` = advantages for the batch, old log-probs (the batch's rollout log-probs,
    else a no-grad forward pass), then ``ppo_epochs`` passes over the batch in mini-batches of
    ``mini_batch_size`` rows (default: the whole batch, so one AdamW step per batch), each
    accumulated over micro-batches of ``micro_batch_size`` rows and clipped to ``max_grad_norm``.
    A mini-batch whose gradient norm is not finite is skipped (as VERL does), counted in
    ``skipped_updates``. On CPU the same model, optimizer state, batch and seed give the same
    weights. Not thread-safe: one step at a time.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        device: str | torch.device = "cpu",
        policy_version: int = 0,
        **fields: Any,
    ) -> None:
        """``fields``: :class:`TorchBackendOptions` fields (``lr`` is required)."""
        options = TorchBackendOptions(**fields)
        _validate(options)
        self.options = options
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' asked for, but torch sees no CUDA device")
        # Module.to moves parameters in place: the caller's model is the one trained.
        torch.nn.Module.to(model, self.device)
        self.model = model
        self.tokenizer = tokenizer
        self._policy_version = policy_version
        self._steps = 0
        self.extra_state: dict[str, Any] = {}  # what the last save() was given, after load()
        self._loss_fn = get_policy_loss_fn(options.loss_mode)
        self._actor_config = ActorConfig(
            strategy="fsdp",  # required by the dataclass; nothing here reads it
            ppo_micro_batch_size_per_gpu=options.micro_batch_size,
            use_torch_compile=False,
            **actor_options(options),
        )
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=options.lr,
            betas=options.betas,
            eps=options.eps,
            weight_decay=options.weight_decay,
        )
        self._generator = torch.Generator().manual_seed(options.seed)

    @property
    def policy_version(self) -> int:
        return self._policy_version

    # -- training -------------------------------------------------------------------------

    def step(self, data: DataProto) -> dict[str, float]:
        """Train on ``data``; return metrics (all floats).

        Metrics: ``loss`` (policy loss incl. entropy bonus, mean over mini-batches),
        ``pg_loss``, ``pg_clipfrac``, ``pg_clipfrac_lower``, ``ppo_kl`` (VERL's mean of
        old - new log-prob: how far the weights are from the policy that sampled the batch,
        the "kl"), ``entropy``, ``grad_norm`` (mean, before clipping), ``advantage_mean``,
        ``advantage_abs_mean``, ``reward_mean`` (per row), ``response_length_mean``, ``rows``,
        ``tokens`` (non-pad prompt+response tokens), ``response_tokens`` (tokens in the loss),
        ``seconds``, ``tokens_per_s`` (tokens x ppo_epochs / seconds), ``updates``,
        ``skipped_updates``, ``recomputed_old_log_probs`` (0/1), ``policy_version`` (after),
        ``rollouts``; the staleness histogram (``staleness_<k>``, ``staleness_max``,
        ``staleness_mean``: rows per policy version behind, see
        :func:`agl_stream.training.off_policy.staleness_histogram`); with the engine's log-probs
        (``rollout_log_probs``), the importance-ratio metrics of
        :func:`agl_stream.training.off_policy.importance_correction` (``is_ratio_mean``,
        ``is_ratio_max``, ``is_ratio_min``, ``is_truncated_share`` or ``is_masked_share``,
        ``is_weight_mean``).

        Old log-probs: with the engine's log-probs and ``off_policy_correction`` other than "none",
        the trainer's own (a no-grad forward pass on the weights held before the step), and the
        importance weights ``exp(old - rollout)`` (capped or masked) multiply each token's policy
        loss; otherwise the batch's ``old_log_probs`` unless ``recompute_old_log_probs``.
        Raises :class:`InvalidBatchError` for a batch without the needed tensors.
        """
        started = time.perf_counter()
        options = self.options
        batch = prepare_batch(data)
        rollouts = rollout_index(data)
        advantages = advantages_for(data, batch, options, rollouts)
        version_before = self._policy_version
        old_log_probs, is_weights, correction, recompute = old_log_probs_and_weights(
            batch, options, self._compute_log_probs
        )

        rows = batch["input_ids"].shape[0]
        mini = options.mini_batch_size or rows
        sums: dict[str, float] = {}
        updates = skipped = 0
        was_training = self.model.training
        self.model.train()
        try:
            for _epoch in range(options.ppo_epochs):
                order = torch.randperm(rows, generator=self._generator) if options.shuffle else torch.arange(rows)
                for start in range(0, rows, mini):
                    indices = order[start : start + mini]
                    result_sums = self._update(batch, indices, advantages, old_log_probs, is_weights, rollouts)
                    if result_sums is None:
                        continue  # no token of this mini-batch is in the loss
                    for key, value in result_sums.items():
                        sums[key] = sums.get(key, 0.0) + value
                    if math.isfinite(result_sums["grad_norm"]):
                        updates += 1
                    else:
                        skipped += 1
        finally:
            self.model.train(was_training)

        self._steps += 1
        if updates:
            self._policy_version += 1  # the weights are new only if an optimizer step happened
        return step_metrics(
            batch,
            advantages,
            sums,
            updates=updates,
            skipped=skipped,
            seconds=time.perf_counter() - started,
            epochs=options.ppo_epochs,
            recomputed=recompute,
            lr=float(self.optimizer.param_groups[0]["lr"]),
            policy_version=self._policy_version,
            **off_policy_metrics(row_versions(data), version_before, rollouts, correction),
        )

    @torch.no_grad()
    def log_probs(self, data: DataProto) -> torch.Tensor:
        """The current policy's log-probs of ``data``'s responses, (B, R) on the CPU, 0 at padding."""
        return self._compute_log_probs(prepare_batch(data))

    def _micro(self, batch: dict[str, torch.Tensor], indices: torch.Tensor) -> tuple[dict[str, torch.Tensor], int]:
        """The rows ``indices``, without the pad columns none of them needs (left of the prompts, right of
        the responses); also the kept response width."""
        prompt_width = batch["input_ids"].shape[1] - batch["responses"].shape[1]
        left = prompt_width - int(batch["prompt_lengths"][indices].max())
        width = int(batch["response_lengths"][indices].max())
        end = prompt_width + width
        out = {
            "input_ids": batch["input_ids"][indices, left:end],
            "attention_mask": batch["attention_mask"][indices, left:end],
            "position_ids": batch["position_ids"][indices, left:end],
            "responses": batch["responses"][indices, :width],
        }
        return {k: v.to(self.device) for k, v in out.items()}, width

    def _forward(
        self, micro: dict[str, torch.Tensor], width: int, *, entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        autocast = self.options.mixed_precision and self.device.type == "cuda"
        with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=autocast):
            output = self.model(
                input_ids=micro["input_ids"],
                attention_mask=micro["attention_mask"],
                position_ids=micro["position_ids"],
                use_cache=False,
                # The logits at the last prompt token and every response token but the last predict
                # the response; the prompt's other positions are never materialised.
                logits_to_keep=width + 1,
            )
        logits = output.logits[:, :-1, :].float()
        log_prob = verl_F.logprobs_from_logits(logits, micro["responses"])
        ent = None
        if entropy:
            with torch.set_grad_enabled(self.options.entropy_coeff != 0.0 and torch.is_grad_enabled()):
                ent = verl_F.entropy_from_logits(logits)
        return log_prob, ent

    @torch.no_grad()
    def _compute_log_probs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        rows, response_width = batch["responses"].shape
        out = torch.zeros((rows, response_width), dtype=torch.float32)
        was_training = self.model.training
        self.model.eval()
        try:
            for indices in _chunks(torch.arange(rows), self.options.micro_batch_size):
                micro, width = self._micro(batch, indices)
                log_prob, _ = self._forward(micro, width, entropy=False)
                out[indices, :width] = log_prob.float().cpu()
        finally:
            self.model.train(was_training)
        return out * batch["attention_mask"][:, -response_width:]

    def _update(
        self,
        batch: dict[str, torch.Tensor],
        indices: torch.Tensor,
        advantages: torch.Tensor,
        old_log_probs: torch.Tensor,
        is_weights: torch.Tensor | None,
        rollouts: torch.Tensor,
    ) -> dict[str, float] | None:
        options = self.options
        response_mask = batch["response_mask"]
        mini_tokens = int(response_mask[indices].sum())
        if mini_tokens == 0:
            return None
        mini_rows = int((response_mask[indices].sum(dim=1) > 0).sum())
        global_batch_info = {
            "dp_size": 1,
            "batch_num_tokens": mini_tokens,
            "global_batch_size": mini_rows,
            # Only "seq-mean-token-sum-norm" reads it: the batch's response width, not the trimmed
            # micro-batch's, so every micro-batch is normalised alike.
            "loss_scale_factor": batch["responses"].shape[1],
        }
        # rollout-mean: each token's weight over the whole mini-batch (its micro-batches add up).
        rollout_weights = (
            rollout_mean_weights(response_mask[indices], rollouts[indices])
            if options.loss_agg_mode == ROLLOUT_MEAN
            else None
        )
        self._actor_config.global_batch_info.clear()
        self._actor_config.global_batch_info.update(global_batch_info)
        self.optimizer.zero_grad(set_to_none=True)
        sums = {
            "loss": 0.0,
            "pg_loss": 0.0,
            "pg_clipfrac": 0.0,
            "pg_clipfrac_lower": 0.0,
            "ppo_kl": 0.0,
            "entropy": 0.0,
        }
        for offset in range(0, len(indices), options.micro_batch_size):
            micro_indices = indices[offset : offset + options.micro_batch_size]
            micro_tokens = int(response_mask[micro_indices].sum())
            if micro_tokens == 0:
                continue  # its loss would be 0 and VERL's masked means would divide by zero
            micro, width = self._micro(batch, micro_indices)
            mask = response_mask[micro_indices, :width].to(self.device)
            micro_rollout_weights = (
                None
                if rollout_weights is None
                else rollout_weights[offset : offset + options.micro_batch_size, :width].to(self.device)
            )
            loss_agg_mode, weights = policy_loss_mode(
                options.loss_agg_mode,
                None if is_weights is None else is_weights[micro_indices, :width].to(self.device),
                micro_rollout_weights,
            )
            log_prob, ent = self._forward(micro, width, entropy=True)
            pg_loss, pg_metrics = self._loss_fn(
                old_log_prob=old_log_probs[micro_indices, :width].to(self.device),
                log_prob=log_prob,
                advantages=advantages[micro_indices, :width].to(self.device),
                response_mask=mask,
                loss_agg_mode=loss_agg_mode,
                config=self._actor_config,
                rollout_is_weights=weights,
            )
            loss = pg_loss
            if ent is not None:
                entropy_loss = aggregate_loss(
                    ent, mask, options.loss_agg_mode, rollout_weights=micro_rollout_weights, **global_batch_info
                )
                if options.entropy_coeff != 0.0:
                    loss = loss - options.entropy_coeff * entropy_loss
                sums["entropy"] += float(verl_F.masked_mean(ent.detach(), mask)) * micro_tokens / mini_tokens
            loss.backward()
            # The losses are already scaled to the mini-batch (global_batch_info): they add up.
            sums["loss"] += float(loss.detach())
            sums["pg_loss"] += float(pg_loss.detach())
            # VERL's metrics are means over the micro-batch's tokens: weight them by its share.
            for key in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
                sums[key] += float(pg_metrics[f"actor/{key}"]) * micro_tokens / mini_tokens
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, options.max_grad_norm))
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        return {**sums, "grad_norm": grad_norm}

    # -- checkpoints ----------------------------------------------------------------------

    def save(self, directory: str | Path, *, optimizer: bool = True, extra_state: dict[str, Any] | None = None) -> None:
        """Write the model and tokenizer (:func:`agl_stream.policy.save_checkpoint`, atomic) and then,
        unless ``optimizer=False``, ``trainer_state.pt`` (optimizer state, options, policy version,
        RNG, and ``extra_state``) into the same directory, atomically too. An inference server
        reads only the former; a crash between the two leaves a loadable policy without trainer
        state. ``extra_state`` (plain values: str, int, float, bool, None, lists, dicts) comes back
        as :attr:`extra_state` from :meth:`load`: where a trainer records how far it had consumed.
        Publish each version to a new directory: an existing one is replaced."""
        target = Path(directory)
        save_checkpoint(self.model, self.tokenizer, target)  # type: ignore[arg-type]
        if not optimizer:
            return
        state = {
            "format": 1,
            "policy_version": self._policy_version,
            "steps": self._steps,
            "options": asdict(self.options),
            "optimizer": self.optimizer.state_dict(),
            "generator": self._generator.get_state(),
            "extra_state": dict(extra_state or {}),
        }
        tmp = target / f".{TRAINER_STATE_FILE}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as handle:
                torch.save(state, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, target / TRAINER_STATE_FILE)
        finally:
            tmp.unlink(missing_ok=True)

    @classmethod
    def load(cls, directory: str | Path, *, device: str | torch.device = "cpu", **overrides: Any) -> TorchPolicyBackend:
        """Resume from what :meth:`save` wrote: same weights, options, optimizer state and version.

        ``overrides`` replace saved options (``lr=...``, ``micro_batch_size=...``). A folder without
        ``trainer_state.pt`` (a policy saved with ``optimizer=False``, any HF checkpoint) raises
        FileNotFoundError: build a fresh backend on :func:`agl_stream.policy.load_checkpoint` instead.
        """
        path = Path(directory)
        state_file = path / TRAINER_STATE_FILE
        if not state_file.is_file():
            raise FileNotFoundError(f"no {TRAINER_STATE_FILE} in {path}: it holds a policy but no trainer state")
        state = torch.load(state_file, map_location="cpu", weights_only=True)
        if state.get("format") != 1:
            raise ValueError(f"{state_file}: unknown trainer state format {state.get('format')!r}")
        model, tokenizer = load_checkpoint(path)
        options = dict(state["options"])
        options["betas"] = tuple(options["betas"])
        options.update(overrides)
        backend = cls(model, tokenizer, device=device, policy_version=int(state["policy_version"]), **options)
        backend.optimizer.load_state_dict(state["optimizer"])
        backend._generator.set_state(state["generator"])
        backend._steps = int(state["steps"])
        backend.extra_state = dict(state.get("extra_state") or {})
        return backend


def _chunks(indices: torch.Tensor, size: int) -> Iterator[torch.Tensor]:
    for start in range(0, len(indices), size):
        yield indices[start : start + size]


def _validate(options: TorchBackendOptions) -> None:
    check_common_options(options)
    if options.micro_batch_size < 1:
        raise ValueError("micro_batch_size must be at least 1")
