"""Child processes get the settings, and their secrets only as 0600 files."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import SecretStr

from agl_stream.config import SECRETS_DIR_ENV, Settings
from agl_stream.local.processes import role_environment

PASSWORD = "ch-pass-4f1d"
TOKEN = "api-token-9c2e"
PROVIDER_KEY = "sk-provider-77aa"

CHILD = """
import json, os
from agl_stream.config import load_settings
s = load_settings()
print(json.dumps({
    "password": s.clickhouse_password.get_secret_value(),
    "token": s.api_token.get_secret_value(),
    "database": s.clickhouse_database,
    "environ": open("/proc/self/environ", "rb").read().decode(errors="replace"),
}))
"""


def _settings(tmp_path: Path) -> Settings:
    return Settings(
        data_dir=tmp_path,
        clickhouse_database="agl_x",
        clickhouse_password=SecretStr(PASSWORD),
        api_token=SecretStr(TOKEN),
    )


def _child(env: dict[str, str]) -> dict[str, str]:
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def test_secrets_reach_a_child_as_files_not_in_its_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", PROVIDER_KEY)
    settings = _settings(tmp_path)
    env = role_environment(settings, "gateway")
    assert not any(secret in value for value in env.values() for secret in (PASSWORD, TOKEN, PROVIDER_KEY))
    seen = _child(env)
    assert (seen["password"], seen["token"], seen["database"]) == (PASSWORD, TOKEN, "agl_x")
    for secret in (PASSWORD, TOKEN, PROVIDER_KEY):
        assert secret not in seen["environ"]
    directory = Path(env[SECRETS_DIR_ENV])
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in directory.iterdir()} == {
        "agl_clickhouse_password": 0o600,
        "agl_api_token": 0o600,
    }


def test_roles_that_call_outside_services_keep_the_callers_credentials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", PROVIDER_KEY)
    monkeypatch.setenv("AGL_CLICKHOUSE_PASSWORD", "from-the-callers-shell")
    env = role_environment(_settings(tmp_path), "runner")
    assert env["OPENAI_API_KEY"] == PROVIDER_KEY
    assert "AGL_CLICKHOUSE_PASSWORD" not in env  # the settings decide, not the caller's AGL_* variables


def test_a_secret_no_longer_set_is_removed(tmp_path: Path) -> None:
    role_environment(_settings(tmp_path), "gateway")
    without_password = _settings(tmp_path).model_copy(update={"clickhouse_password": None})
    env = role_environment(without_password, "gateway")
    assert [p.name for p in Path(env[SECRETS_DIR_ENV]).iterdir()] == ["agl_api_token"]
