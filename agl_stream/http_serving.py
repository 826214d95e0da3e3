"""What every HTTP role (gateway, inference backend, LLM proxy) shares to serve with uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import math
import re
import socket
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping
from typing import Annotated, Any
from urllib.parse import urlsplit

import h11
import pydantic_core
import uvicorn
from fastapi import Depends
from fastapi.routing import APIRoute
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from agl_stream import metrics
from agl_stream.auth import LOOPBACK
from agl_stream.errors import AglError

# Longer than any client keeps an idle connection (httpx, under LiteLLM and our clients: 5 s),
# so the client always drops an idle connection first. With uvicorn's default (also 5 s) a
# request sent just as the server closed that connection failed as "cannot connect"; seen as
# 502s from the LLM proxy while the inference server was busy loading a checkpoint.
KEEP_ALIVE_S = 75

HEAD_TIMEOUT_S = 15.0
"""The longest a request's head (request line and headers) may take to arrive, from the
connection's start or the request's first byte. Clients send a head in one write; a head that
trickles in (slowloris) would otherwise hold its connection open for ever, as uvicorn's h11
protocol has no such limit."""


class HeadTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request head (:data:`HEAD_TIMEOUT_S`): a
    connection whose head has not completed by then is closed. The deadline starts when the
    connection opens and again at the first byte of each later request on it; it stops once the
    head is parsed, so a slow body or a slow answer is not cut short."""

    head_timeout_s: float = HEAD_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = self.loop.call_later(self.head_timeout_s, self._head_overdue)

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None and self.conn.their_state is h11.IDLE:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_overdue)
        super().data_received(data)
        self._head_check()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may parse a pipelined request's head
        self._head_check()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def _head_check(self) -> None:
        if self.conn.their_state is not h11.IDLE:  # the head is in
            self._stop_head_timer()

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_overdue(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def server_config(app: ASGIApp, *, head_timeout_s: float = HEAD_TIMEOUT_S) -> uvicorn.Config:
    """How every role serves: no uvicorn logging or lifespan, keep-alive past the clients', and
    a deadline on every request head (:class:`HeadTimeoutProtocol`)."""
    protocol = type("HeadTimeoutProtocol", (HeadTimeoutProtocol,), {"head_timeout_s": head_timeout_s})
    return uvicorn.Config(
        app,
        http=protocol,
        log_config=None,
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=10,
        timeout_keep_alive=KEEP_ALIVE_S,
    )


class QuietServer(uvicorn.Server):
    """uvicorn without its own signal handling: the role that runs it decides when it stops
    (``should_exit = True``, from the server's event loop).

    uvicorn's main loop wakes ten times a second to look at ``should_exit``; here setting it
    wakes the loop, which otherwise ticks once a second (the Date header's resolution): an
    idle role's event loop sleeps."""

    TICK_S = 1.0

    @property  # type: ignore[override]
    def should_exit(self) -> bool:
        return self._exit.is_set()

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        if "_exit" not in self.__dict__:  # uvicorn's __init__ sets the flag first
            self._exit = asyncio.Event()
        if value:
            self._exit.set()
        else:
            self._exit.clear()

    async def main_loop(self) -> None:
        while not await self.on_tick(0):  # counter 0: the Date header is renewed at every tick
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._exit.wait(), self.TICK_S)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A bound (not yet listening) TCP socket; a taken port is an AglError that says what to do."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    # Accepted connections inherit it. Without it uvicorn's separate header and body writes meet
    # the client's delayed ACK: every response took ~44 ms instead of ~2 (measured on the gateway).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise AglError(f"cannot listen on {host}:{port} ({error}); choose another port (0 picks a free one)") from error
    return sock


def listen(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A listening, non-blocking socket to hand to uvicorn (port 0 is resolved by the caller)."""
    sock = bind(host, port, reuse_port=reuse_port)
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def allowed_hosts(bind_host: str, extra: Iterable[str] = ()) -> list[str]:
    """The names a listener bound to ``bind_host`` answers to (the Host header, without port).

    Loopback names always; the bound address itself; what the operator adds
    (``AGL_ALLOWED_HOSTS``, "*" for any). A wildcard bind (0.0.0.0, ::) adds nothing by itself:
    the names clients use for the machine must be listed.
    """
    names = [*LOOPBACK]
    if bind_host not in ("0.0.0.0", "::", "") and bind_host not in names:
        names.append(bind_host)
    names += [h.strip() for h in extra if h.strip() and h.strip() not in names]
    return names


MAX_BODY_BYTES = 32 << 20
"""The largest request body a listener reads, unless it says otherwise."""


def guard(
    app: Any,
    hosts: list[str],
    token: str | None = None,
    *,
    max_body_bytes: int = MAX_BODY_BYTES,
    media_types: Mapping[str, frozenset[str]] | None = None,
    public_pages: tuple[str, ...] = (),
) -> None:
    """What every listener refuses before any route runs: a Host header naming another host
    (DNS rebinding: a web page's name resolved to 127.0.0.1) and a request a web page of another
    origin sent (browsers name the page's origin on every cross-origin POST); no CORS headers
    are ever added, so a page cannot read an answer either. With ``token``, every request but
    a health check must carry ``Authorization: Bearer <token>``. Bodies are JSON only (what
    ``media_types`` allows besides, per path) and at most ``max_body_bytes``: see BodyPolicy.
    ``public_pages``: path prefixes whose GETs need no token (static files that hold no data,
    such as the dashboard's page, which then sends the token on its own requests)."""
    app.add_middleware(BodyPolicy, max_bytes=max_body_bytes, media_types=media_types or {})
    if token is not None:
        app.add_middleware(BearerToken, token=token, public_pages=public_pages)
    app.add_middleware(SameOriginOnly, hosts=hosts)
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=[_host_pattern(h) for h in hosts])
    app.add_middleware(RequestMetrics)  # outermost: refused requests are counted too


class RequestMetrics:
    """Times every HTTP request into ``agl_http_request_seconds`` by method, route template
    (the matched route's path, so ids never become label values; ``unmatched`` when no route
    served it, a refusal before routing included) and status (0: no answer was started)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 0

        async def watched(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            route = getattr(scope.get("route"), "path", None)
            if route is not None and scope.get("root_path"):
                route = f"{scope['root_path']}{route}"
            metrics.HTTP_REQUEST_SECONDS.labels(
                metrics.role(), scope.get("method", ""), route or "unmatched", str(status)
            ).observe(time.perf_counter() - started)


def _host_pattern(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class SameOriginOnly:
    """Refuses a request whose ``Origin`` header names a host this listener does not answer to
    (403 ``cross_origin``); requests without one (any non-browser client) pass."""

    def __init__(self, app: ASGIApp, hosts: list[str]) -> None:
        self.app = app
        self.any = "*" in hosts
        self.hosts = {h.strip("[]").lower() for h in hosts}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self.any:
            origin = next((v for k, v in scope["headers"] if k == b"origin"), None)
            if origin is not None and not self._same(origin.decode("latin-1")):
                response = JSONResponse(
                    {
                        "error": "cross_origin",
                        "message": "requests from web pages of other origins are refused; call this API from "
                        "a program (see AGL_ALLOWED_HOSTS to name the hosts it answers to)",
                    },
                    status_code=403,
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _same(self, origin: str) -> bool:
        try:
            host = urlsplit(origin).hostname
        except ValueError:
            return False
        return host is not None and host.lower() in self.hosts


# Liveness answers carry no data, so probes (and the seed client's health check) need no token.
HEALTH_PATHS = frozenset({"/health", "/healthz", "/v1/health", "/v1/agl/health"})


class BearerToken:
    """Refuses a request without the listener's token (401 ``unauthorized``), health checks aside.

    The token comes as ``Authorization: Bearer <token>`` or, as several LLM APIs take a key, as
    ``x-api-key: <token>``. The refusal's body carries ``detail`` too (FastAPI's error key, which
    Agent Lightning 1.0's clients read)."""

    def __init__(self, app: ASGIApp, token: str, public_pages: tuple[str, ...] = ()) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()
        self.key = token.encode()
        self.public_pages = public_pages

    def _public(self, scope: Scope) -> bool:
        path = scope["path"]
        if path in HEALTH_PATHS:
            return True
        return scope["method"] in ("GET", "HEAD") and any(
            path == prefix or path.startswith(f"{prefix}/") for prefix in self.public_pages
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self._public(scope):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            key = next((v for k, v in scope["headers"] if k == b"x-api-key"), None)
            if not hmac.compare_digest(given, self.expected) and not (
                key is not None and hmac.compare_digest(key, self.key)
            ):
                response = JSONResponse(
                    {
                        "error": "unauthorized",
                        "message": "this listener requires its API token: send `Authorization: Bearer <token>` "
                        "(the token is AGL_API_TOKEN, or the file api-token in the stack's run dir)",
                        "detail": "Invalid or missing API key",
                    },
                    status_code=401,
                    headers={"www-authenticate": "Bearer"},
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


JSON_TYPES = frozenset({"application/json"})


class BodyTooLargeError(AglError):
    """A request body over the limit of its listener or route (HTTP 413)."""


class MalformedBodyError(AglError):
    """A request body that is not the JSON its route takes (HTTP 400)."""


def error_json(
    status: int, kind: str, message: str, *, headers: Mapping[str, str] | None = None, **extra: Any
) -> JSONResponse:
    """The listeners' error shape: ``{"error": kind, "message": message}`` plus ``extra`` keys."""
    return JSONResponse(
        {"error": kind, "message": message, **extra}, status_code=status, headers=dict(headers) if headers else None
    )


class Refusal(AglError):
    """A request answered with an error instead of a result: raised by a route or one of its
    dependencies, answered by the routes of :func:`answering` (``response()``)."""

    def __init__(
        self, status: int, kind: str, message: str, *, headers: Mapping[str, str] | None = None, **extra: Any
    ) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message
        self.headers = headers
        self.extra = extra

    def response(self) -> JSONResponse:
        return error_json(self.status, self.kind, self.message, headers=self.headers, **self.extra)


def answering(errors: Callable[[Exception], Response | None] | None = None) -> type[APIRoute]:
    """A route class (``APIRouter(route_class=...)``) whose routes answer a :class:`Refusal`, and
    every exception ``errors`` maps to a response, in one place: FastAPI's per-router error
    handling, so the routers of one app keep their own mappings. ``errors`` answers None for an
    exception it does not know, which then propagates."""

    class Answering(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def answer(request: Request) -> Response:
                try:
                    return await handler(request)
                except Refusal as refusal:
                    return refusal.response()
                except Exception as exc:
                    response = errors(exc) if errors is not None else None
                    if response is None:
                        raise
                    return response

            return answer

    return Answering


def refuse_while_stopping(request: Request) -> None:
    """A dependency: 503 ``stopping`` (retry in a moment) while the app's ``state.stopping()``
    says it shuts down."""
    if request.app.state.stopping():
        raise Refusal(503, "stopping", f"the {request.app.title} is shutting down", headers={"Retry-After": "2"})


Serving = Annotated[None, Depends(refuse_while_stopping)]
"""A route's parameter that refuses while its app stops, in order among its other dependencies."""


class BodyPolicy:
    """Refuses a body that is not JSON (415 ``unsupported_media_type``; ``media_types`` adds
    types per path, such as OTLP's protobuf) and a body over ``max_bytes`` (413 ``too_large``).

    Only JSON: a web page can send ``text/plain`` or a form to any address without asking first,
    JSON it cannot. The size is counted as the body streams in, so a chunked body without a
    Content-Length is refused at the limit instead of being buffered whole.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, media_types: Mapping[str, frozenset[str]]) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.media_types = media_types

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        has_body = declared not in (None, b"0") or b"transfer-encoding" in headers
        media_type = headers.get(b"content-type", b"").decode("latin-1").split(";")[0].strip().lower()
        allowed = JSON_TYPES | self.media_types.get(scope["path"], frozenset())
        if has_body and media_type not in allowed:
            response = error_json(
                415,
                "unsupported_media_type",
                f"the body must be {' or '.join(sorted(allowed))} (send `content-type: application/json`), "
                f"not {media_type or 'untyped'}",
            )
            await response(scope, receive, send)
            return
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        seen = 0
        started = False

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLargeError(f"the body is over {self.max_bytes:,} bytes")
            return message

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, watched)
        except BodyTooLargeError:
            if started:
                raise
            await self._too_large(scope, receive, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"the request body is over {self.max_bytes:,} bytes: send less per request"
        response = error_json(413, "too_large", message)
        await response(scope, receive, send)


async def read_body(request: Request, limit: int, advice: str = "send less per request") -> bytes:
    """The raw body, refused (BodyTooLargeError) as soon as it is over ``limit``, before it is all
    in memory; ``advice`` ends the error message."""
    too_large = BodyTooLargeError(f"the request body is over {limit:,} bytes: {advice}")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


_MAYBE_OVERFLOW = re.compile(rb"[eE]\+?[0-9]{3}|[0-9]{300}")
"""What a JSON number that overflows a double looks like (a three-digit exponent, or 300
digits and more); bodies without it cannot hold one, and skip the walk below."""


def parse_json(body: bytes) -> Any:
    """A JSON body as Python values; MalformedBodyError for bad JSON, bad UTF-8, nesting too deep
    (the parser stops at a fixed depth, so no body can exhaust the stack) and numbers that are
    not finite. JSON has no infinity, but the parser turns a number too large for a double
    (``1e400``) into one; no answer could carry it back (:class:`FiniteJSONResponse`)."""
    try:
        value = pydantic_core.from_json(body, allow_inf_nan=False)
    except ValueError as error:
        raise MalformedBodyError(f"the body is not JSON: {error}") from None
    if _MAYBE_OVERFLOW.search(body) and not all_finite(value):
        raise MalformedBodyError("the body holds a number that is not finite (too large for a double, such as 1e400)")
    return value


def all_finite(value: Any) -> bool:
    """Whether every float in a JSON value (dicts, lists, scalars) is finite."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                return False
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return True


def finite_or_null(value: Any) -> Any:
    """A JSON value with every non-finite float replaced by None (JSON's null)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_or_null(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_null(item) for item in value]
    return value


class FiniteJSONResponse(JSONResponse):
    """A JSON answer that renders a non-finite number as null where Starlette's refuses the
    whole answer: a value another writer stored (agl-stream's own client takes infinities) must
    not make every read of it fail."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except ValueError:  # "Out of range float values are not JSON compliant"
            return json.dumps(
                finite_or_null(content), ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
            ).encode("utf-8")
