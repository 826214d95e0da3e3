"""``agl-stream trainer``: the policy trainer, configured by a TOML file and/or flags."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from agl_stream.cli.context import settings_of
from agl_stream.rl_options import CHOICES, TRACKERS, TRAINER_OPTION_NAMES, TrainerOptions, parse_trackers

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


def read_config(path: Path) -> dict[str, Any]:
    """The options in a trainer TOML file (top level or a ``[trainer]`` table); unknown keys are an error."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise typer.BadParameter(f"cannot read {path}: {error}", param_hint="--config") from error
    table = data.get("trainer", data)
    if not isinstance(table, dict):
        raise typer.BadParameter(f"{path}: [trainer] must be a table", param_hint="--config")
    options = {str(k).replace("-", "_"): v for k, v in table.items()}
    unknown = sorted(set(options) - set(TRAINER_OPTION_NAMES))
    if unknown:
        raise typer.BadParameter(
            f"{path}: unknown option(s) {unknown}; known: {', '.join(TRAINER_OPTION_NAMES)}", param_hint="--config"
        )
    for key in ("checkpoints", "initial_model", "track_dir"):  # relative to the file, like most tools' config paths
        if key in options:
            options[key] = (path.parent / str(options[key])).resolve()
    if isinstance(options.get("track"), list):  # track = ["tensorboard", "wandb"]
        options["track"] = ",".join(str(name) for name in options["track"])
    return options


def trainer(
    ctx: typer.Context,
    config: Annotated[
        Path | None,
        typer.Option(help="TOML file of these options (top level or a trainer table); flags given override it."),
    ] = None,
    checkpoints: Annotated[
        Path | None, typer.Option(help="Folder of the policy checkpoints and progress.json (resumes from it).")
    ] = None,
    backend: Annotated[
        str, typer.Option(help="Policy backend: torch (one process, CPU or one GPU) or verl (VERL's FSDP engine).")
    ] = "torch",
    initial_model: Annotated[
        Path | None,
        typer.Option(
            "--initial-model",
            "--model",
            help="HF causal LM folder to start from when there is no checkpoint yet (default: the tiny policy).",
        ),
    ] = None,
    model_name: Annotated[str, typer.Option(help="Model name the checkpoints are published under.")] = "agl-tiny",
    proxy_endpoint: Annotated[
        str | None, typer.Option(help="LLM proxy base URL published as the runners' ProxyLLM resource.")
    ] = None,
    lr: Annotated[float, typer.Option(min=0.0, help="Learning rate (AdamW).")] = 1e-2,
    algorithm: Annotated[str, typer.Option(help="grpo or ppo (PPO-clip loss, no critic).")] = "grpo",
    seed: Annotated[int, typer.Option(help="Seed of the initial random policy and of training.")] = 0,
    max_batches: Annotated[int | None, typer.Option(min=1, help="Stop after training this many batches.")] = None,
    batches_topic: Annotated[
        str | None,
        typer.Option(help="Full name of the batch topic to train on (default <prefix>.triplet-batches)."),
    ] = None,
    max_prompt_length: Annotated[
        int | None, typer.Option(min=1, help="Truncate prompts to this many tokens (their left end goes).")
    ] = None,
    max_response_length: Annotated[
        int | None, typer.Option(min=1, help="Truncate responses to this many tokens.")
    ] = None,
    adv_estimator: Annotated[
        str | None, typer.Option(help="VERL advantage estimator without a critic (default: the algorithm's).")
    ] = None,
    norm_adv_by_std_in_grpo: Annotated[
        bool | None,
        typer.Option("--norm-adv-by-std-in-grpo/--no-norm-adv-by-std-in-grpo", help="GRPO: divide by the group's std."),
    ] = None,
    clip_ratio: Annotated[float | None, typer.Option(min=0.0, help="PPO clip ratio (both sides).")] = None,
    clip_ratio_low: Annotated[float | None, typer.Option(min=0.0, help="PPO clip ratio below 1.")] = None,
    clip_ratio_high: Annotated[float | None, typer.Option(min=0.0, help="PPO clip ratio above 1.")] = None,
    clip_ratio_c: Annotated[float | None, typer.Option(min=1.0, help="Dual-clip bound (negative advantages).")] = None,
    entropy_coeff: Annotated[float | None, typer.Option(help="Weight of the entropy bonus.")] = None,
    ppo_epochs: Annotated[int | None, typer.Option(min=1, help="Passes over each batch.")] = None,
    mini_batch_size: Annotated[
        int | None, typer.Option(min=1, help="Rows per optimizer step (default: the whole batch).")
    ] = None,
    loss_agg_mode: Annotated[
        str | None,
        typer.Option(
            help="Loss aggregation: VERL's token-mean (default), token-sum, seq-mean-token-sum, "
            "seq-mean-token-mean, seq-mean-token-sum-norm, or rollout-mean (token mean within a rollout's "
            "samples, then mean over rollouts: a many-turn rollout weighs what a one-turn one does; the "
            "verl backend takes it without an entropy bonus)."
        ),
    ] = None,
    max_grad_norm: Annotated[float | None, typer.Option(min=0.0, help="Gradient norm clipping bound.")] = None,
    advantage_level: Annotated[
        str | None,
        typer.Option(
            help="rollout (default): one group-relative advantage per rollout (its last sample's reward "
            "against the other rollouts of its task), on every sample of it; sample: one per row (VERL's "
            "estimator on the rows as they are)."
        ),
    ] = None,
    off_policy_correction: Annotated[
        str | None,
        typer.Option(
            help="With the serving engine's logprobs in the batch: truncate (default: importance weights "
            "exp(trainer old logprob - engine logprob), capped at --rollout-is-threshold; VERL's TIS), mask "
            "(weights over the cap set to 0) or none. The trainer recomputes its old logprobs unless none."
        ),
    ] = None,
    rollout_is: Annotated[
        str | None,
        typer.Option(help="Importance ratio level (VERL's rollout_is): token (default) or sequence."),
    ] = None,
    rollout_is_threshold: Annotated[
        float | None,
        typer.Option(help="Cap of the importance weights, > 0 (VERL's rollout_is_threshold; 2.0)."),
    ] = None,
    track: Annotated[
        str | None,
        typer.Option(
            help=f"Experiment trackers to record each step's metrics to, comma-separated: {', '.join(TRACKERS)} "
            "(W&B offline with WANDB_MODE=offline; MLflow at MLFLOW_TRACKING_URI, else a SQLite file in "
            "--track-dir). A tracker that fails is logged and left out; training goes on."
        ),
    ] = None,
    track_dir: Annotated[
        Path | None,
        typer.Option(help="Folder of the trackers' files (default: <checkpoints>/tracking)."),
    ] = None,
    track_project: Annotated[
        str, typer.Option(help="Tracking project: W&B project, MLflow experiment, TensorBoard folder.")
    ] = "agl-stream",
    track_run: Annotated[
        str | None, typer.Option(help="Tracking run name (default: the checkpoints folder's name).")
    ] = None,
) -> None:
    """Train the policy on batched triplets; publish every new version to agl.resources.

    Each step is also a TrainerStep record on agl.trainer-metrics (table trainer_steps).

    Exactly once: progress.json in --checkpoints names the last checkpoint and the offsets
    after the last trained batch; a restarted trainer continues from there.

    On GPUs, run the verl backend (VERL's FSDP engine) with one process per GPU; rank 0 reads
    Kafka and the other ranks follow it:

        torchrun --nproc-per-node 8 -m agl_stream trainer --backend verl --initial-model ./qwen --checkpoints ckpt

    The RL options (--adv-estimator ... --rollout-is-threshold) apply to a new policy; a trainer that
    resumes from --checkpoints keeps the options its checkpoint saved. Each step's metrics (table
    trainer_steps) include the importance ratios (is_ratio_mean, is_ratio_max, is_truncated_share
    or is_masked_share) and the staleness histogram (staleness_0, staleness_1, ..., staleness_max:
    rows per policy version behind).

    --track tensorboard,wandb,mlflow records the same metrics to those experiment trackers
    (docs/tracking.md): tensorboard --logdir <checkpoints>/tracking/tensorboard shows them.

    Example config (trainer.toml):

        checkpoints = "ckpt"
        algorithm = "grpo"
        lr = 0.01
        clip_ratio_high = 0.28
    """
    # By name: typer may carry its own copy of click's ParameterSource enum.
    given = {
        name: value
        for name, value in ctx.params.items()
        if name != "config" and getattr(ctx.get_parameter_source(name), "name", "DEFAULT") != "DEFAULT"
    }
    options = {**(read_config(config) if config is not None else {}), **given}
    merged = {name: options.get(name, ctx.params[name]) for name in TRAINER_OPTION_NAMES}
    if merged["checkpoints"] is None:
        raise typer.BadParameter("give --checkpoints (or `checkpoints` in --config)", param_hint="--checkpoints")
    initial = merged["initial_model"]
    if initial is not None and not (Path(initial) / "config.json").is_file():
        raise typer.BadParameter(
            f"{initial} is not a Hugging Face model folder (no config.json)", param_hint="--initial-model"
        )
    for name, choices in CHOICES.items():  # before torch loads: a typo fails at once
        if merged[name] is not None and merged[name] not in choices:
            raise typer.BadParameter(
                f"unknown {name} {merged[name]!r}: {', '.join(choices)}", param_hint="--" + name.replace("_", "-")
            )
    try:
        parse_trackers(merged["track"])
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--track") from error
    try:
        import agl_stream.training  # noqa: F401 - fails here, with advice, when the extra is missing
        from agl_stream import metrics
        from consumers import trainer
    except ImportError as error:  # torch, transformers or verl missing
        raise typer.BadParameter(
            f"the trainer needs the training extra ({error}): pip install 'agl-stream[train]'", param_hint="--backend"
        ) from error
    cap = merged["rollout_is_threshold"]
    if cap is not None and not cap > 0:
        raise typer.BadParameter(f"{cap} is not > 0", param_hint="--rollout-is-threshold")
    settings = settings_of(ctx)
    paths = {"checkpoints": Path(merged["checkpoints"])}
    if merged["track_dir"] is not None:
        paths["track_dir"] = Path(merged["track_dir"])
    with metrics.expose(settings, "trainer"):
        trainer.main(settings, TrainerOptions(**{**merged, **paths}))
