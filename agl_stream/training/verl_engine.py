"""The ``verl`` backend's options and the VERL engine they build, as
``engine_workers.ActorRolloutRefWorker.init_model`` + ``TrainingWorker`` build it (see
``verl_backend.py``'s docstring): the model, optimizer, checkpoint, engine and actor configs, and
the engine registered for the strategy (on the CPU, the engine class itself)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from verl.trainer.config import CheckpointConfig
from verl.workers.config import FSDPActorConfig, FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig

from agl_stream.rl_options import ROLLOUT_MEAN, RLOptions
from agl_stream.training.backend import actor_options, check_common_options

Strategy = Literal["fsdp2", "fsdp"]

_FP32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}


@dataclass(frozen=True, kw_only=True)
class VerlBackendOptions(RLOptions):
    """The hyperparameters of a :class:`~agl_stream.training.verl_backend.VerlFSDPBackend` (saved
    with its checkpoints).

    The shared :class:`~agl_stream.rl_options.RLOptions` and this engine's own.
    Engine fields: ``max_token_len_per_gpu`` is VERL's ``ppo_max_token_len_per_gpu`` (micro-batches
    are packed up to this many tokens per GPU: dynamic batch size); ``mixed_precision`` None is
    VERL's default on GPUs (bf16 compute, fp32 master weights and reduction) and fp32 on the CPU;
    ``attn_implementation`` None is ``flash_attention_2`` when ``flash_attn`` is installed, else
    ``sdpa``; ``use_torch_compile`` compiles VERL's entropy kernel (VERL's default; off here: the first
    step would pay the compilation, and it needs triton).
    """

    max_token_len_per_gpu: int = 16384
    recompute_old_log_probs: bool = True
    strategy: Strategy = "fsdp2"
    mixed_precision: bool | None = None
    use_remove_padding: bool = True
    attn_implementation: str | None = None
    gradient_checkpointing: bool = False
    use_torch_compile: bool = False


def check_options(options: VerlBackendOptions) -> None:
    check_common_options(options)
    if options.loss_agg_mode == ROLLOUT_MEAN and options.entropy_coeff != 0.0:
        raise ValueError(
            "loss_agg_mode 'rollout-mean' with an entropy bonus is not supported by the verl backend: VERL's "
            "ppo_loss aggregates the entropy with its own mode (token-sum carries rollout-mean here), not the "
            "rollout weights; set entropy_coeff 0 or use the torch backend"
        )
    if options.max_token_len_per_gpu < 1:
        raise ValueError("max_token_len_per_gpu must be at least 1")
    if options.strategy not in ("fsdp2", "fsdp"):
        raise ValueError(f"strategy must be 'fsdp2' or 'fsdp', not {options.strategy!r}")


def build_engine(
    model_dir: str | Path, opts: VerlBackendOptions, device: Literal["cuda", "cpu"]
) -> tuple[HFModelConfig, FSDPActorConfig, Any]:
    """The model config, the actor config (its ``fsdp_config`` is the engine's) and the engine,
    initialized, for the HF checkpoint folder ``model_dir``."""
    on_gpu = device == "cuda"
    attn = opts.attn_implementation or (
        "flash_attention_2" if on_gpu and importlib.util.find_spec("flash_attn") else "sdpa"
    )
    mixed = on_gpu if opts.mixed_precision is None else opts.mixed_precision
    model_config = HFModelConfig(
        path=str(Path(model_dir).resolve()),
        override_config={"attn_implementation": attn},
        use_remove_padding=opts.use_remove_padding,
        enable_gradient_checkpointing=opts.gradient_checkpointing,
    )
    optimizer_config = FSDPOptimizerConfig(
        lr=opts.lr,
        weight_decay=opts.weight_decay,
        betas=opts.betas,
        clip_grad=opts.max_grad_norm,
        lr_scheduler_type="constant",
    )
    checkpoint_config = CheckpointConfig()
    actor_config = FSDPActorConfig(
        strategy=opts.strategy,
        use_dynamic_bsz=True,
        ppo_max_token_len_per_gpu=opts.max_token_len_per_gpu,
        ppo_infer_max_token_len_per_gpu=opts.max_token_len_per_gpu,
        data_loader_seed=opts.seed,
        use_torch_compile=opts.use_torch_compile,
        use_remove_padding=opts.use_remove_padding,
        # rollout-mean rides on token-sum with per-token weights in rollout_is_weights (levels.py).
        **actor_options(opts),
        optim=optimizer_config,
        checkpoint=checkpoint_config,
        fsdp_config=FSDPEngineConfig(
            strategy=opts.strategy,
            model_dtype="fp32",
            mixed_precision=None if mixed else _FP32,
            use_torch_compile=opts.use_torch_compile,
            seed=opts.seed,
        ),
        model_config=model_config,
    )
    # As ActorRolloutRefWorker.init_model fills the engine config from the actor's
    # (FSDPActorConfig makes fsdp_config its engine config).
    engine_config = actor_config.fsdp_config
    engine_config.use_dynamic_bsz = True
    engine_config.max_token_len_per_gpu = opts.max_token_len_per_gpu
    engine_config.infer_max_token_len_per_gpu = opts.max_token_len_per_gpu
    engine_config.use_remove_padding = opts.use_remove_padding
    # Imported here: the engine module reads VERL's platform when it is imported (after the CPU shim).
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    configs: dict[str, Any] = {
        "model_config": model_config,
        "engine_config": engine_config,
        "optimizer_config": optimizer_config,
        "checkpoint_config": checkpoint_config,
    }
    if device == "cpu":
        # VERL registers the engine for cuda/npu only; on the CPU the class itself is the engine.
        engine = FSDPEngineWithLMHead(**configs)
    else:
        engine = EngineRegistry.new(model_type="language_model", backend=opts.strategy, **configs)
    engine.initialize()
    return model_config, actor_config, engine
