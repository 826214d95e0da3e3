"""The API token: written once 0600, read back, required where the rules say."""

from __future__ import annotations

import stat
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from pydantic import SecretStr

from agl_stream.auth import TOKEN_FILE, auth_headers, ensure_token, known_token, listener_token
from agl_stream.config import Settings
from agl_stream.errors import ConfigError
from agl_stream.http_serving import guard


def test_the_token_is_written_once_private_and_read_back(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    assert known_token(settings) is None and auth_headers(settings) == {}
    token = ensure_token(settings)
    assert ensure_token(settings) == token == known_token(settings) and len(token) >= 32
    assert stat.S_IMODE((settings.run_dir / TOKEN_FILE).stat().st_mode) == 0o600
    assert auth_headers(settings) == {"authorization": f"Bearer {token}"}
    chosen = settings.model_copy(update={"api_token": SecretStr("mine")})
    assert known_token(chosen) == "mine"


def test_beyond_loopback_a_token_is_required_and_on_loopback_only_when_asked(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    with pytest.raises(ConfigError, match="needs an API token"):
        listener_token(settings, "0.0.0.0")
    with pytest.raises(ConfigError):
        listener_token(None, "10.0.0.5")
    assert listener_token(settings, "127.0.0.1") is None
    token = ensure_token(settings)
    assert listener_token(settings, "0.0.0.0") == token
    assert listener_token(settings, "127.0.0.1") is None
    assert listener_token(settings.model_copy(update={"require_token": True}), "127.0.0.1") == token


async def test_a_guarded_app_wants_the_token_except_for_health() -> None:
    app = FastAPI()
    guard(app, ["127.0.0.1"], token="s3cret")

    @app.get("/v1/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/sql")
    async def sql() -> dict[str, str]:
        return {"rows": "..."}

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
        assert (await client.get("/v1/health")).status_code == 200
        refused = await client.post("/v1/sql", json={})
        assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
        assert (await client.post("/v1/sql", json={}, headers={"authorization": "Bearer wrong"})).status_code == 401
        assert (await client.post("/v1/sql", json={}, headers={"authorization": "Bearer s3cret"})).status_code == 200
