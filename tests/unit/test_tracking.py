"""Experiment tracking: the pure mapping of a step to metric names, the backends read back from
their own files (TensorBoard event files, a W&B offline run, an MLflow SQLite store), a tracker
that fails or stalls never reaching training, and the trainer's --track flags."""

from __future__ import annotations

import json
import struct
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from agl_stream.algorithm.verl import Validation, _validation_tracking
from agl_stream.algorithm.verl_config import RolePlan, parse_verl_config, verl_roles
from agl_stream.cli import trainer_cmd
from agl_stream.cli.trainer_cmd import read_config
from agl_stream.config import Settings
from agl_stream.domain.adapter import AdapterConfig
from agl_stream.errors import AlgorithmConfigError
from agl_stream.models import TrainerStep
from agl_stream.rl_options import TRACKERS, TrainerOptions, parse_trackers
from agl_stream.training.tracking import (
    MAX_FAILURES,
    TRACKER_ADAPTERS,
    Backend,
    Tracking,
    TrackingConfig,
    metric_name,
    step_scalars,
    validation_scalars,
)
from consumers import trainer as trainer_role

BACKEND_METRICS = {
    "loss": 0.5,
    "pg_loss": 0.25,
    "grad_norm": 1.5,
    "lr": 0.01,
    "is_ratio_max": 1.75,
    "is_truncated_share": 0.125,
    "staleness_0": 3.0,
    "staleness_1": 1.0,
    "staleness_mean": 0.25,
    "reward_mean": 0.75,
    "advantage_abs_mean": 0.5,
    "response_length_mean": 12.0,
    "tokens": 64.0,
    "tokens_per_s": 128.0,
    "policy_version": 3.0,
}


def _step(version: int, **metrics: float) -> TrainerStep:
    return TrainerStep(
        batch_id=f"tb-{version}",
        model="agl-tiny",
        policy_version=version,
        step_time=1.0,
        step_seconds=0.5 * version,
        idle_seconds=0.25,
        tokens=64,
        samples=4,
        min_policy_version=version - 2,
        staleness=1.0,
        metrics={**BACKEND_METRICS, **metrics},
    )


def test_a_step_maps_to_grouped_flat_metric_names() -> None:
    scalars = step_scalars(_step(3), {"busy_fraction": 0.5, "trained_batches": 3})
    assert {name: scalars[name] for name in ("actor/loss", "actor/pg_loss", "actor/grad_norm", "actor/lr")} == {
        "actor/loss": BACKEND_METRICS["loss"],
        "actor/pg_loss": BACKEND_METRICS["pg_loss"],
        "actor/grad_norm": BACKEND_METRICS["grad_norm"],
        "actor/lr": BACKEND_METRICS["lr"],
    }
    assert scalars["importance/ratio_max"] == BACKEND_METRICS["is_ratio_max"]
    assert scalars["importance/truncated_share"] == BACKEND_METRICS["is_truncated_share"]
    assert (scalars["staleness/0"], scalars["staleness/1"]) == (BACKEND_METRICS["staleness_0"], 1.0)
    assert scalars["staleness/mean"] == BACKEND_METRICS["staleness_mean"]
    assert scalars["staleness/batch"] == 1.0  # the record's own: versions behind of its oldest rollout
    assert scalars["reward/mean"] == BACKEND_METRICS["reward_mean"]
    assert scalars["advantage/abs_mean"] == BACKEND_METRICS["advantage_abs_mean"]
    assert scalars["response/length_mean"] == BACKEND_METRICS["response_length_mean"]
    assert (scalars["perf/tokens"], scalars["perf/tokens_per_s"]) == (64.0, 128.0)
    assert (scalars["perf/step_seconds"], scalars["perf/idle_seconds"], scalars["perf/samples"]) == (1.5, 0.25, 4.0)
    assert scalars["trainer/policy_version"] == 3.0 and "actor/policy_version" not in scalars
    assert (scalars["trainer/busy_fraction"], scalars["trainer/trained_batches"]) == (0.5, 3.0)
    assert all(isinstance(value, float) for value in scalars.values())
    # Every backend metric lands under a name of its own: none lost, none merged.
    names = {metric_name(key) for key in BACKEND_METRICS if key != "policy_version"}
    assert len(names) == len(BACKEND_METRICS) - 1 and names <= set(scalars)


@pytest.mark.parametrize(
    ("key", "name"),
    [("is_", "actor/is_"), ("entropy", "actor/entropy"), ("ppo_kl", "actor/ppo_kl"), ("rows", "perf/rows")],
)
def test_metric_names_of_odd_and_plain_keys(key: str, name: str) -> None:
    assert metric_name(key) == name


def test_a_validation_maps_to_val_metrics_and_unknowns_are_left_out() -> None:
    full = {"number": 1, "policy_version": 4, "rollouts": 8, "succeeded": 6, "mean_reward": 0.5}
    full |= {"min_version": 3, "max_version": 4, "seconds": 2.0}
    assert validation_scalars(full) == {
        "val/reward_mean": 0.5,
        "val/rollouts": 8.0,
        "val/succeeded": 6.0,
        "val/success_share": 6 / 8,
        "val/seconds": 2.0,
        "val/min_policy_version": 3.0,
        "val/max_policy_version": 4.0,
    }
    none = {**full, "rollouts": 0, "succeeded": 0, "mean_reward": None, "min_version": None, "max_version": None}
    assert validation_scalars(none) == {"val/rollouts": 0.0, "val/succeeded": 0.0, "val/seconds": 2.0}


def test_tracker_names_parse_once_each_and_unknown_ones_are_refused() -> None:
    assert parse_trackers(" TensorBoard, mlflow,tensorboard ") == ("tensorboard", "mlflow")
    assert parse_trackers(None) == parse_trackers("") == ()
    with pytest.raises(ValueError, match=r"unknown tracker.*comet.*tensorboard, wandb, mlflow"):
        parse_trackers("tensorboard,comet")
    assert tuple(TRACKER_ADAPTERS) == TRACKERS  # one name per backend in the registry and the CLI


def test_the_tracking_config_defaults_under_the_checkpoints(tmp_path: Path) -> None:
    assert TrackingConfig.of(TrainerOptions(checkpoints=tmp_path / "ckpt")) is None
    config = TrackingConfig.of(TrainerOptions(checkpoints=tmp_path / "ckpt", track="mlflow", lr=0.5))
    assert config is not None
    assert (config.trackers, config.directory, config.run) == (("mlflow",), tmp_path / "ckpt" / "tracking", "ckpt")
    assert config.params["lr"] == 0.5 and config.params["checkpoints"] == str(tmp_path / "ckpt")
    given = TrainerOptions(
        checkpoints=tmp_path, track="wandb", track_dir=tmp_path / "t", track_project="p", track_run="r"
    )
    config = TrackingConfig.of(given, run_suffix="-val")
    assert config is not None and (config.directory, config.project, config.run) == (tmp_path / "t", "p", "r-val")


# -- reading the backends' own files ---------------------------------------------------------------


def _wandb_history(run_file: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """The history rows of a W&B run file (.wandb): a LevelDB-log of wandb's Record protobufs."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    block, position, chunk = 32768, 7, b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        position += 7
        if kind == 0:  # zero padding up to the end of the block
            position += block - position % block if position % block else 0
            continue
        chunk += data[position : position + length]
        position += length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                row = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
                }
                yield record.history.step.num, row


def _drive(config: TrackingConfig, steps: list[TrainerStep]) -> Tracking:
    tracker = Tracking(config)
    for step in steps:
        tracker.log(step_scalars(step), step=step.policy_version)
    tracker.close()
    return tracker


@pytest.fixture
def steps() -> list[TrainerStep]:
    return [_step(version, loss=1.0 / version, reward_mean=0.25 * version) for version in (1, 2, 3)]


def test_tensorboard_event_files_hold_every_step(tmp_path: Path, steps: list[TrainerStep]) -> None:
    from tensorboard.backend.event_processing import event_accumulator  # type: ignore[import-untyped]

    config = TrackingConfig(("tensorboard",), tmp_path, project="proj", run="run/1", params={"lr": 0.01})
    tracker = _drive(config, steps)
    assert tracker.failed == {} and tracker.dropped == 0
    events = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard" / "proj" / "run_1"))
    events.Reload()
    assert set(step_scalars(steps[0])) <= set(events.Tags()["scalars"])
    loss = [(e.step, e.value) for e in events.Scalars("actor/loss")]
    assert loss == [(s.policy_version, pytest.approx(s.metrics["loss"])) for s in steps]
    reward = [(e.step, e.value) for e in events.Scalars("reward/mean")]
    assert reward == [(s.policy_version, pytest.approx(s.metrics["reward_mean"])) for s in steps]
    assert "options/text_summary" in events.Tags()["tensors"]


def test_a_wandb_offline_run_holds_every_step(
    tmp_path: Path, steps: list[TrainerStep], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    config = TrackingConfig(("wandb",), tmp_path, project="proj", run="run-1", params={"lr": 0.01})
    tracker = _drive(config, steps)
    assert tracker.failed == {}
    [run_file] = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    # wandb's own service process writes the file: run.finish() can return while it holds only
    # its 7-byte header (seen about once in six runs), so the rows are waited for.
    history: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + 60
    while len(history) < len(steps) and time.monotonic() < deadline:
        history = dict(_wandb_history(run_file))
        if len(history) < len(steps):
            time.sleep(0.1)  # a poll of a file another process writes: no event to wait on
    assert sorted(history) == [s.policy_version for s in steps]
    for step in steps:
        row = history[step.policy_version]
        assert row["actor/loss"] == pytest.approx(step.metrics["loss"])
        assert row["importance/ratio_max"] == pytest.approx(step.metrics["is_ratio_max"])
        assert row["staleness/batch"] == step.staleness


def test_an_mlflow_store_holds_every_step(
    tmp_path: Path, steps: list[TrainerStep], monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = TrackingConfig(("mlflow",), tmp_path, project="proj", run="run-1", params={"lr": 0.01, "track": None})
    assert _drive(config, steps).failed == {}
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("proj")
    assert experiment is not None
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "run-1" and run.info.status == "FINISHED"
    assert run.data.params == {"lr": "0.01", "track": "null"}
    loss = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "actor/loss"))
    assert loss == [(s.policy_version, pytest.approx(s.metrics["loss"])) for s in steps]
    assert set(run.data.metrics) == set(step_scalars(steps[0]))


# -- a tracker never reaches training --------------------------------------------------------------


def test_a_tracker_that_fails_is_logged_and_left_out_while_the_others_go_on(tmp_path: Path) -> None:
    written: list[tuple[int, dict[str, float]]] = []
    attempts: list[int] = []

    def good(config: TrackingConfig) -> Backend:
        return Backend(lambda scalars, step: written.append((step, dict(scalars))), lambda: None)

    def broken_start(config: TrackingConfig) -> Backend:
        raise ConnectionError("no network")

    def broken_log(config: TrackingConfig) -> Backend:
        def fail(scalars: Mapping[str, float], step: int) -> None:
            attempts.append(step)
            raise OSError("disk full")

        return Backend(fail, lambda: None)

    adapters = {"good": good, "start": broken_start, "log": broken_log}
    tracker = Tracking(TrackingConfig(("start", "log", "good"), tmp_path), adapters=adapters)
    for step in range(1, 6):
        tracker.log({"actor/loss": float(step)}, step)
    tracker.close()
    assert [step for step, _ in written] == [1, 2, 3, 4, 5]
    assert attempts == list(range(1, MAX_FAILURES + 1))  # left out after MAX_FAILURES in a row
    assert tracker.failed == {"start": "ConnectionError: no network", "log": "OSError: disk full"}
    with pytest.raises(ValueError, match="unknown tracker"):
        Tracking(TrackingConfig(("comet",), tmp_path), adapters=adapters)


def test_a_stalled_tracker_never_blocks_logging_steps_beyond_its_queue_are_dropped(tmp_path: Path) -> None:
    release = threading.Event()
    written: list[int] = []

    def stalled(config: TrackingConfig) -> Backend:
        release.wait()  # a backend stuck at start (a network that does not answer)
        return Backend(lambda scalars, step: written.append(step), lambda: None)

    tracker = Tracking(TrackingConfig(("stalled",), tmp_path), adapters={"stalled": stalled}, queue_size=2)
    for step in range(1, 6):
        tracker.log({"actor/loss": 0.0}, step)  # returns at once: the caller is the training loop
    assert tracker.dropped == 3
    release.set()
    tracker.close()
    assert written == [1, 2]


# -- the trainer's flags -----------------------------------------------------------------------------


def test_track_flags_and_config_keys_reach_the_trainer_options(tmp_path: Path, monkeypatch: Any) -> None:
    seen: list[TrainerOptions] = []
    monkeypatch.setattr(trainer_role, "main", lambda settings, options: seen.append(options))
    path = tmp_path / "conf" / "trainer.toml"
    path.parent.mkdir()
    path.write_text('checkpoints = "ckpt"\ntrack = ["tensorboard", "mlflow"]\ntrack-dir = "runs"\n')
    assert read_config(path)["track"] == "tensorboard,mlflow"
    app = typer.Typer()
    app.command()(trainer_cmd.trainer)
    result = CliRunner().invoke(app, ["--config", str(path), "--track-run", "exp-1"], obj=Settings())
    assert result.exit_code == 0, result.output
    [options] = seen
    assert (options.track, options.track_dir) == ("tensorboard,mlflow", (tmp_path / "conf" / "runs").resolve())
    assert (options.track_project, options.track_run) == ("agl-stream", "exp-1")
    result = CliRunner().invoke(app, ["--checkpoints", str(tmp_path), "--track", "tensorbored"], obj=Settings())
    assert result.exit_code != 0 and "unknown tracker(s) tensorbored" in result.output
    assert len(seen) == 1


# -- the VERL algorithm: the seed's trainer.logger keys, validations ---------------------------------


def test_the_seeds_logger_keys_set_the_trainers_tracking_and_its_flags(tmp_path: Path) -> None:
    config = parse_verl_config(
        {"trainer": {"logger": ["console", "tensorboard", "mlflow"], "project_name": "p", "experiment_name": "e"}}
    )
    assert config.trainer_options == {"track": "tensorboard,mlflow", "track_project": "p", "track_run": "e"}
    plan = RolePlan(checkpoints=tmp_path, model_name="agl-tiny", inference_port=1, proxy_port=2)
    [trainer] = [r.args for r in verl_roles(config, plan, AdapterConfig()) if r.name == "trainer"]
    assert list(trainer[-6:]) == ["--track", "tensorboard,mlflow", "--track-project", "p", "--track-run", "e"]
    assert parse_verl_config({"trainer.logger": ["console"]}).trainer_options == {}  # the console: logs as ever
    with pytest.raises(AlgorithmConfigError, match="swanlab"):
        parse_verl_config({"trainer.logger": ["swanlab"]})


def test_validations_go_to_the_trainers_project_as_a_run_of_their_own(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing import event_accumulator  # type: ignore[import-untyped]

    config = parse_verl_config({"trainer.logger": ["tensorboard"], "trainer.experiment_name": "exp"})
    plan = RolePlan(checkpoints=tmp_path / "ckpt", model_name="agl-tiny", inference_port=1, proxy_port=2)
    assert _validation_tracking(parse_verl_config({}), plan) is None
    tracker = _validation_tracking(config, plan)
    assert tracker is not None
    passes = [Validation(n, n * 2, 4, 4 - n, 0.25 * n, n, n * 2, 1.0) for n in (1, 2)]
    for validation in passes:
        tracker.log(validation_scalars(validation), step=validation.policy_version)
    tracker.close()
    events = event_accumulator.EventAccumulator(
        str(tmp_path / "ckpt" / "tracking" / "tensorboard" / "agl-stream" / "exp-validation")
    )
    events.Reload()
    reward = [(e.step, e.value) for e in events.Scalars("val/reward_mean")]
    assert reward == [(v.policy_version, pytest.approx(v.mean_reward)) for v in passes]
