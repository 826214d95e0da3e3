"""The ``verl`` policy backend: VERL's FSDP training engine behind the :class:`PolicyBackend` interface.

:class:`VerlFSDPBackend` drives ``verl.workers.engine.fsdp.FSDPEngineWithLMHead`` (VERL 0.9's engine
design; there is no ``DataParallelPPOActor`` any more) the way VERL's own workers do:

- **construction** as ``engine_workers.ActorRolloutRefWorker.init_model`` + ``TrainingWorker``: an
  ``HFModelConfig`` on an HF checkpoint folder, an ``FSDPActorConfig`` whose ``engine`` (an
  ``FSDPEngineConfig``, strategy ``fsdp2`` by default), ``optim`` (``FSDPOptimizerConfig``: AdamW,
  constant LR, clipping) and ``checkpoint`` configs build the engine through
  ``EngineRegistry.new("language_model", strategy, ...)`` on GPUs, then ``engine.initialize()``;
  the loss is ``partial(verl.workers.utils.losses.ppo_loss, config=actor_config)``;
- **input** as ``ray_trainer``'s ``_compute_old_log_prob`` / ``_update_actor``:
  ``DataProto.to_tensordict()`` -> ``verl.workers.utils.padding.left_right_2_no_padding`` (nested,
  padding-free rows) plus the non-tensor settings ``TrainingWorker.train_batch`` injects
  (dynamic batch size by token budget, remove-padding, temperature 1: the sampler's log-probs are raw);
  outputs come back through ``no_padding_2_padding``;
- **old log-probs** from ``engine.infer_batch`` in ``engine.eval_mode()`` (VERL's default: the
  trainer's own forward pass, not the rollout's numbers; ``recompute_old_log_probs=False`` uses the
  batch's ``old_log_probs`` when it has them);
- **advantages** with VERL's estimators through :func:`agl_stream.training.backend.compute_advantages`
  (the code the torch backend uses), computed on the whole batch before it is split;
- **update**: per mini-batch ``engine.train_batch(td, ppo_loss)`` in ``engine.train_mode()``
  (forward/backward over token-budget micro-batches, VERL's global-batch loss normalisation, clip,
  a non-finite gradient norm skips the step), then ``engine.lr_scheduler_step()`` once per batch.

Checkpoints (:meth:`VerlFSDPBackend.save`): the directory is an HF folder written by
:func:`agl_stream.policy.save_checkpoint` from the full weights gathered with
``engine.get_per_tensor_param()`` (the export VERL uses to send weights to vLLM), so
``agl_stream.policy.load_checkpoint`` and vLLM load it; beside it ``verl_engine/`` holds VERL's engine
checkpoint (``FSDPCheckpointManager``: per-rank model and optimizer shards, LR scheduler, RNG) and
``verl_state.json`` (options, policy version, steps, the caller's ``extra_state``), written last:
its presence makes the folder resumable with :meth:`VerlFSDPBackend.load`.

Distributed: one process per GPU under ``torchrun``. Every rank constructs the backend (the
process group is joined from torchrun's environment: gloo for CPU objects, NCCL for CUDA tensors).
Rank 0 is the *lead*: its :meth:`~VerlFSDPBackend.step`, :meth:`~VerlFSDPBackend.save` and
:meth:`~VerlFSDPBackend.log_probs` first broadcast the call (with the batch) over a gloo group; every
other rank calls :meth:`~VerlFSDPBackend.follow`, which replays those calls until the lead calls
:meth:`~VerlFSDPBackend.close`. So a trainer does Kafka on rank 0 only and, on other ranks, builds
the same backend and calls ``follow()`` (:func:`init_distributed` and :func:`broadcast_object` let
rank 0 tell the others which checkpoint to open first). Checkpoint folders must be writable by every
rank (one node: local disk). Each mini-batch is split across ranks (``tensor_split``, uneven shares
are fine); a batch with fewer rows than ranks is an :class:`InvalidBatchError`, raised on rank 0
before anything is broadcast. A rank that fails mid-step leaves the others in a collective until
the process group's timeout.

On the CPU (tests, this repo's machines): the engine runs unchanged in one process with a gloo
process group of world size 1 (an in-memory ``HashStore``: no port). VERL has no CPU platform
(``verl.plugin.platform`` registers CUDA, NPU and ROCm and falls back to CUDA, so
``get_device_id()`` calls ``torch.cuda.current_device()`` and fails without a GPU) and registers
the engine for ``cuda``/``npu`` only; the shim is
:class:`~agl_stream.training.verl_cpu.CpuPlatform`, installed with VERL's own
``verl.plugin.platform.set_platform`` before the engine module is imported (device ``"cpu"``,
backend gloo, ``current_device()`` = ``"cpu"`` so ``tensor.to(get_device_id())`` stays on the CPU,
no-op memory statistics), and the engine class instantiated directly. With it ``fsdp2`` trains on
the CPU and matches :class:`~agl_stream.training.TorchPolicyBackend` (same log-probs, same update).
``strategy="fsdp"`` (FSDP1) cannot run on the CPU: ``FullyShardedDataParallel(...,
sync_module_states=True)`` in ``FSDPEngine._build_fsdp_module`` raises "The module has CPU
parameters or buffers when `sync_module_states=True`"; it is for GPUs only. ``flash_attention_2`` is
used when ``flash_attn`` is installed, else ``sdpa`` (transformers detects the packed rows of
remove-padding from the position ids, so both give the same log-probs).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict  # type: ignore[import-untyped]
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase
from verl import DataProto
from verl.utils import tensordict_utils as tu
from verl.utils.metric import Metric
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

from agl_stream.policy import save_checkpoint
from agl_stream.policy.model import _fsync_tree
from agl_stream.rl_options import ROLLOUT_MEAN
from agl_stream.training.backend import (
    advantages_for,
    off_policy_metrics,
    old_log_probs_and_weights,
    prepare_batch,
    row_versions,
    step_metrics,
)
from agl_stream.training.data import InvalidBatchError
from agl_stream.training.levels import policy_loss_mode, rollout_index, rollout_mean_weights
from agl_stream.training.verl_engine import VerlBackendOptions, build_engine, check_options
from agl_stream.training.verl_ranks import Device, Ranks, broadcast_object, init_distributed, resolve_device

VERL_STATE_FILE = "verl_state.json"
ENGINE_DIR = "verl_engine"

# What the engine reads of a batch; left_right_2_no_padding turns the first four into nested rows.
_MODEL_KEYS = ("input_ids", "attention_mask", "position_ids", "response_mask", "prompts", "responses")
_TRAIN_KEYS = (*_MODEL_KEYS, "old_log_probs", "advantages")


class VerlFSDPBackend:
    """Trains the HF causal LM in ``model_dir`` with VERL's FSDP engine (see the module docstring).

    ``options`` are :class:`VerlBackendOptions` fields (``lr`` is required). ``device``: "auto"
    (CUDA when torch sees a GPU, else the CPU), "cuda" or "cpu". Exposes ``tokenizer``, ``model``
    (the engine's FSDP-wrapped module; ``model.config`` is the HF config) and ``policy_version``.
    One step at a time; on several ranks see :meth:`follow`.
    """

    def __init__(
        self, model_dir: str | Path, *, device: Device = "auto", policy_version: int = 0, **options: Any
    ) -> None:
        opts = VerlBackendOptions(**options)
        check_options(opts)
        self.options = opts
        self.device = resolve_device(device)
        self._ranks = Ranks(self.device)
        self._policy_version = policy_version
        self._steps = 0
        self.extra_state: dict[str, Any] = {}  # what the last save() was given, after load()
        self._generator = torch.Generator().manual_seed(opts.seed)
        self.model_config, self.actor_config, self.engine = build_engine(model_dir, opts, self.device)
        # Saved policies carry the folder's own config, not the engine's overrides (an
        # attn_implementation of flash_attention_2 would break loading where flash_attn is missing).
        self._export_config = AutoConfig.from_pretrained(str(self.model_config.local_hf_config_path))
        self._loss_fn = partial(ppo_loss, config=self.actor_config)
        self.tokenizer: PreTrainedTokenizerBase = self.model_config.tokenizer

    @property
    def policy_version(self) -> int:
        return self._policy_version

    @property
    def model(self) -> Any:
        """The engine's module: the HF model sharded in place by FSDP2 (FSDP1: its wrapper, which
        forwards attributes); ``model.config`` is the HF config."""
        return self.engine.module

    @property
    def rank(self) -> int:
        return self._ranks.rank

    @property
    def world_size(self) -> int:
        return self._ranks.size

    # -- the calls rank 0 makes and the other ranks replay ---------------------------------

    def step(self, data: DataProto) -> dict[str, float]:
        """Train on ``data``; the metrics of :meth:`TorchPolicyBackend.step
        <agl_stream.training.TorchPolicyBackend.step>` (``grad_norm`` is VERL's, before clipping).
        Raises :class:`InvalidBatchError` for a batch that cannot be trained on (before any other
        rank is told about it)."""
        batch, advantages, rollouts = self._inputs(data)
        self._lead("step", data)
        return self._train(data, batch, advantages, rollouts)

    def log_probs(self, data: DataProto) -> torch.Tensor:
        """The current policy's log-probs of ``data``'s responses, (B, R) on the CPU, 0 at padding."""
        batch = self._checked(data)
        self._lead("log_probs", data)
        return self._log_probs(batch)

    def save(self, directory: str | Path, *, optimizer: bool = True, extra_state: dict[str, Any] | None = None) -> None:
        """Write the policy as an HF folder (atomic) and then, unless ``optimizer=False``, VERL's
        engine checkpoint (``verl_engine/``) and ``verl_state.json`` (atomic, last). ``extra_state``
        (JSON values) comes back as :attr:`extra_state` from :meth:`load`. A crash between the two
        leaves a loadable policy without trainer state. An existing ``directory`` is replaced."""
        self._lead("save", str(directory), optimizer, dict(extra_state or {}))
        self._save(Path(directory), optimizer, dict(extra_state or {}))

    def follow(self) -> None:
        """On ranks other than 0: replay the lead's calls until it calls :meth:`close`."""
        if self._ranks.rank == 0:
            raise RuntimeError("follow() is for ranks other than 0; rank 0 calls step/save and then close()")
        while True:
            command = broadcast_object(None)
            kind = command[0]
            if kind == "stop":
                return
            if kind == "step":
                # The lead checked the batch before sending it: the same checks pass here.
                self._train(command[1], *self._inputs(command[1]))
            elif kind == "log_probs":
                self._log_probs(self._checked(command[1]))
            elif kind == "save":
                self._save(Path(command[1]), command[2], command[3])
            else:
                raise RuntimeError(f"unknown command from rank 0: {kind!r}")

    def close(self) -> None:
        """On rank 0: release the other ranks from :meth:`follow` (a no-op on one rank)."""
        self._lead("stop")

    def _lead(self, *command: Any) -> None:
        if self._ranks.rank == 0:
            broadcast_object(command)

    # -- training ---------------------------------------------------------------------------

    def _checked(self, data: DataProto) -> dict[str, torch.Tensor]:
        batch = prepare_batch(data)
        rows = batch["input_ids"].shape[0]
        if rows < self._ranks.size:
            raise InvalidBatchError(f"a batch of {rows} rows cannot be split over {self._ranks.size} ranks")
        return batch

    def _inputs(self, data: DataProto) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
        """The checked tensors, their advantages and rollout index (all that can reject a batch);
        every rank computes the same advantages over the whole batch before it is split."""
        batch = self._checked(data)
        rollouts = rollout_index(data)
        return batch, advantages_for(data, batch, self.options, rollouts), rollouts

    def _train(
        self, data: DataProto, batch: dict[str, torch.Tensor], advantages: torch.Tensor, rollouts: torch.Tensor
    ) -> dict[str, float]:
        started = time.perf_counter()
        options = self.options
        version_before = self._policy_version
        old_log_probs, is_weights, correction, recompute = old_log_probs_and_weights(batch, options, self._log_probs)
        tensors = {**batch, "advantages": advantages, "old_log_probs": old_log_probs}

        rows = batch["input_ids"].shape[0]
        response_mask = batch["response_mask"]
        sums: dict[str, float] = {}
        updates = skipped = 0
        for _epoch in range(options.ppo_epochs):
            order = torch.randperm(rows, generator=self._generator) if options.shuffle else torch.arange(rows)
            for indices in _mini_batches(order, options.mini_batch_size or rows, self._ranks.size):
                mini_tokens = int(response_mask[indices].sum())
                if mini_tokens == 0:
                    continue  # no token of this mini-batch is in the loss (all ranks see the same)
                mini_rows = int((response_mask[indices].sum(dim=1) > 0).sum())
                weights = self._mini_batch_weights(response_mask, indices, is_weights, rollouts)
                step_tensors = tensors if weights is None else {**tensors, "rollout_is_weights": weights}
                result_sums = self._update(step_tensors, indices, mini_rows)
                for key, value in result_sums.items():
                    sums[key] = sums.get(key, 0.0) + value
                if math.isfinite(result_sums["grad_norm"]):
                    updates += 1
                else:
                    skipped += 1
        lr = float(self.engine.lr_scheduler_step())

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
            lr=lr,
            policy_version=self._policy_version,
            world_size=float(self._ranks.size),
            **off_policy_metrics(row_versions(data), version_before, rollouts, correction),
        )

    def _mini_batch_weights(
        self,
        response_mask: torch.Tensor,
        indices: torch.Tensor,
        is_weights: torch.Tensor | None,
        rollouts: torch.Tensor,
    ) -> torch.Tensor | None:
        """VERL's ``rollout_is_weights`` for the mini-batch ``indices`` (B, R; rows outside it 0): the
        importance weights, times the rollout-mean weights over the whole mini-batch (before it is
        split over ranks, so the ranks' token sums add up to the mini-batch's rollout mean)."""
        rollout_weights = None
        if self.options.loss_agg_mode == ROLLOUT_MEAN:
            rollout_weights = torch.zeros(response_mask.shape, dtype=torch.float32)
            rollout_weights[indices] = rollout_mean_weights(response_mask[indices], rollouts[indices])
        _mode, weights = policy_loss_mode(self.options.loss_agg_mode, is_weights, rollout_weights)
        return None if weights is None else weights.float()

    def _update(self, tensors: dict[str, torch.Tensor], indices: torch.Tensor, mini_rows: int) -> dict[str, float]:
        """One optimizer step on the mini-batch ``indices``; this rank trains on its share of it."""
        keys = (*_TRAIN_KEYS, "rollout_is_weights") if "rollout_is_weights" in tensors else _TRAIN_KEYS
        share = self._ranks.share(indices)
        td = self._engine_input(tensors, share, keys, infer=False)
        # ray_trainer._update_actor's settings; global_batch_size counts the rows in the loss (as the
        # torch backend does), so seq-mean losses weigh the same rows.
        tu.assign_non_tensor(td, calculate_entropy=True, compute_loss=True, global_batch_size=mini_rows)
        with self.engine.train_mode():
            output = self.engine.train_batch(td, loss_function=self._loss_fn)
        raw = output["metrics"]
        grad_norm = float(raw.pop("grad_norm"))
        values = {key: float(metric.aggregate()) for key, metric in raw.items() if isinstance(metric, Metric)}
        entropy = values.get("actor/entropy_loss", 0.0)
        if self.options.loss_agg_mode == ROLLOUT_MEAN:
            # VERL aggregated the entropy as token-sum (the carrier mode, times dp_size): report its token mean.
            entropy /= self._ranks.size * max(1.0, float(tensors["response_mask"][share].sum()))
        local = {
            # The micro-batch losses are scaled to the global mini-batch: they add up (TrainingWorker sums them).
            "loss": float(sum(output["loss"])),
            "pg_loss": values.get("actor/pg_loss", 0.0),
            "pg_clipfrac": values.get("actor/pg_clipfrac", 0.0),
            "pg_clipfrac_lower": values.get("actor/pg_clipfrac_lower", 0.0),
            "ppo_kl": values.get("actor/ppo_kl", 0.0),
            "entropy": entropy,
        }
        result = self._ranks.mean(local)
        result["grad_norm"] = grad_norm  # already global: FSDP clips over all shards
        return result

    def _log_probs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        rows = batch["input_ids"].shape[0]
        td = self._engine_input(batch, self._ranks.share(torch.arange(rows)), _MODEL_KEYS, infer=True)
        tu.assign_non_tensor(td, calculate_entropy=False, compute_loss=False)
        with self.engine.eval_mode():
            output = self.engine.infer_batch(td, loss_function=None)
        return self._ranks.gather(no_padding_2_padding(output["model_output"]["log_probs"], td).float().cpu())

    def _engine_input(
        self, tensors: dict[str, torch.Tensor], rows: torch.Tensor, keys: tuple[str, ...], *, infer: bool
    ) -> TensorDict:
        """The rows ``rows`` as the engine's padding-free TensorDict (ray_trainer's conversion)."""
        selected = DataProto.from_dict(tensors={key: tensors[key][rows] for key in keys})
        td = left_right_2_no_padding(selected.to_tensordict())
        config = self.actor_config.fsdp_config
        # What TrainingWorker.train_batch / infer_batch inject from the engine config.
        tu.assign_non_tensor(
            td,
            use_remove_padding=self.options.use_remove_padding,
            use_dynamic_bsz=True,
            max_token_len_per_gpu=config.infer_max_token_len_per_gpu if infer else config.max_token_len_per_gpu,
            use_fused_kernels=False,
            temperature=1.0,
            pad_token_id=int(self.tokenizer.pad_token_id or 0),
        )
        return td

    # -- checkpoints ------------------------------------------------------------------------

    def _save(self, target: Path, optimizer: bool, extra_state: dict[str, Any]) -> None:
        state_dict = self._full_state_dict()  # every rank takes part in the gather
        if self._ranks.rank == 0:
            save_checkpoint(self._hf_model(state_dict), self.tokenizer, target)  # type: ignore[arg-type]
        del state_dict
        self._ranks.barrier()
        if not optimizer:
            return
        staging = target / broadcast_object(f".{ENGINE_DIR}.tmp-{uuid.uuid4().hex[:8]}")  # one for all ranks' shards
        try:
            self.engine.save_checkpoint(str(staging), global_step=self._steps)
            self._ranks.barrier()
            if self._ranks.rank == 0:
                _fsync_tree(staging)
                final = target / ENGINE_DIR
                if final.exists():
                    shutil.rmtree(final)
                staging.rename(final)
                state = {
                    "format": 1,
                    "backend": "verl",
                    "policy_version": self._policy_version,
                    "steps": self._steps,
                    "world_size": self._ranks.size,
                    "options": asdict(self.options),
                    "generator": self._generator.get_state().numpy().tobytes().hex(),
                    "extra_state": extra_state,
                }
                _write_atomic(target / VERL_STATE_FILE, json.dumps(state, indent=2) + "\n")
        finally:
            if self._ranks.rank == 0 and staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
        self._ranks.barrier()

    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full HF-named weights on rank 0's CPU (empty on other ranks)."""
        params, _peft = self.engine.get_per_tensor_param()
        state: dict[str, torch.Tensor] = {}
        for name, tensor in params:
            if self._ranks.rank == 0:
                state[name] = tensor.detach().to("cpu", dtype=torch.float32).clone()
        return state

    def _hf_model(self, state_dict: dict[str, torch.Tensor]) -> PreTrainedModel:
        # Built on the meta device and given the gathered tensors: no second random initialisation.
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(self._export_config, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(state_dict, strict=False, assign=True)
        if getattr(self._export_config, "tie_word_embeddings", False):
            model.tie_weights()
            missing = [key for key in missing if not key.endswith("lm_head.weight")]
        if missing or unexpected:
            raise RuntimeError(f"the engine's weights do not fit the HF model: missing {missing}, extra {unexpected}")
        return model

    @classmethod
    def load(cls, directory: str | Path, *, device: Device = "auto", **overrides: Any) -> VerlFSDPBackend:
        """Resume from what :meth:`save` wrote: the engine is built on the folder's HF weights and then
        loads VERL's engine checkpoint (weights, optimizer, LR scheduler, RNG); options, policy version,
        step count and ``extra_state`` come back. ``overrides`` replace saved options. A folder without
        ``verl_state.json`` raises FileNotFoundError (build ``VerlFSDPBackend(folder, ...)`` instead);
        one saved by a different number of ranks raises ValueError (VERL's FSDP shards are per rank)."""
        path = Path(directory)
        state_file = path / VERL_STATE_FILE
        if not state_file.is_file():
            raise FileNotFoundError(f"no {VERL_STATE_FILE} in {path}: it holds a policy but no verl trainer state")
        state = json.loads(state_file.read_text())
        if state.get("format") != 1 or state.get("backend") != "verl":
            raise ValueError(f"{state_file}: unknown trainer state {state.get('backend')!r} {state.get('format')!r}")
        options = dict(state["options"])
        options["betas"] = tuple(options["betas"])
        options.update(overrides)
        backend = cls(path, device=device, policy_version=int(state["policy_version"]), **options)
        if int(state["world_size"]) != backend.world_size:
            raise ValueError(
                f"{path} was saved by {state['world_size']} ranks, this is {backend.world_size}: VERL's FSDP "
                "checkpoint is per rank; build VerlFSDPBackend(folder, ...) to start from its weights instead"
            )
        backend.engine.load_checkpoint(str(path / ENGINE_DIR), del_local_after_load=False)
        backend._steps = int(state["steps"])
        backend._generator.set_state(torch.frombuffer(bytearray.fromhex(state["generator"]), dtype=torch.uint8))
        backend.extra_state = dict(state.get("extra_state") or {})
        return backend


def open_tiny_verl_backend(*, seed: int = 0, device: Device = "auto", **options: Any) -> VerlFSDPBackend:
    """A :class:`VerlFSDPBackend` on the tiny random policy (:func:`agl_stream.policy.build_model`)."""
    from agl_stream.policy import build_model, build_tokenizer

    with tempfile.TemporaryDirectory(prefix="agl-verl-policy-") as folder:
        # Every rank builds the same weights from the seed; the engine reads them once, in initialize().
        save_checkpoint(build_model(seed=seed), build_tokenizer(), Path(folder) / "policy")
        return VerlFSDPBackend(Path(folder) / "policy", device=device, seed=seed, **options)


def _mini_batches(order: torch.Tensor, size: int, ranks: int) -> Iterator[torch.Tensor]:
    """``order`` in chunks of ``size`` rows; a last chunk too small to give every rank a row joins
    the one before it (every rank must run the same number of engine steps)."""
    chunks = list(order.split(size))
    if len(chunks) > 1 and len(chunks[-1]) < ranks:
        chunks[-2:] = [torch.cat(chunks[-2:])]
    yield from chunks


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


__all__ = [
    "ENGINE_DIR",
    "VERL_STATE_FILE",
    "VerlBackendOptions",
    "VerlFSDPBackend",
    "broadcast_object",
    "init_distributed",
    "open_tiny_verl_backend",
]
