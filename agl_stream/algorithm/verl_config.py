"""The VERL algorithm's config: the seed's VERL config keys -> what the streaming path runs.

Pure: no I/O. :func:`parse_verl_config` reads a config in the seed's shape (nested mappings,
dotted keys, or both) into a :class:`VerlConfig`; :func:`verl_roles` turns one into the
processes the run needs (``agl-stream`` arguments for the triplet builder, batcher, trainer,
inference server and LLM proxy); :func:`train_rounds` and :func:`val_requests` say which
rollouts to enqueue. :mod:`agl_stream.algorithm.verl` is the shell that runs them.

What maps to what (the seed's VERL runs a synchronous PPO loop; here each key lands on the role
that does that job):

==============================================  ==============================================
``data.train_batch_size`` (tasks per step)      a round of tasks; a batch holds up to
                                                ``train_batch_size * rollout.n`` rollouts (whole
                                                groups of one agl.triplets partition; a short
                                                one goes out after the batcher's linger)
``actor_rollout_ref.rollout.n``                 samples per task: the batcher's GRPO group size
``data.max_prompt_length`` / ``max_response_    the trainer's truncation; the response length
length``                                        is also the inference server's default limit
``data.shuffle`` / ``data.seed``                the order of the tasks in each epoch
``actor_rollout_ref.model.path``                the trainer's initial model and the served one
``actor_rollout_ref.actor.optim.lr``,           the trainer's policy backend options
``clip_ratio[_low|_high|_c]``, ``entropy_coeff``,
``ppo_epochs``, ``ppo_mini_batch_size`` (tasks),
``loss_agg_mode``, ``grad_clip``;
``algorithm.adv_estimator`` (critic-free only),
``algorithm.norm_adv_by_std_in_grpo``
``algorithm.rollout_correction.rollout_is``     the trainer's importance weights against the
(None, token, sequence) and ``rollout_is_       engine's logprobs: None is
threshold`` (a number)                          --off-policy-correction none, else the level
                                                (truncated IS, the trainer's default, at 2.0)
``agentlightning.trace_aggregator.level``       the triplet builder's --aggregation; without it
                                                trajectory (the adapter's own setting wins)
``trainer.total_epochs``,                       how many rounds the run enqueues
``trainer.total_training_steps``
``trainer.test_freq``, ``val_before_train``,    when the validation set runs (every N policy
``val_only``                                    versions), mode "val": never trained on
``trainer.default_local_dir``                   the trainer's checkpoints (it resumes there)
``trainer.logger`` (console, tensorboard,       experiment tracking: the trainer's --track (each
wandb, mlflow), ``project_name``,               step) and the run's validations, in the same
``experiment_name``                             project; docs/tracking.md
==============================================  ==============================================

KL terms need a reference policy, which neither trainer backend has: ``use_kl_in_reward``,
``use_kl_loss`` and the KL coefficients are accepted only when they switch KL off (False / 0),
and refused otherwise. Every other key is refused: a VERL key with the reason it does not apply
here (hardware placement, Ray, vLLM's rollout engine, loggers, a critic, reward models...), any
other key as unknown (with the nearest applicable key when it looks like a typo).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from agl_stream.algorithm.base import RoleSpec
from agl_stream.algorithm.datasets import epoch_orders
from agl_stream.domain.adapter import AdapterConfig
from agl_stream.errors import AlgorithmConfigError, ConfigError
from agl_stream.rl_options import CRITIC_FREE_ESTIMATORS, LOSS_AGG_MODES, TRACKERS, BackendKind

InferenceEngine = Literal["cpu", "vllm"]

DEFAULT_AGGREGATION = "trajectory"
"""The trace aggregation of a VERL run when neither agentlightning.trace_aggregator.level nor the
adapter's own ``aggregation`` says (the seed's and the adapter's default is transition)."""

_CORRECTION = "algorithm.rollout_correction."


def _importance_level(value: Any) -> str | None:
    if value is None or value in ("token", "sequence"):
        return None
    return f"{value!r} is not one of None (no importance weights), 'token', 'sequence'"


def _importance_cap(value: Any) -> str | None:
    if isinstance(value, str):
        return (
            f"{value!r}: only a number (a cap: truncated IS) applies here; IcePop's 'lower_upper' bounds have no "
            "counterpart (the trainer's --off-policy-correction mask zeroes weights over the cap)"
        )
    return _float(above=0.0)(value)


NO_KL = (
    "KL terms need a reference policy, and neither trainer backend (torch, verl FSDP) keeps one; "
    "remove the key or switch KL off (False / 0)"
)

# -- what a value may be ----------------------------------------------------------------------

Check = Callable[[Any], str | None]  # None: fine; else what is wrong


def _int(minimum: int | None = None, *, nullable: bool = False) -> Check:
    def check(value: Any) -> str | None:
        if value is None and nullable:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            return f"must be an integer{' or None' if nullable else ''}, got {value!r}"
        if minimum is not None and value < minimum:
            return f"must be at least {minimum}, got {value}"
        return None

    return check


def _float(*, above: float | None = None, at_least: float | None = None) -> Check:
    def check(value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return f"must be a finite number, got {value!r}"
        if above is not None and value <= above:
            return f"must be above {above}, got {value}"
        if at_least is not None and value < at_least:
            return f"must be at least {at_least}, got {value}"
        return None

    return check


def _bool(value: Any) -> str | None:
    return None if isinstance(value, bool) else f"must be true or false, got {value!r}"


def _text(value: Any) -> str | None:
    return None if isinstance(value, str) and value else f"must be a non-empty string, got {value!r}"


def _loggers(value: Any) -> str | None:
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        return f"must be a list of logger names, got {value!r}"
    unknown = [n for n in names if n not in ("console", *TRACKERS)]
    if unknown:
        return (
            f"{unknown} do not apply here: console, {', '.join(TRACKERS)} do (the trainer's --track); every step "
            "is also an agl.trainer-metrics record (ClickHouse table trainer_steps)"
        )
    return None


def _one_of(choices: Collection[str], why: str = "") -> Check:
    def check(value: Any) -> str | None:
        if value in choices:
            return None
        return f"{value!r} is not one of {sorted(choices)}{why}"

    return check


APPLIED: dict[str, Check] = {
    "data.train_batch_size": _int(1),
    "data.max_prompt_length": _int(1, nullable=True),
    "data.max_response_length": _int(1, nullable=True),
    "data.shuffle": _bool,
    "data.seed": _int(nullable=True),
    "actor_rollout_ref.rollout.n": _int(1),
    "actor_rollout_ref.model.path": _text,
    "actor_rollout_ref.actor.optim.lr": _float(above=0.0),
    "actor_rollout_ref.actor.clip_ratio": _float(above=0.0),
    "actor_rollout_ref.actor.clip_ratio_low": _float(at_least=0.0),
    "actor_rollout_ref.actor.clip_ratio_high": _float(at_least=0.0),
    "actor_rollout_ref.actor.clip_ratio_c": _float(above=1.0),
    "actor_rollout_ref.actor.entropy_coeff": _float(),
    "actor_rollout_ref.actor.ppo_epochs": _int(1),
    "actor_rollout_ref.actor.ppo_mini_batch_size": _int(1),
    "actor_rollout_ref.actor.loss_agg_mode": _one_of(LOSS_AGG_MODES),
    "actor_rollout_ref.actor.grad_clip": _float(above=0.0),
    "algorithm.adv_estimator": _one_of(
        CRITIC_FREE_ESTIMATORS, " (estimators that need a critic, such as gae, are not supported: no critic here)"
    ),
    "algorithm.norm_adv_by_std_in_grpo": _bool,
    # VERL's rollout correction (decoupled mode): the trainer's importance weights against the engine's logprobs.
    f"{_CORRECTION}rollout_is": _importance_level,
    f"{_CORRECTION}rollout_is_threshold": _importance_cap,
    "trainer.total_epochs": _int(1),
    "trainer.total_training_steps": _int(1, nullable=True),
    "trainer.test_freq": _int(),
    "trainer.val_before_train": _bool,
    "trainer.val_only": _bool,
    "trainer.default_local_dir": _text,
    # Experiment tracking (agl_stream.training.tracking): the trainer's steps, the run's validations.
    "trainer.logger": _loggers,
    "trainer.project_name": _text,
    "trainer.experiment_name": _text,
    # Agent Lightning's trace aggregation: the triplet builder's --aggregation (trajectory merges
    # consecutive calls into one sample whose inserted tokens the trainer masks out of the loss).
    "agentlightning.trace_aggregator.level": _one_of(frozenset({"transition", "trajectory"})),
}
"""Keys that set something here, with the check of their value."""

NEUTRAL: dict[str, tuple[Callable[[Any], bool], str]] = {
    "algorithm.use_kl_in_reward": (lambda v: v is False, NO_KL),
    "algorithm.kl_ctrl.kl_coef": (lambda v: v == 0 and not isinstance(v, bool), NO_KL),
    "actor_rollout_ref.actor.use_kl_loss": (lambda v: v is False, NO_KL),
    "actor_rollout_ref.actor.kl_loss_coef": (lambda v: v == 0 and not isinstance(v, bool), NO_KL),
    "trainer.critic_warmup": (
        lambda v: v == 0 and not isinstance(v, bool),
        "no critic is trained here (critic-free estimators only); 0 or remove it",
    ),
    "data.val_batch_size": (
        lambda v: v is None,
        "each validation runs the whole val_dataset at once (the seed recommends None too); None or remove it",
    ),
    f"{_CORRECTION}rollout_is_batch_normalize": (
        lambda v: v is False,
        "the importance weights are used as they are (capped or masked), not normalised per batch",
    ),
    f"{_CORRECTION}rollout_rs": (
        lambda v: v is None,
        "no rejection sampling here: the trainer's --off-policy-correction mask zeroes weights over the cap",
    ),
    f"{_CORRECTION}rollout_rs_threshold": (lambda v: v is None, "no rejection sampling here (rollout_rs)"),
    f"{_CORRECTION}bypass_mode": (
        lambda v: v is False,
        "the trainer recomputes its old log-probs (decoupled mode) whenever it corrects; "
        "rollout_is: null switches the correction off",
    ),
    f"{_CORRECTION}loss_type": (lambda v: v == "ppo_clip", "the policy loss is PPO-clip (bypass mode does not apply)"),
    "data.filter_overlong_prompts": (
        lambda v: v is False,
        "prompts are never filtered here: data.max_prompt_length truncates them; false or remove it",
    ),
}
"""Keys accepted only with the value that changes nothing (what the streaming path does anyway);
another value is refused with the reason."""

_TRAINER_ROLE = (
    "the trainer role's policy backend sets it itself (run that role with --backend verl under torchrun for FSDP)"
)

NOT_APPLICABLE: tuple[tuple[str, str], ...] = (
    ("algorithm.kl_ctrl", NO_KL),
    ("actor_rollout_ref.actor.kl_loss_type", NO_KL),
    ("actor_rollout_ref.ref", "there is no reference policy here (no KL term)"),
    (
        "actor_rollout_ref.rollout",
        "rollouts are sampled by the inference role through the LLM proxy, with the agent's own sampling "
        "parameters; of the rollout settings only actor_rollout_ref.rollout.n (the group size) applies",
    ),
    ("actor_rollout_ref.actor.optim", "of the optimizer settings only the learning rate (optim.lr) applies"),
    ("actor_rollout_ref.actor", f"an engine setting of VERL's actor worker: {_TRAINER_ROLE}"),
    ("actor_rollout_ref.model", f"of the model settings only the path applies: {_TRAINER_ROLE}"),
    ("actor_rollout_ref", f"a setting of VERL's workers: {_TRAINER_ROLE}"),
    ("critic", "no critic is trained here: the advantage estimators are critic-free (grpo, rloo, ...)"),
    ("reward_model", "rewards come from the agent's reward spans (emit_reward, or the rollout's return value)"),
    ("reward", "rewards come from the agent's reward spans (emit_reward, or the rollout's return value)"),
    ("custom_reward_function", "rewards come from the agent's reward spans (emit_reward, or the rollout's return)"),
    ("trainer.n_gpus_per_node", "processes are placed per role: run the trainer role under torchrun for GPUs"),
    ("trainer.nnodes", "processes are placed per role: run the trainer role under torchrun for GPUs"),
    ("trainer.device", "processes are placed per role: run the trainer role under torchrun for GPUs"),
    ("trainer.save_freq", "every policy version is saved as a checkpoint (the inference role loads each one)"),
    ("trainer.resume_mode", "the trainer role resumes from trainer.default_local_dir by itself (progress.json)"),
    ("trainer.resume_from_path", "the trainer role resumes from trainer.default_local_dir by itself"),
    ("trainer", "a setting of VERL's synchronous trainer loop, which the streaming path replaces"),
    ("ray_kwargs", "no Ray here: every role is a process of its own"),
    ("ray_init", "no Ray here: every role is a process of its own"),
    (
        "data",
        "datasets are given to Trainer.fit(agent, train_dataset, val_dataset) as tasks, not as files and columns",
    ),
    ("agentlightning", "a setting of the seed's server and daemon, which the store and runners replace"),
    ("algorithm", "a setting of VERL's advantage or KL computation with no counterpart in the trainer backends"),
    ("global_profiler", "no VERL profiler runs here"),
)
"""Sections and keys of the seed's VERL config that do not apply, with why (first match wins)."""


# -- the parsed config --------------------------------------------------------------------------


@dataclass(frozen=True)
class VerlConfig:
    """What a VERL config asks of the streaming path (defaults where the config says nothing).

    ``trainer_options``: TrainerOptions fields of the trainer role (``agl-stream trainer``
    flags) that the config sets; the role's defaults apply to the others (its learning rate,
    1e-2, suits the tiny built-in policy; VERL's 1e-6 is for large models).
    """

    train_batch_size: int = 4
    rollout_n: int = 8
    total_epochs: int = 1
    total_training_steps: int | None = None
    test_freq: int = -1  # <= 0: no validation during training (VERL's default)
    val_before_train: bool = True
    val_only: bool = False
    shuffle: bool = True
    seed: int | None = 1  # VERL's sampler seeds its generator with data.seed, else 1
    model_path: str | None = None
    checkpoints: str | None = None
    max_prompt_length: int | None = None
    max_response_length: int | None = None
    trainer_options: dict[str, Any] = field(default_factory=dict)
    aggregation: str | None = None  # agentlightning.trace_aggregator.level; None: the adapter's, else trajectory

    @property
    def batch_rollouts(self) -> int:
        """Rollouts in one training batch: every sample of ``train_batch_size`` tasks."""
        return self.train_batch_size * self.rollout_n


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value; nested mappings and dotted keys mix freely. A key given twice (nested
    and dotted) is an AlgorithmConfigError."""
    flat: dict[str, Any] = {}
    twice: dict[str, str] = {}
    for key, value in config.items():
        if not isinstance(key, str) or not key:
            twice[str(key)] = "keys are non-empty strings"
            continue
        path = f"{prefix}{key}"
        # An empty section sets nothing (an empty mapping is never a value of a key that applies).
        inner = flatten(value, f"{path}.") if isinstance(value, Mapping) else {path: value}
        for name, leaf in inner.items():
            if name in flat:
                twice[name] = "given twice (as a nested key and as a dotted one)"
            flat[name] = leaf
    if twice:
        raise AlgorithmConfigError("VERL", twice)
    return flat


def _not_applicable(key: str) -> str | None:
    for prefix, why in NOT_APPLICABLE:
        if key == prefix or key.startswith(prefix + "."):
            return f"does not apply here: {why}"
    return None


def _typo_of(key: str) -> str | None:
    """The usable key ``key`` is a misspelling of: same section, a last part that differs by a
    letter or two (so VERL's own keys, such as ppo_micro_batch_size_per_gpu, get no hint)."""
    section, _, name = key.rpartition(".")
    names = [k.rpartition(".")[2] for k in (*APPLIED, *NEUTRAL) if k.rpartition(".")[0] == section]
    near = difflib.get_close_matches(name, names, n=1, cutoff=0.85)
    return f"{section}.{near[0]}" if near else None


def parse_verl_config(config: Mapping[str, Any] | None) -> VerlConfig:
    """A :class:`VerlConfig` from the seed's VERL config (nested and/or dotted keys).

    Raises AlgorithmConfigError naming every key that does not apply here (and why), every
    unknown key, and every bad value, all at once.
    """
    if config is not None and not isinstance(config, Mapping):
        raise AlgorithmConfigError("VERL", {"(config)": f"must be a mapping, got {type(config).__name__}"})
    flat = flatten(config or {})
    problems: dict[str, str] = {}
    applied: dict[str, Any] = {}
    for key, value in flat.items():
        check = APPLIED.get(key)
        if check is not None:
            wrong = check(value)
            if wrong is None:
                applied[key] = value
            else:
                problems[key] = wrong
            continue
        if key in NEUTRAL:
            harmless, why = NEUTRAL[key]
            if not harmless(value):
                problems[key] = f"{value!r} does not apply here: {why}"
            continue
        # A typo of a key that applies lands in its section's reason too: both are said.
        near = _typo_of(key)
        problems[key] = f"unknown key; did you mean {near}?" if near else (_not_applicable(key) or "unknown key")
    problems.update(_cross_checks(applied))
    if problems:
        raise AlgorithmConfigError("VERL", problems)
    return _config_of(applied)


def _cross_checks(applied: Mapping[str, Any]) -> dict[str, str]:
    problems: dict[str, str] = {}
    actor = "actor_rollout_ref.actor."
    if f"{actor}clip_ratio" in applied and (
        f"{actor}clip_ratio_low" in applied or f"{actor}clip_ratio_high" in applied
    ):
        problems[f"{actor}clip_ratio"] = "give clip_ratio or clip_ratio_low/clip_ratio_high, not both"
    mini = applied.get(f"{actor}ppo_mini_batch_size")
    batch = applied.get("data.train_batch_size", VerlConfig.train_batch_size)
    if mini is not None and mini > batch:
        problems[f"{actor}ppo_mini_batch_size"] = f"{mini} tasks is more than data.train_batch_size ({batch})"
    return problems


def _config_of(applied: Mapping[str, Any]) -> VerlConfig:
    actor = "actor_rollout_ref.actor."
    n = applied.get("actor_rollout_ref.rollout.n", VerlConfig.rollout_n)
    # The trainer role's options, by TrainerOptions field name.
    trainer_options: dict[str, Any] = {}
    for key, option in (
        (f"{actor}optim.lr", "lr"),
        (f"{actor}clip_ratio", "clip_ratio"),
        (f"{actor}clip_ratio_low", "clip_ratio_low"),
        (f"{actor}clip_ratio_high", "clip_ratio_high"),
        (f"{actor}clip_ratio_c", "clip_ratio_c"),
        (f"{actor}entropy_coeff", "entropy_coeff"),
        (f"{actor}ppo_epochs", "ppo_epochs"),
        (f"{actor}loss_agg_mode", "loss_agg_mode"),
        (f"{actor}grad_clip", "max_grad_norm"),
        ("algorithm.norm_adv_by_std_in_grpo", "norm_adv_by_std_in_grpo"),
        ("data.max_prompt_length", "max_prompt_length"),
        ("data.max_response_length", "max_response_length"),
    ):
        if applied.get(key) is not None:
            trainer_options[option] = applied[key]
    logger = applied.get("trainer.logger", ())
    trackers = [name for name in ([logger] if isinstance(logger, str) else logger) if name != "console"]
    if trackers:
        trainer_options["track"] = ",".join(trackers)
    for key, option in (("trainer.project_name", "track_project"), ("trainer.experiment_name", "track_run")):
        if key in applied:
            trainer_options[option] = applied[key]
    if f"{_CORRECTION}rollout_is" in applied:
        level = applied[f"{_CORRECTION}rollout_is"]
        if level is None:
            trainer_options["off_policy_correction"] = "none"
        else:
            trainer_options["rollout_is"] = level
    if f"{_CORRECTION}rollout_is_threshold" in applied:
        trainer_options["rollout_is_threshold"] = applied[f"{_CORRECTION}rollout_is_threshold"]
    estimator = applied.get("algorithm.adv_estimator")
    if estimator is not None and estimator != "grpo":
        trainer_options["adv_estimator"] = estimator
    if f"{actor}ppo_mini_batch_size" in applied:
        # VERL counts mini-batches in tasks (prompts); the trainer in rows, n per task.
        trainer_options["mini_batch_size"] = applied[f"{actor}ppo_mini_batch_size"] * n
    defaults = VerlConfig()
    return VerlConfig(
        train_batch_size=applied.get("data.train_batch_size", defaults.train_batch_size),
        rollout_n=n,
        total_epochs=applied.get("trainer.total_epochs", defaults.total_epochs),
        total_training_steps=applied.get("trainer.total_training_steps"),
        test_freq=applied.get("trainer.test_freq", defaults.test_freq),
        val_before_train=applied.get("trainer.val_before_train", defaults.val_before_train),
        val_only=applied.get("trainer.val_only", defaults.val_only),
        shuffle=applied.get("data.shuffle", defaults.shuffle),
        seed=applied.get("data.seed", defaults.seed),
        model_path=applied.get("actor_rollout_ref.model.path"),
        checkpoints=applied.get("trainer.default_local_dir"),
        max_prompt_length=applied.get("data.max_prompt_length"),
        max_response_length=applied.get("data.max_response_length"),
        trainer_options=trainer_options,
        aggregation=applied.get("agentlightning.trace_aggregator.level"),
    )


# -- the processes --------------------------------------------------------------------------------


@dataclass(frozen=True)
class RolePlan:
    """Where the run's processes live: chosen by the shell (free ports, folders), used here."""

    checkpoints: Path
    model_name: str
    inference_port: int
    proxy_port: int
    backend: BackendKind = "torch"
    linger_s: float = 30.0
    settle_s: float = 2.0
    inference_engine: InferenceEngine = "cpu"  # vllm: vLLM's server, restarted on each published version
    vllm_args: tuple[str, ...] = ()  # more arguments for vLLM's server (--gpu-memory-utilization=0.5 ...)

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}/v1"

    @property
    def inference_url(self) -> str:
        return f"http://127.0.0.1:{self.inference_port}/v1"


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def adapter_flags(adapter: AdapterConfig) -> list[str]:
    """The triplet builder's flags for ``adapter`` (``--aggregation`` only when not the default);
    ConfigError for a setting the role has no flag for."""
    defaults = AdapterConfig()
    fixed = [
        name
        for name in ("dedup_llm_call", "repair_hierarchy", "final_reward_to_last")
        if getattr(adapter, name) != getattr(defaults, name)
    ]
    if fixed:
        raise ConfigError(
            f"adapter: the triplet builder role takes llm_call_match, agent_match, reward_match and "
            f"exclude_llm_call_in_reward; {', '.join(fixed)} must keep their defaults with VERL"
        )
    flags = ["--llm-call-match", adapter.llm_call_match]
    if adapter.agent_match is not None:
        flags += ["--agent-match", adapter.agent_match]
    flags += ["--reward-match", adapter.reward_match.value]
    flags.append(
        "--exclude-llm-call-in-reward" if adapter.exclude_llm_call_in_reward else "--no-exclude-llm-call-in-reward"
    )
    if adapter.aggregation != defaults.aggregation:
        flags += ["--aggregation", adapter.aggregation]
    return flags


def with_aggregation(adapter: AdapterConfig, level: str | None) -> AdapterConfig:
    """``adapter`` with the config's ``agentlightning.trace_aggregator.level``; when the config has
    none, the adapter's own ``aggregation`` if it sets one, else :data:`DEFAULT_AGGREGATION`
    (trajectory). ConfigError when the level and the adapter's own setting differ."""
    if level is None:
        if "aggregation" in adapter.model_fields_set:
            return adapter
        level = DEFAULT_AGGREGATION
    if level == adapter.aggregation:
        return adapter
    if "aggregation" in adapter.model_fields_set:
        raise ConfigError(
            f"agentlightning.trace_aggregator.level is {level!r} but the adapter's aggregation is "
            f"{adapter.aggregation!r}; set one of them"
        )
    return adapter.model_copy(update={"aggregation": level})


def verl_roles(config: VerlConfig, plan: RolePlan, adapter: AdapterConfig) -> list[RoleSpec]:
    """The processes of a VERL run, in start order (each ready before the next where it has a
    health check): triplet builder, batcher, trainer, inference server, LLM proxy.

    The trainer publishes policy version 0 at once (a ProxyLLM naming the proxy, and the
    checkpoint the inference server loads); runners call the proxy, which forwards to the
    inference server and records each call's tokens as spans.
    """
    trainer = ["trainer", "--checkpoints", str(plan.checkpoints), "--backend", plan.backend]
    trainer += ["--model-name", plan.model_name, "--proxy-endpoint", plan.proxy_url, "--algorithm", "grpo"]
    if config.model_path is not None:
        trainer += ["--initial-model", config.model_path]
    for option, value in sorted(config.trainer_options.items()):
        if isinstance(value, bool):
            trainer.append(_flag(option) if value else _flag(f"no_{option}"))
        else:
            trainer += [_flag(option), str(value)]
    inference = ["inference", "--port", str(plan.inference_port), "--model-name", plan.model_name]
    if config.model_path is not None:
        inference += ["--model", config.model_path]
    if plan.inference_engine == "vllm":
        if config.model_path is None:
            raise ConfigError("inference_engine='vllm' needs actor_rollout_ref.model.path (vLLM serves a model folder)")
        inference += ["--engine", "vllm", *(f"--vllm-arg={arg}" for arg in plan.vllm_args)]
    if config.max_response_length is not None:
        # Agents that set no max_tokens get responses the trainer keeps whole.
        inference += ["--default-max-tokens", str(config.max_response_length)]
    batcher = ["batcher", "--group-size", str(config.rollout_n), "--max-rollouts", str(config.batch_rollouts)]
    batcher += ["--linger", _number(plan.linger_s)]
    builder = adapter_flags(with_aggregation(adapter, config.aggregation))
    return [
        RoleSpec("triplets", ("triplets", "--settle", _number(plan.settle_s), *builder)),
        RoleSpec("batcher", tuple(batcher)),
        RoleSpec("trainer", tuple(trainer)),
        RoleSpec("inference", tuple(inference), health_url=f"http://127.0.0.1:{plan.inference_port}/health"),
        RoleSpec(
            "llm-proxy",
            (
                "llm-proxy",
                "--port",
                str(plan.proxy_port),
                "--backend",
                f"{plan.model_name}={plan.inference_url}",
            ),
            health_url=f"http://127.0.0.1:{plan.proxy_port}/health",
        ),
    ]


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


# -- what to enqueue -------------------------------------------------------------------------------


def train_rounds(train: Sequence[Any], config: VerlConfig, tag: str) -> list[list[dict[str, Any]]]:
    """The training rollouts, in rounds of ``train_batch_size`` tasks (one batch each), every task
    ``rollout.n`` times with a group id of its own (its GRPO group).

    The epochs' orders are laid end to end before they are cut into rounds, so only the very last
    round may be short (the batcher's linger sends its batch); ``total_training_steps`` keeps the
    first rounds only. ``tag`` makes the group ids unique to the run.
    """
    orders = epoch_orders(len(train), epochs=config.total_epochs, shuffle=config.shuffle, seed=config.seed)
    tasks = [(epoch, position, index) for epoch, order in enumerate(orders) for position, index in enumerate(order)]
    rounds = []
    for start in range(0, len(tasks), config.train_batch_size):
        rounds.append(
            [
                {
                    "input": train[index],
                    "mode": "train",
                    "metadata": {"group_id": f"{tag}-e{epoch}-{position}", "epoch": epoch},
                }
                for epoch, position, index in tasks[start : start + config.train_batch_size]
                for _ in range(config.rollout_n)
            ]
        )
    if config.total_training_steps is not None:
        rounds = rounds[: config.total_training_steps]
    return rounds


def val_requests(val: Sequence[Any], tag: str, number: int) -> list[dict[str, Any]]:
    """Validation pass ``number``: every task once (as the seed validates), mode ``val``."""
    return [
        {"input": task, "mode": "val", "metadata": {"group_id": f"{tag}-val{number}-{index}"}}
        for index, task in enumerate(val)
    ]


def validation_due(config: VerlConfig, version: int, last_validated: int) -> bool:
    """Whether the policy moved ``test_freq`` versions past the last validated one."""
    return config.test_freq > 0 and version - last_validated >= config.test_freq
