"""The pure parts of serving real models: which checkpoint to load, vLLM's command line, the VERL
mapping to the vLLM engine, and the CLI's model flags."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from agl_stream.algorithm.verl_config import RolePlan, parse_verl_config, verl_roles
from agl_stream.cli.inference_cmd import inference
from agl_stream.config import Settings
from agl_stream.domain.adapter import AdapterConfig
from agl_stream.domain.checkpoints import choose_checkpoint, local_checkpoint_path
from agl_stream.errors import ConfigError
from agl_stream.models import LLM, ModelCheckpoint
from consumers.vllm_server import VLLM_MODULE, VllmManager, VllmOptions, health_url, parse_command, server_command


def ckpt(version: int, model: str = "m", fmt: str = "hf") -> ModelCheckpoint:
    return ModelCheckpoint(uri=f"/ck/v{version}", model=model, policy_version=version, format=fmt)


def test_the_newest_checkpoint_of_the_served_model_is_chosen() -> None:
    resources = [ckpt(2), ckpt(5, model="other"), LLM(endpoint="http://x", model="m"), ckpt(3), ckpt(1)]
    choice = choose_checkpoint(resources, model="m", loaded_version=1)
    assert choice.checkpoint == ckpt(3) and choice.refused == []


def test_nothing_older_or_equal_or_failed_replaces_what_is_loaded_or_chosen() -> None:
    assert choose_checkpoint([ckpt(1), ckpt(2)], model="m", loaded_version=2).checkpoint is None
    assert choose_checkpoint([ckpt(3)], model="m", loaded_version=1, failed={3}).checkpoint is None
    chosen = ckpt(4)
    # A chosen, not yet loaded checkpoint stays chosen unless a newer one comes.
    assert choose_checkpoint([ckpt(3)], model="m", loaded_version=1, chosen=chosen).checkpoint is chosen
    assert choose_checkpoint([ckpt(5)], model="m", loaded_version=1, chosen=chosen).checkpoint == ckpt(5)
    # A chosen one the loaded version caught up with is no longer to load.
    assert choose_checkpoint([], model="m", loaded_version=4, chosen=chosen).checkpoint is None


def test_a_format_other_than_hf_is_refused_with_why() -> None:
    choice = choose_checkpoint([ckpt(2, fmt="megatron"), ckpt(1)], model="m", loaded_version=0)
    assert choice.checkpoint == ckpt(1)
    assert [(c.policy_version, "megatron" in why) for c, why in choice.refused] == [(2, True)]


def test_checkpoint_uris_are_local_folders() -> None:
    assert local_checkpoint_path("/a/b") == Path("/a/b")
    assert local_checkpoint_path("file:///a/b") == Path("/a/b")
    with pytest.raises(ValueError, match="local"):
        local_checkpoint_path("s3://bucket/v1")


def test_the_vllm_command_line() -> None:
    options = VllmOptions(model_name="qwen", port=8123, extra_args=("--enforce-eager", "--gpu-memory-utilization=0.5"))
    assert options.command == (sys.executable, "-m", VLLM_MODULE)
    assert server_command(options, Path("/ck/v3")) == [
        sys.executable, "-m", VLLM_MODULE, "--model", "/ck/v3", "--served-model-name", "qwen",
        "--host", "127.0.0.1", "--port", "8123", "--enforce-eager", "--gpu-memory-utilization=0.5",
    ]  # fmt: skip
    assert parse_command("vllm serve") == ("vllm", "serve")
    assert parse_command("  ") == parse_command(None) == (sys.executable, "-m", VLLM_MODULE)
    assert health_url(options) == "http://127.0.0.1:8123/health"
    assert health_url(VllmOptions(model_name="q", host="0.0.0.0", port=1)) == "http://127.0.0.1:1/health"


async def test_the_manager_wants_only_newer_versions_of_its_model() -> None:
    manager = VllmManager(None, VllmOptions(model_name="m", follow=False))
    manager.version = 2
    manager.offer(ckpt(2))
    manager.offer(ckpt(7, model="other"))
    assert manager._wanted is None
    manager.offer(ckpt(4))
    manager.offer(ckpt(3))
    assert manager._wanted == ckpt(4)
    manager.failed.add(5)
    manager.offer(ckpt(5))
    assert manager._wanted == ckpt(4)
    with pytest.raises(ValueError, match="Kafka"):
        VllmManager(None, VllmOptions(model_name="m"))


async def test_before_the_first_start_model_is_its_version_and_a_restart_in_progress_counts() -> None:
    manager = VllmManager(None, VllmOptions(model_name="m", model=Path("/m"), follow=False))
    manager.offer(ckpt(0))  # the trainer's v0 of the folder being served: not news
    assert manager._wanted is None
    manager._loading = 3  # a restart bringing up v3: the trainer publishing v3 again is not news
    manager.offer(ckpt(3))
    assert manager._wanted is None
    manager.offer(ckpt(4))
    assert manager._wanted == ckpt(4)


PLAN = RolePlan(checkpoints=Path("/ckpt"), model_name="qwen", inference_port=9001, proxy_port=9002)


def test_verl_with_the_vllm_engine_runs_the_inference_role_on_vllm() -> None:
    config = parse_verl_config({"actor_rollout_ref.model.path": "/models/qwen"})
    plan = RolePlan(**{**vars(PLAN), "inference_engine": "vllm", "vllm_args": ("--enforce-eager",)})
    args = {r.name: list(r.args) for r in verl_roles(config, plan, AdapterConfig())}
    assert args["inference"] == [
        "inference", "--port", "9001", "--model-name", "qwen", "--model", "/models/qwen",
        "--engine", "vllm", "--vllm-arg=--enforce-eager",
    ]  # fmt: skip
    assert args["trainer"][-2:] == ["--initial-model", "/models/qwen"]
    with pytest.raises(ConfigError, match=r"model\.path"):
        verl_roles(parse_verl_config({}), plan, AdapterConfig())


def test_the_inference_cli_refuses_a_vllm_engine_it_cannot_run(tmp_path: Path) -> None:
    app = typer.Typer()
    app.command()(inference)
    runner = CliRunner()
    result = runner.invoke(app, ["--engine", "tgi", "--no-follow"], obj=Settings())
    assert result.exit_code != 0 and "cpu or vllm" in result.output
    result = runner.invoke(app, ["--engine", "vllm", "--port", "0", "--no-follow"], obj=Settings())
    assert result.exit_code != 0 and "fixed port" in result.output
    result = runner.invoke(app, ["--engine", "vllm", "--model", str(tmp_path), "--no-follow"], obj=Settings())
    assert result.exit_code != 0 and "config.json" in result.output
