"""`agl-stream trainer` options: a TOML --config file, flags over it, clear errors."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from agl_stream.cli import trainer_cmd
from agl_stream.cli.trainer_cmd import read_config
from agl_stream.config import Settings
from consumers import trainer as trainer_role


def test_a_config_file_sets_options_and_paths_are_relative_to_it(tmp_path: Path) -> None:
    path = tmp_path / "conf" / "trainer.toml"
    path.parent.mkdir()
    path.write_text('[trainer]\ncheckpoints = "ckpt"\nmax-batches = 3\nalgorithm = "ppo"\n')
    assert read_config(path) == {
        "checkpoints": (tmp_path / "conf" / "ckpt").resolve(),
        "max_batches": 3,
        "algorithm": "ppo",
    }


@pytest.mark.parametrize(
    ("text", "message"),
    [("lr = 0.1\nlearning_rate = 2\n", "unknown option(s) ['learning_rate']"), ("lr = [", "cannot read")],
)
def test_bad_config_files_say_what_is_wrong(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "trainer.toml"
    path.write_text(text)
    with pytest.raises(typer.BadParameter, match=re.escape(message)):
        read_config(path)


def test_flags_override_the_file_and_the_file_overrides_defaults(tmp_path: Path, monkeypatch: Any) -> None:
    seen: list[Any] = []

    def fake_main(settings: Any, options: Any) -> None:
        seen.append(options)

    monkeypatch.setattr(trainer_role, "main", fake_main)  # the command's options, not a training run
    path = tmp_path / "trainer.toml"
    path.write_text('checkpoints = "ckpt"\nlr = 0.5\nseed = 7\nbatches_topic = "agl.replayed"\n')
    app = typer.Typer()
    app.command()(trainer_cmd.trainer)
    result = CliRunner().invoke(app, ["--config", str(path), "--lr", "0.25"], obj=Settings())
    assert result.exit_code == 0, result.output
    [options] = seen
    assert (options.lr, options.seed, options.batches_topic) == (0.25, 7, "agl.replayed")
    assert options.checkpoints == (tmp_path / "ckpt").resolve() and options.backend == "torch"

    result = CliRunner().invoke(app, ["--backend", "tpu", "--checkpoints", str(tmp_path)], obj=Settings())
    assert result.exit_code != 0 and "unknown backend" in result.output
    result = CliRunner().invoke(app, [], obj=Settings())
    assert result.exit_code != 0 and "--checkpoints" in result.output
    result = CliRunner().invoke(app, ["--checkpoints", str(tmp_path), "--initial-model", str(tmp_path)], obj=Settings())
    assert result.exit_code != 0 and "config.json" in result.output


def test_rl_options_reach_a_new_policy_backend_and_unset_ones_keep_its_defaults(
    tmp_path: Path, monkeypatch: Any
) -> None:
    seen: list[Any] = []
    monkeypatch.setattr(trainer_role, "main", lambda settings, options: seen.append(options))
    (tmp_path / "trainer.toml").write_text("clip_ratio_high = 0.28\nppo_epochs = 2\n")
    app = typer.Typer()
    app.command()(trainer_cmd.trainer)
    flags = ["--checkpoints", str(tmp_path), "--config", str(tmp_path / "trainer.toml")]
    flags += ["--clip-ratio-low", "0.2", "--no-norm-adv-by-std-in-grpo", "--adv-estimator", "rloo"]
    result = CliRunner().invoke(app, flags, obj=Settings())
    assert result.exit_code == 0, result.output
    [options] = seen
    assert options.backend_options() == {
        "lr": 1e-2,
        "algorithm": "grpo",
        "seed": 0,
        "adv_estimator": "rloo",
        "norm_adv_by_std_in_grpo": False,
        "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.28,
        "ppo_epochs": 2,
    }


def test_advantage_loss_and_off_policy_options_reach_the_backend_and_bad_ones_are_named(
    tmp_path: Path, monkeypatch: Any
) -> None:
    seen: list[Any] = []
    monkeypatch.setattr(trainer_role, "main", lambda settings, options: seen.append(options))
    (tmp_path / "trainer.toml").write_text('off_policy_correction = "mask"\nrollout_is_threshold = 3.0\n')
    app = typer.Typer()
    app.command()(trainer_cmd.trainer)
    flags = ["--checkpoints", str(tmp_path), "--config", str(tmp_path / "trainer.toml")]
    flags += ["--advantage-level", "sample", "--loss-agg-mode", "rollout-mean", "--rollout-is", "sequence"]
    result = CliRunner().invoke(app, flags, obj=Settings())
    assert result.exit_code == 0, result.output
    [options] = seen
    chosen = options.backend_options()
    assert {k: v for k, v in chosen.items() if k not in ("lr", "algorithm", "seed")} == {
        "advantage_level": "sample",
        "loss_agg_mode": "rollout-mean",
        "off_policy_correction": "mask",
        "rollout_is": "sequence",
        "rollout_is_threshold": 3.0,
    }
    for flag, value in (("--off-policy-correction", "clip"), ("--advantage-level", "task")):
        result = CliRunner().invoke(app, ["--checkpoints", str(tmp_path), flag, value], obj=Settings())
        assert result.exit_code != 0 and "unknown" in result.output and value in result.output
    help_text = CliRunner().invoke(app, ["--help"], obj=Settings(), env={"COLUMNS": "200"}).output
    for flag in ("--advantage-level", "--off-policy-correction", "--rollout-is-threshold", "rollout-mean"):
        assert flag in help_text, flag
