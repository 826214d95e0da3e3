"""The hand-off gate of the vLLM inference role: the role's port, in front of its vLLM child, so a
switch to a new policy version drops no call (``consumers/vllm_server.py`` drives it).

Every request to the role passes through the gate on its way to the child (vLLM's server on a
private loopback port); the gate is the one place that sees every call to this server, from any
number of LLM proxies and runners, so it knows exactly which are in flight. A switch is:

- **pause**: new calls are held at the gate (they wait, their connection open) instead of
  reaching a server that is about to stop; a call held past ``hold_timeout_s`` is answered 503
  with ``Retry-After`` and the error code :data:`SWITCH_TIMEOUT` (OpenAI's error body).
- **drain**: the calls in flight finish on the old server; after ``drain_timeout_s`` the switch
  goes ahead anyway. A call the stop cuts before any of its output reached the caller (a whole
  non-streamed answer is read before it is sent on, so that is every non-streamed call) is held
  again and sent to the new server; a stream cut after its first bytes ends with an error event
  whose code is :data:`SWITCH_CUT`.
- **resume**: once the new server answers ``/health``, the held calls go to it.

Every answer carries :data:`~agl_stream.wire.semconv.POLICY_VERSION_HEADER`: the version of the
server the call was sent to (vLLM names none; the LLM proxy records it on the call's span).
``GET /health`` is the gate's own: 503 until the first server is ready, then 200 with status
``ok`` or ``switching``, the version served, the calls in flight and the hand-off counters (held,
retried, cut, refused calls; the longest pause, the longest hold of one call).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx
from starlette.types import Message, Receive, Scope, Send

from agl_stream.domain.llm_calls import CallError, error_of_status
from agl_stream.logs import get_logger
from agl_stream.wire.semconv import POLICY_VERSION_HEADER

log = get_logger("agl.inference.gate")

SWITCH_TIMEOUT = "policy_switch_timeout"
"""Error code of a call held past the hold deadline while the server switched versions."""
SWITCH_CUT = "policy_switch_cut"
"""Error code of a stream the switch cut after its output had begun (past the drain deadline)."""

_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "host"}
)


@dataclass(frozen=True)
class HandoffOptions:
    hold_timeout_s: float = 540.0
    """Longest a call waits for a switch (a little under the LLM proxy's 600 s call timeout, so
    the agent gets this clear 503 rather than the proxy's timeout)."""
    drain_timeout_s: float = 120.0
    """Longest a switch waits for the calls in flight before it stops the old server."""
    retry_after_s: int = 30
    """``Retry-After`` of a call refused past the hold deadline."""


@dataclass
class GateStats:
    forwarded: int = 0
    held: int = 0
    """Calls that waited at the gate (for a switch or the first start)."""
    retried: int = 0
    """Calls cut before any output and sent again to the next server."""
    cut: int = 0
    """Streams cut after their output had begun (answered with a SWITCH_CUT error event)."""
    refused: int = 0
    """Calls held past the hold deadline (503, SWITCH_TIMEOUT)."""
    switches: int = 0
    """Pauses that ended with a server serving again (the first start not counted)."""
    longest_pause_s: float = 0.0
    """Longest time from a pause to its resume."""
    longest_hold_s: float = 0.0
    """Longest time one call spent held (what an agent sees as a slower call)."""


def switch_timeout_error(held_s: float) -> CallError:
    return error_of_status(
        503,
        f"the model server is switching policy versions and was not back within {held_s:.0f} s; retry later",
        code=SWITCH_TIMEOUT,
    )


def stopping_error() -> CallError:
    return error_of_status(503, "the model server is stopping; retry on another one", code="server_stopping")


def switch_cut_error() -> CallError:
    return error_of_status(
        503,
        "the model server switched policy versions before this stream ended (the drain deadline passed)",
        code=SWITCH_CUT,
    )


class _Retry(Exception):
    """The call produced no output before its server went away: send it again."""


class _Generation:
    """One server behind the gate: where calls go, the version it serves, its connections."""

    def __init__(self, upstream: str, version: int) -> None:
        self.upstream = upstream
        self.version = version
        self.client = httpx.AsyncClient(
            trust_env=False,
            timeout=httpx.Timeout(None, connect=10.0),
            limits=httpx.Limits(max_connections=4096, max_keepalive_connections=256),
        )
        self.left = asyncio.Event()  # set when the gate pauses: this server is on its way out


class SwitchGate:
    """An ASGI app forwarding every request to the current server, holding them during a switch."""

    def __init__(self, options: HandoffOptions | None = None) -> None:
        self.options = options or HandoffOptions()
        self.stats = GateStats()
        self.in_flight = 0
        self._current: _Generation | None = None
        self._open = asyncio.Event()
        self._idle = asyncio.Condition()
        self._paused_at: float | None = time.monotonic()  # closed until the first server is ready
        self._retired: list[_Generation] = []
        self._closed = False

    @property
    def version(self) -> int | None:
        return self._current.version if self._current is not None else None

    def serving(self) -> bool:
        return self._open.is_set()

    # -- the switch (called by the manager) ----------------------------------------------------

    def pause(self) -> None:
        """Hold new calls from now on (the calls in flight go on)."""
        if not self._open.is_set():
            return
        self._open.clear()
        self._paused_at = time.monotonic()
        if self._current is not None:
            self._current.left.set()

    async def drain(self, timeout_s: float | None = None) -> int:
        """Until no call is in flight, or ``timeout_s`` (default: the drain deadline) passes;
        returns the calls still in flight (the stop that follows cuts them)."""
        timeout = self.options.drain_timeout_s if timeout_s is None else timeout_s
        async with self._idle:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._idle.wait_for(lambda: self.in_flight == 0), timeout)
        return self.in_flight

    async def resume(self, upstream: str, version: int) -> None:
        """Send calls (the held ones first) to the server at ``upstream``, serving ``version``."""
        previous = self._current
        if previous is not None:
            self._retired.append(previous)
        self._current = _Generation(upstream, version)
        if self._paused_at is not None and previous is not None:
            pause = time.monotonic() - self._paused_at
            self.stats.switches += 1
            self.stats.longest_pause_s = max(self.stats.longest_pause_s, pause)
            log.info("calls resumed", version=version, pause_s=round(pause, 3), in_flight=self.in_flight)
        self._paused_at = None
        self._open.set()
        await self._close_retired()

    async def close(self) -> None:
        """The role is stopping: held calls (and any new one) are refused at once."""
        self.pause()
        self._closed = True
        self._open.set()  # wakes the held calls: _admit refuses them
        if self._current is not None:
            self._retired.append(self._current)
            self._current = None
        await self._close_retired()

    async def _close_retired(self) -> None:
        # A retired server is stopped by now: its calls have finished or been cut.
        retired, self._retired = self._retired, []
        for generation in retired:
            await generation.client.aclose()

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok" if self.serving() else "switching",
            "policy_version": self.version,
            "in_flight": self.in_flight,
            "handoff": asdict(self.stats),
        }

    # -- one call --------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/health" and scope["method"] in ("GET", "HEAD"):
            # 503 until the first server is ready (what waits for the role's start reads), then 200:
            # a switch is the role at work, its calls only slower.
            await _send_json(send, 200 if self.version is not None else 503, self.health())
            return
        body, disconnected = await _read_body(receive)
        started = time.monotonic()
        deadline = started + self.options.hold_timeout_s
        held = False
        try:
            while True:
                if not self._open.is_set() and not held:
                    held = True
                    self.stats.held += 1
                generation = await self._admit(deadline)
                if generation is None:
                    self.stats.refused += 1
                    refusal = stopping_error() if self._closed else switch_timeout_error(self.options.hold_timeout_s)
                    await _send_error(send, refusal, self.options)
                    return
                if held:
                    self.stats.longest_hold_s = max(self.stats.longest_hold_s, time.monotonic() - started)
                self.in_flight += 1
                try:
                    await self._forward(scope, body, generation, send, disconnected)
                    self.stats.forwarded += 1
                    return
                except _Retry:
                    self.stats.retried += 1
                    if not held:
                        held = True
                        self.stats.held += 1
                finally:
                    self.in_flight -= 1
                    async with self._idle:
                        self._idle.notify_all()
                # Cut before any output: wait for this server to be switched away from, then again.
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(generation.left.wait(), max(0.0, deadline - time.monotonic()))
        finally:
            disconnected.cancel()

    async def _admit(self, deadline: float) -> _Generation | None:
        """The server to send a call to, once the gate is open; None past ``deadline``."""
        while not self._open.is_set():
            try:
                await asyncio.wait_for(self._open.wait(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return None
        if self._closed or self._current is None:
            return None
        return self._current  # no await since the check: a pause cannot slip in before in_flight counts it

    async def _forward(
        self, scope: Scope, body: bytes, generation: _Generation, send: Send, disconnected: asyncio.Task[None]
    ) -> None:
        query = scope.get("query_string", b"").decode("latin-1")
        url = generation.upstream + scope["path"] + (f"?{query}" if query else "")
        headers = [(k, v) for k, v in scope["headers"] if k.decode("latin-1").lower() not in _HOP_BY_HOP]
        request = generation.client.build_request(scope["method"], url, headers=headers, content=body)
        try:
            response = await generation.client.send(request, stream=True)
        except httpx.TransportError as error:
            raise _Retry from error
        try:
            out = [(k, v) for k, v in response.headers.raw if k.decode("latin-1").lower() not in _HOP_BY_HOP]
            out = [(k, v) for k, v in out if k.decode("latin-1").lower() != POLICY_VERSION_HEADER]
            out.append((POLICY_VERSION_HEADER.encode(), str(generation.version).encode()))
            streamed = response.headers.get("content-type", "").startswith("text/event-stream")
            if not streamed:
                try:
                    content = b"".join([chunk async for chunk in response.aiter_raw()])
                except httpx.TransportError as error:
                    raise _Retry from error
                out = [(k, v) for k, v in out if k.decode("latin-1").lower() != "content-length"]
                out.append((b"content-length", str(len(content)).encode()))
                await send({"type": "http.response.start", "status": response.status_code, "headers": out})
                await send({"type": "http.response.body", "body": content})
                return
            chunks = response.aiter_raw()
            try:
                first = await chunks.__anext__()
            except StopAsyncIteration:
                first = b""
            except httpx.TransportError as error:
                raise _Retry from error
            await send({"type": "http.response.start", "status": response.status_code, "headers": out})
            await send({"type": "http.response.body", "body": first, "more_body": True})
            try:
                async for chunk in chunks:
                    if disconnected.done():
                        return  # the caller left: closing the response stops the server's generation
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except httpx.TransportError:
                self.stats.cut += 1
                event = b"data: " + json.dumps(switch_cut_error().body()).encode() + b"\n\ndata: [DONE]\n\n"
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await response.aclose()


async def _read_body(receive: Receive) -> tuple[bytes, asyncio.Task[None]]:
    """The request's body, and a task that ends when the caller disconnects."""
    parts = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            break

    async def until_disconnect() -> None:
        message: Message = {"type": ""}
        while message["type"] != "http.disconnect":
            message = await receive()

    return b"".join(parts), asyncio.get_running_loop().create_task(until_disconnect())


async def _send_json(send: Send, status: int, document: Any, extra: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    body = json.dumps(document).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _send_error(send: Send, error: CallError, options: HandoffOptions) -> None:
    await _send_json(send, error.status, error.body(), ((b"retry-after", str(options.retry_after_s).encode()),))
