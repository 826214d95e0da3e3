"""What every HTTP listener refuses before its routes: other hosts' names (DNS rebinding) and
requests web pages of other origins send (CSRF). Exercised on a bare app through ASGI."""

from __future__ import annotations

import httpx
from fastapi import FastAPI

from agl_stream.http_serving import allowed_hosts, guard


def _app(hosts: list[str]) -> FastAPI:
    app = FastAPI()
    guard(app, hosts)

    @app.post("/v1/tasks")
    async def tasks() -> dict[str, bool]:
        return {"accepted": True}

    return app


async def _post(app: FastAPI, host: str, origin: str | None = None) -> httpx.Response:
    headers = {"host": host, "content-type": "text/plain"}
    if origin is not None:
        headers["origin"] = origin
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
        return await client.post("/v1/tasks", content=b"{}", headers=headers)


def test_allowed_hosts_are_loopback_the_bind_address_and_what_the_operator_lists() -> None:
    assert allowed_hosts("127.0.0.1") == ["127.0.0.1", "localhost", "::1"]
    assert allowed_hosts("10.0.0.5", ["gpu-1.lab", " "]) == ["127.0.0.1", "localhost", "::1", "10.0.0.5", "gpu-1.lab"]
    assert "0.0.0.0" not in allowed_hosts("0.0.0.0")  # a wildcard bind names no host by itself


async def test_programs_pass_and_pages_of_other_origins_and_rebound_names_do_not() -> None:
    app = _app(allowed_hosts("127.0.0.1"))
    assert (await _post(app, "127.0.0.1:8642")).status_code == 200  # curl, the store client, a runner
    assert (await _post(app, "localhost:8642", origin="http://localhost:8642")).status_code == 200
    rebound = await _post(app, "attacker.example:8642")  # DNS rebinding: the page's own name
    assert rebound.status_code == 400
    page = await _post(app, "127.0.0.1:8642", origin="https://attacker.example")
    assert page.status_code == 403 and page.json()["error"] == "cross_origin"
    assert "access-control-allow-origin" not in page.headers
    assert (await _post(app, "127.0.0.1:8642", origin="null")).status_code == 403  # a sandboxed page


async def test_an_operator_can_name_more_hosts_or_any() -> None:
    app = _app(allowed_hosts("0.0.0.0", ["trainer.lab"]))
    assert (await _post(app, "trainer.lab:8642", origin="http://trainer.lab:3000")).status_code == 200
    assert (await _post(app, "other.lab:8642")).status_code == 400
    anything = _app(allowed_hosts("0.0.0.0", ["*"]))
    assert (await _post(anything, "other.lab:8642", origin="http://elsewhere")).status_code == 200
