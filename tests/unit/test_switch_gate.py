"""The hand-off gate's rules over real loopback HTTP (no Kafka): held calls go to the new server,
calls in flight drain, a call cut before any output is resent, a stream cut after its output
began ends with a typed error, and each deadline ends in a clear 503 with Retry-After."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress

import httpx
from aiohttp import web

from agl_stream.http_serving import QuietServer, listen, server_config
from agl_stream.wire.semconv import POLICY_VERSION_HEADER
from consumers.switch_gate import SWITCH_CUT, SWITCH_TIMEOUT, HandoffOptions, SwitchGate

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


class Upstream:
    """A model server: answers at once, or holds a call until released or cut."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.url = ""
        self.hold = False
        self.holding = asyncio.Event()
        self.cut = asyncio.Event()
        self.release = asyncio.Event()

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("stream"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(b'data: {"choices": [{"delta": {"content": "he"}}]}\n\n')
            if self.hold:
                self.holding.set()
                await self.cut.wait()
                assert request.transport is not None
                request.transport.close()  # the server stops mid-stream
                return response
            await response.write(b"data: [DONE]\n\n")
            return response
        if self.hold:
            self.holding.set()
            done = asyncio.create_task(self.release.wait())
            cut = asyncio.create_task(self.cut.wait())
            await asyncio.wait({done, cut}, return_when=asyncio.FIRST_COMPLETED)
            if self.cut.is_set():
                assert request.transport is not None
                request.transport.close()  # the server stops before it answered
        return web.json_response({"served_by": self.name})


@asynccontextmanager
async def upstream(name: str) -> AsyncIterator[Upstream]:
    server = Upstream(name)
    app = web.Application()
    app.router.add_post("/v1/chat/completions", server.chat)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    try:
        yield server
    finally:
        server.release.set()
        server.cut.set()
        await runner.cleanup()


@asynccontextmanager
async def gate_on_loopback(options: HandoffOptions) -> AsyncIterator[tuple[SwitchGate, httpx.AsyncClient]]:
    gate = SwitchGate(options)
    sock = listen("127.0.0.1", 0)
    front = QuietServer(server_config(gate))
    task = asyncio.create_task(front.serve(sockets=[sock]))
    port = sock.getsockname()[1]
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=60) as http:
            yield gate, http
    finally:
        await gate.close()
        front.should_exit = True
        with suppress(Exception):
            await task
        sock.close()


async def until(check: Callable[[], bool], timeout: float = 30.0) -> None:
    """Until ``check()`` holds (state the gate's request tasks change)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def test_calls_wait_for_the_first_server_and_are_stamped_with_its_version() -> None:
    async with upstream("old") as old, gate_on_loopback(HandoffOptions(hold_timeout_s=60)) as (gate, http):
        assert (await http.get("/health")).status_code == 503  # nothing served yet
        call = asyncio.create_task(http.post("/v1/chat/completions", json=BODY))
        await until(lambda: gate.stats.held == 1)
        await gate.resume(old.url, 3)
        answer = await call
        assert answer.status_code == 200 and answer.json() == {"served_by": "old"}
        assert answer.headers[POLICY_VERSION_HEADER] == "3"
        health = (await http.get("/health")).json()
        assert health["status"] == "ok" and health["policy_version"] == 3 and health["handoff"]["switches"] == 0


async def test_a_switch_drains_the_calls_in_flight_and_sends_the_held_ones_to_the_new_server() -> None:
    async with (
        upstream("old") as old,
        upstream("new") as new,
        gate_on_loopback(HandoffOptions(hold_timeout_s=60)) as (gate, http),
    ):
        await gate.resume(old.url, 0)
        old.hold = True
        in_flight = asyncio.create_task(http.post("/v1/chat/completions", json=BODY))
        await old.holding.wait()
        gate.pause()
        held = asyncio.create_task(http.post("/v1/chat/completions", json=BODY))
        await until(lambda: gate.stats.held == 1)
        draining = asyncio.create_task(gate.drain(60))
        await asyncio.sleep(0)
        assert not draining.done()
        old.release.set()
        assert await draining == 0  # drained: nothing to cut
        first = await in_flight
        assert first.json() == {"served_by": "old"} and first.headers[POLICY_VERSION_HEADER] == "0"
        assert (await http.get("/health")).json()["status"] == "switching"
        await gate.resume(new.url, 1)
        second = await held
        assert second.json() == {"served_by": "new"} and second.headers[POLICY_VERSION_HEADER] == "1"
        assert gate.stats.switches == 1 and gate.stats.longest_pause_s > 0 and gate.stats.refused == 0


async def test_a_call_cut_before_any_output_is_resent_to_the_new_server() -> None:
    async with (
        upstream("old") as old,
        upstream("new") as new,
        gate_on_loopback(HandoffOptions(hold_timeout_s=60)) as (gate, http),
    ):
        await gate.resume(old.url, 0)
        old.hold = True
        call = asyncio.create_task(http.post("/v1/chat/completions", json=BODY))
        await old.holding.wait()
        gate.pause()
        assert await gate.drain(0.05) == 1  # the drain deadline passes: the switch goes ahead
        old.cut.set()  # the old server stops
        await gate.resume(new.url, 1)
        answer = await call
        assert answer.status_code == 200 and answer.json() == {"served_by": "new"}
        assert answer.headers[POLICY_VERSION_HEADER] == "1" and gate.stats.retried == 1


async def test_a_stream_cut_after_its_output_began_ends_with_a_typed_error_event() -> None:
    async with upstream("old") as old, gate_on_loopback(HandoffOptions(hold_timeout_s=60)) as (gate, http):
        await gate.resume(old.url, 0)
        old.hold = True
        async with http.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True}) as response:
            assert response.headers[POLICY_VERSION_HEADER] == "0"
            lines = response.aiter_lines()
            assert (await anext(lines)).startswith("data: ")
            gate.pause()
            assert await gate.drain(0.05) == 1
            old.cut.set()
            rest = [line async for line in lines if line.startswith("data: ")]
        error = json.loads(rest[0].removeprefix("data: "))["error"]
        assert error["code"] == SWITCH_CUT and rest[-1] == "data: [DONE]" and gate.stats.cut == 1


async def test_a_call_held_past_the_deadline_is_answered_503_with_retry_after() -> None:
    async with (
        upstream("old") as old,
        gate_on_loopback(HandoffOptions(hold_timeout_s=0.3, retry_after_s=7)) as (
            gate,
            http,
        ),
    ):
        await gate.resume(old.url, 0)
        gate.pause()
        answer = await http.post("/v1/chat/completions", json=BODY)
        assert answer.status_code == 503 and answer.headers["retry-after"] == "7"
        assert answer.json()["error"]["code"] == SWITCH_TIMEOUT and gate.stats.refused == 1


async def test_a_stopping_gate_refuses_its_held_calls_at_once() -> None:
    async with gate_on_loopback(HandoffOptions(hold_timeout_s=60)) as (gate, http):
        call = asyncio.create_task(http.post("/v1/chat/completions", json=BODY))
        await until(lambda: gate.stats.held == 1)
        await gate.close()
        answer = await call
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "server_stopping"
