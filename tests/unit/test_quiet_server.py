"""QuietServer, the uvicorn server every HTTP role runs: it serves, and ``should_exit`` stops it
at once although its loop otherwise ticks rarely (an idle role's event loop sleeps)."""

from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI

from agl_stream.http_serving import QuietServer, listen, server_config


async def test_setting_should_exit_stops_the_server_without_waiting_for_a_tick() -> None:
    app = FastAPI()

    @app.get("/ping")
    async def ping() -> dict[str, bool]:
        return {"ok": True}

    sock = listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = QuietServer(server_config(app))
    server.TICK_S = 3600.0  # only the flag can end the wait in time
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with httpx.AsyncClient(trust_env=False) as client:
            for _ in range(600):  # up to a minute for the server to start on a busy machine
                if server.started:
                    break
                await asyncio.sleep(0.1)
            response = await client.get(f"http://127.0.0.1:{port}/ping")
        assert response.json() == {"ok": True}
        assert response.headers["date"].endswith("GMT")  # the tick renewed it before serving
        assert not server.should_exit
        server.should_exit = True
        await asyncio.wait_for(serving, 60)
        assert server.should_exit
    finally:
        serving.cancel()
        sock.close()
