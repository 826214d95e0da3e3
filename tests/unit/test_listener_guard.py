"""What every HTTP listener refuses before its routes: other hosts' names (DNS rebinding),
requests web pages of other origins send (CSRF), bodies that are not JSON or are too large.
Exercised on a bare app through ASGI."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request

from agl_stream.http_serving import (
    BodyTooLargeError,
    MalformedBodyError,
    allowed_hosts,
    guard,
    parse_json,
    read_body,
)


def _app(hosts: list[str], max_body_bytes: int = 1 << 20) -> FastAPI:
    app = FastAPI()
    guard(app, hosts, max_body_bytes=max_body_bytes, media_types={"/v1/traces": frozenset({"application/x-protobuf"})})

    @app.post("/v1/tasks")
    async def tasks(request: Request) -> dict[str, Any]:
        try:
            body = await read_body(request, 1000)
        except BodyTooLargeError as error:
            return {"route_refused": str(error)}
        return {"accepted": True, "size": len(body)}

    @app.post("/v1/traces")
    async def traces(request: Request) -> dict[str, int]:
        return {"size": len(await request.body())}

    return app


async def _send(app: FastAPI, path: str, content: Any, content_type: str | None) -> httpx.Response:
    headers = {"content-type": content_type} if content_type else {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
        return await client.post(path, content=content, headers=headers)


async def _post(app: FastAPI, host: str, origin: str | None = None) -> httpx.Response:
    headers = {"host": host, "content-type": "application/json"}
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


async def test_bodies_are_json_only_except_where_a_path_allows_more() -> None:
    app = _app(["127.0.0.1"])
    assert (await _send(app, "/v1/tasks", b"{}", "application/json; charset=utf-8")).status_code == 200
    for simple in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        refused = await _send(app, "/v1/tasks", b"{}", simple)  # what a page may send without asking
        assert refused.status_code == 415 and refused.json()["error"] == "unsupported_media_type", simple
    assert (await _send(app, "/v1/traces", b"\x0a\x00", "application/x-protobuf")).status_code == 200
    assert (await _send(app, "/v1/tasks", b"\x0a\x00", "application/x-protobuf")).status_code == 415
    assert (await _send(app, "/v1/tasks", b"", None)).status_code == 200  # no body, nothing to type


async def _chunks(total: int, size: int = 4096) -> AsyncIterator[bytes]:
    for start in range(0, total, size):
        yield b" " * min(size, total - start)


async def test_oversize_bodies_are_refused_declared_or_streamed() -> None:
    app = _app(["127.0.0.1"], max_body_bytes=64 << 10)
    declared = await _send(app, "/v1/traces", b"x" * (65 << 10), "application/x-protobuf")
    assert declared.status_code == 413 and declared.json()["error"] == "too_large"
    streamed = await _send(app, "/v1/traces", _chunks(1 << 20), "application/x-protobuf")  # chunked: no length
    assert streamed.status_code == 413 and streamed.json()["error"] == "too_large"
    assert (await _send(app, "/v1/traces", _chunks(60 << 10), "application/x-protobuf")).json() == {"size": 60 << 10}
    # a route's own, smaller limit (read_body) stops reading at it
    assert (
        "over 1,000 bytes" in (await _send(app, "/v1/tasks", _chunks(5000), "application/json")).json()["route_refused"]
    )
    assert (await _send(app, "/v1/tasks", b"[1]", "application/json")).json() == {"accepted": True, "size": 3}


@pytest.mark.parametrize(
    "body",
    [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000, b"\xff\xfe", b"NaN", b"{'a': 1}", b""],
)
def test_parse_json_refuses_bad_and_deep_bodies_with_one_error(body: bytes) -> None:
    with pytest.raises(MalformedBodyError, match="not JSON"):
        parse_json(body)


def test_parse_json_reads_json() -> None:
    assert parse_json(b'{"a": [1, 2.5, "\\u00e9", null, true]}') == {"a": [1, 2.5, "\u00e9", None, True]}


async def test_public_pages_need_no_token_but_everything_else_does() -> None:
    app = FastAPI()
    guard(app, ["127.0.0.1"], token="s3cret", public_pages=("/dashboard",))

    @app.get("/dashboard/{name:path}")
    async def page(name: str) -> dict[str, str]:
        return {"page": name}

    @app.get("/dashboardx")
    async def lookalike() -> dict[str, str]:
        return {"data": "x"}

    @app.get("/v1/dashboard/overview")
    async def data() -> dict[str, str]:
        return {"data": "x"}

    @app.post("/dashboard/form")
    async def post() -> dict[str, str]:
        return {"data": "x"}

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
        assert (await client.get("/dashboard/app.js")).status_code == 200
        assert (await client.get("/v1/dashboard/overview")).status_code == 401  # the data needs the token
        assert (await client.get("/dashboardx")).status_code == 401  # a prefix of a name is not the folder
        assert (await client.post("/dashboard/form", json={})).status_code == 401  # GETs only
        authorised = await client.get("/v1/dashboard/overview", headers={"authorization": "Bearer s3cret"})
        assert authorised.status_code == 200
