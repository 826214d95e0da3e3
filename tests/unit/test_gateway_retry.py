"""The store client's reads ride through a gateway restart: asked again with backoff, at the
gateway's new address, until the request's timeout (the HTTP edge alone, with a fake transport)."""

from __future__ import annotations

import httpx
import pytest

from agl_stream.errors import GatewayUnavailableError
from agl_stream.store.readside import GatewayReadSide

ANSWER = {"columns": ["n"], "rows": [[1]]}


async def test_a_read_waits_out_a_restart_and_follows_the_new_address() -> None:
    seen: list[str] = []

    def gateway(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        if request.url.port == 1001:
            raise httpx.ConnectError("connection refused", request=request)  # the old process is gone
        if len([u for u in seen if ":1002" in u]) == 1:
            return httpx.Response(503, json={"error": "stopping"})  # the new one is still starting
        return httpx.Response(200, json=ANSWER)

    address = {"url": "http://127.0.0.1:1001"}
    async with httpx.AsyncClient(transport=httpx.MockTransport(gateway)) as client:
        reads = GatewayReadSide(address["url"], client=client, locate=lambda: address["url"])
        address["url"] = "http://127.0.0.1:1002"  # the restarted gateway's record
        result = await reads.query("SELECT 1 AS n", timeout=120)
    assert result.rows == [[1]]
    assert [u.split("/v1")[0] for u in seen] == ["http://127.0.0.1:1001", *["http://127.0.0.1:1002"] * 2]


async def test_a_gateway_that_stays_down_is_an_error_after_the_timeout() -> None:
    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    async with httpx.AsyncClient(transport=httpx.MockTransport(down)) as client:
        reads = GatewayReadSide("http://127.0.0.1:1001", client=client, query_margin=0.0)
        with pytest.raises(GatewayUnavailableError, match="still after"):
            await reads.query("SELECT 1", timeout=0.5)
