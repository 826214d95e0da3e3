"""The inference server's API token, for both engines, without a GPU: the CLI's decision (a host
beyond loopback needs a token, as every agl-stream listener does) and how vLLM gets the token (a
0600 options file named by --config, never its command line)."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml  # type: ignore[import-untyped]  # PyYAML (the dev extra) ships no types
from pydantic import SecretStr
from typer.testing import CliRunner

import consumers.inference
from agl_stream.cli.inference_cmd import inference
from agl_stream.config import Settings
from agl_stream.errors import ConfigError
from consumers import vllm_server
from consumers.vllm_server import VllmOptions, api_key_options, server_command, write_api_key_options

TOKEN = 'tok-"quoted": #not a comment'


def _invoke(settings: Settings, *args: str) -> tuple[Any, list[tuple[str, tuple[Any, ...], dict[str, Any]]]]:
    """Run ``agl-stream inference`` with the engines' entry points recording their calls."""
    app = typer.Typer()
    app.command()(inference)
    started: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vllm_server, "main", lambda *a, **k: started.append(("vllm", a, k)))
        patch.setattr(consumers.inference, "main", lambda *a, **k: started.append(("cpu", a, k)))
        result = CliRunner().invoke(app, list(args), obj=settings)
    return result, started


@pytest.mark.parametrize("engine", ["cpu", "vllm"])
def test_a_host_beyond_loopback_without_a_token_is_refused_before_anything_starts(engine: str, tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)  # no AGL_API_TOKEN, no token file
    result, started = _invoke(settings, "--engine", engine, "--host", "0.0.0.0", "--no-follow")
    assert isinstance(result.exception, ConfigError) and "needs an API token" in str(result.exception)
    assert started == []


def test_vllm_beyond_loopback_gets_the_token(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, api_token=SecretStr(TOKEN))
    result, [(engine, args, _)] = _invoke(settings, "--engine", "vllm", "--host", "0.0.0.0", "--no-follow")
    assert result.exit_code == 0 and engine == "vllm"
    _, options, token = args
    assert token == TOKEN and options.host == "0.0.0.0"


def test_the_token_of_the_data_dir_counts_and_loopback_needs_one_only_when_required(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "api-token").write_text("from-the-data-dir")
    settings = Settings(data_dir=tmp_path)
    assert settings.run_dir == tmp_path / "run"
    _, [(_, args, _)] = _invoke(settings, "--engine", "vllm", "--host", "10.1.2.3", "--no-follow")
    assert args[2] == "from-the-data-dir"
    _, [(_, args, _)] = _invoke(settings, "--engine", "vllm", "--no-follow")  # loopback
    assert args[2] is None
    required = Settings(data_dir=tmp_path, require_token=True)
    _, [(_, args, _)] = _invoke(required, "--engine", "vllm", "--no-follow")
    assert args[2] == "from-the-data-dir"


def test_the_cpu_engine_gets_the_settings_without_follow_too(tmp_path: Path) -> None:
    """Its listener takes the token from them (before, --no-follow dropped them and with them
    AGL_API_TOKEN, so a host beyond loopback was refused even with a token)."""
    settings = Settings(data_dir=tmp_path, api_token=SecretStr(TOKEN))
    result, [(engine, args, kwargs)] = _invoke(settings, "--host", "0.0.0.0", "--no-follow")
    assert result.exit_code == 0 and engine == "cpu"
    assert args[0] is settings and args[1] == "0.0.0.0" and kwargs["follow"] is False


def test_the_vllm_command_names_the_options_file_and_never_the_token(tmp_path: Path) -> None:
    options = VllmOptions(model_name="qwen", port=8123, extra_args=("--enforce-eager",))
    assert "--config" not in server_command(options, Path("/ck/v3"))
    path = write_api_key_options(tmp_path, TOKEN)
    argv = server_command(VllmOptions(model_name="qwen", port=8123, options_file=path), Path("/ck/v3"))
    assert argv[-2:] == ["--config", str(path)] and not any(TOKEN in part for part in argv)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert yaml.safe_load(path.read_text()) == {"api-key": TOKEN}
    assert yaml.safe_load(api_key_options("plain")) == {"api-key": "plain"}


def test_main_hands_vllm_a_private_options_file_and_removes_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[VllmOptions] = []

    async def run_vllm(settings: Settings | None, options: VllmOptions) -> None:
        assert options.options_file is not None
        assert stat.S_IMODE(options.options_file.parent.stat().st_mode) == 0o700
        assert yaml.safe_load(options.options_file.read_text()) == {"api-key": TOKEN}
        seen.append(options)

    monkeypatch.setattr(vllm_server, "run_vllm", run_vllm)
    vllm_server.main(None, VllmOptions(model_name="m", follow=False), TOKEN)
    [options] = seen
    assert options.options_file is not None and not options.options_file.parent.exists()
