"""The RL options of a policy update: one type for the CLI, the trainer role, both policy backends
and the VERL config.

Pure and torch-free: parsing a trainer or VERL config, or ``agl-stream trainer --help``, imports
no torch. :class:`RLOptions` holds what both backends mean the same way; each backend's options
type (``TorchBackendOptions``, ``VerlBackendOptions``) adds its engine's fields.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

BackendKind = Literal["torch", "verl"]
"""The policy backend that trains: plain torch (small models, the CPU) or VERL's FSDP engine."""

RLAlgorithm = Literal["grpo", "ppo"]
"""The policy-gradient algorithm; it picks the default advantage estimator (:data:`ESTIMATOR_OF`)."""
ESTIMATOR_OF: dict[str, str] = {"grpo": "grpo", "ppo": "reinforce_plus_plus"}

CRITIC_FREE_ESTIMATORS = frozenset(
    {
        "grpo",
        "grpo_vectorized",
        "grpo_passk",
        "rloo",
        "rloo_vectorized",
        "opo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
    }
)
"""VERL's advantage estimators that need no critic values and no extra tensors (GAE needs values,
ReMax baselines): the ones the backends run."""

AdvantageLevel = Literal["rollout", "sample"]
ADVANTAGE_LEVELS: tuple[str, ...] = ("rollout", "sample")
"""One advantage per rollout (its samples share it), or one per sample (row)."""

LossAggMode = Literal[
    "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm", "rollout-mean"
]
VERL_LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
ROLLOUT_MEAN = "rollout-mean"
LOSS_AGG_MODES: tuple[str, ...] = (*VERL_LOSS_AGG_MODES, ROLLOUT_MEAN)
"""VERL's loss aggregations plus rollout-mean (each rollout weighs the same: agl_stream.training.levels)."""

OffPolicyCorrection = Literal["none", "truncate", "mask"]
OFF_POLICY_CORRECTIONS: tuple[str, ...] = ("none", "truncate", "mask")
ImportanceLevel = Literal["token", "sequence"]
IMPORTANCE_LEVELS: tuple[str, ...] = ("token", "sequence")

TRACKERS: tuple[str, ...] = ("tensorboard", "wandb", "mlflow")
"""The experiment trackers the trainer can record to (agl_stream.training.tracking)."""


def parse_trackers(text: str | None) -> tuple[str, ...]:
    """The tracker names in a comma-separated ``text`` ("tensorboard,wandb"), in order, once each;
    ValueError naming an unknown one."""
    names = tuple(dict.fromkeys(part.strip().lower() for part in (text or "").split(",") if part.strip()))
    unknown = [name for name in names if name not in TRACKERS]
    if unknown:
        raise ValueError(f"unknown tracker(s) {', '.join(unknown)}: choose from {', '.join(TRACKERS)}")
    return names


def resolve_estimator(algorithm: str, adv_estimator: str | None) -> str:
    """The VERL advantage estimator for ``algorithm`` ("grpo" | "ppo") or the explicit one; ValueError
    for an unknown algorithm or an estimator that would need a critic."""
    if algorithm not in ESTIMATOR_OF:
        raise ValueError(f"algorithm must be 'grpo' or 'ppo', not {algorithm!r}")
    estimator = adv_estimator or ESTIMATOR_OF[algorithm]
    if estimator not in CRITIC_FREE_ESTIMATORS:
        raise ValueError(
            f"advantage estimator {estimator!r} is not supported without a critic; "
            f"use one of {sorted(CRITIC_FREE_ESTIMATORS)}"
        )
    return estimator


@dataclass(frozen=True, kw_only=True)
class RLOptions:
    """The hyperparameters both policy backends share (saved with their checkpoints)."""

    lr: float
    algorithm: RLAlgorithm = "grpo"
    adv_estimator: str | None = None  # None: the algorithm's (grpo -> grpo, ppo -> reinforce_plus_plus)
    loss_mode: str = "vanilla"
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None  # None: clip_ratio
    clip_ratio_high: float | None = None  # None: clip_ratio
    clip_ratio_c: float = 3.0
    loss_agg_mode: LossAggMode = "token-mean"
    norm_adv_by_std_in_grpo: bool = True
    gamma: float = 1.0
    entropy_coeff: float = 0.0
    advantage_level: AdvantageLevel = "rollout"
    off_policy_correction: OffPolicyCorrection = "truncate"  # with rollout log-probs: agl_stream.training.off_policy
    rollout_is: ImportanceLevel = "token"
    rollout_is_threshold: float = 2.0  # the importance weights' cap
    ppo_epochs: int = 1
    mini_batch_size: int | None = None  # rows per optimizer step; None: the whole batch
    shuffle: bool = False
    max_grad_norm: float = 1.0
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    seed: int = 0

    @property
    def estimator(self) -> str:
        return resolve_estimator(self.algorithm, self.adv_estimator)


RL_OPTION_NAMES: frozenset[str] = frozenset(f.name for f in fields(RLOptions))
"""The names of :class:`RLOptions`' fields: what a trainer hands a new backend as it is."""


@dataclass
class TrainerOptions:
    """The trainer role's options (``agl-stream trainer``'s flags and ``--config`` keys, the VERL
    config's ``trainer_options``). The fields named as :class:`RLOptions` fields go to a new
    policy as they are; None leaves the backend's default (a resumed checkpoint keeps the options
    it saved)."""

    checkpoints: Path
    backend: BackendKind = "torch"  # agl_stream.training: open_backend
    initial_model: Path | None = None  # HF folder to start from; None: the tiny random policy
    model_name: str = "agl-tiny"
    proxy_endpoint: str | None = None  # published as the ProxyLLM runners call; None: none published
    lr: float = 1e-2  # the tiny policy learns at about 1e-2 (VERL's 1e-6 is for large models)
    algorithm: RLAlgorithm = "grpo"
    seed: int = 0
    max_prompt_length: int | None = None
    max_response_length: int | None = None
    max_batches: int | None = None  # stop after training this many (tests, scripted runs)
    batches_topic: str | None = None  # full topic name; None: <prefix>.triplet-batches (live data)
    adv_estimator: str | None = None
    norm_adv_by_std_in_grpo: bool | None = None
    clip_ratio: float | None = None
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float | None = None
    entropy_coeff: float | None = None
    ppo_epochs: int | None = None
    mini_batch_size: int | None = None
    loss_agg_mode: LossAggMode | None = None
    max_grad_norm: float | None = None
    advantage_level: AdvantageLevel | None = None
    off_policy_correction: OffPolicyCorrection | None = None  # with the engine's log-probs
    rollout_is: ImportanceLevel | None = None
    rollout_is_threshold: float | None = None  # the importance weights' cap
    track: str | None = None  # comma-separated TRACKERS: agl_stream.training.tracking
    track_dir: Path | None = None  # None: <checkpoints>/tracking
    track_project: str = "agl-stream"  # W&B project, MLflow experiment, TensorBoard folder
    track_run: str | None = None  # None: the checkpoints folder's name

    def backend_options(self) -> dict[str, Any]:
        """The :class:`RLOptions` fields set here: what a new policy backend is given."""
        given = {f.name: getattr(self, f.name) for f in fields(self) if f.name in RL_OPTION_NAMES}
        return {name: value for name, value in given.items() if value is not None}


TRAINER_OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in fields(TrainerOptions))
"""What a trainer ``--config`` file may set (with underscores or dashes)."""

CHOICES: dict[str, tuple[str, ...]] = {
    "backend": ("torch", "verl"),
    "algorithm": tuple(ESTIMATOR_OF),
    "loss_agg_mode": LOSS_AGG_MODES,
    "advantage_level": ADVANTAGE_LEVELS,
    "off_policy_correction": OFF_POLICY_CORRECTIONS,
    "rollout_is": IMPORTANCE_LEVELS,
}
"""The options whose values are names, and the names each takes."""
