"""The LLM proxy's HTTP side: its routes (OpenAI's, per attempt and unattributed; Agent Lightning
1.0's beside them with ``--agl-v1-model``), the token its listener requires, and its processes
(``serving`` in a block, ``main`` until SIGTERM, as one process or several on one port)."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import signal
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import asdict, replace
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response

from agl_stream import metrics
from agl_stream.auth import listener_token
from agl_stream.config import Settings
from agl_stream.domain.llm_calls import CHAT, COMPLETION
from agl_stream.errors import AglError, ConfigError
from agl_stream.http_serving import (
    MalformedBodyError,
    QuietServer,
    allowed_hosts,
    bind,
    guard,
    listen,
    parse_json,
    server_config,
)
from agl_stream.local.processes import run_until_stopped
from agl_stream.logs import configure_logging, get_logger
from producers.llm_proxy.agl_v1 import install
from producers.llm_proxy.proxy import LLMProxy, ProxyOptions

log = get_logger("agl.llm_proxy")


async def _json_body(request: Request) -> Any:
    try:
        return parse_json(await request.body())
    except MalformedBodyError:
        return None


def create_app(proxy: LLMProxy) -> FastAPI:
    """The proxy's app: module-level routes reading the proxy from ``app.state``."""
    app = FastAPI(title="agl-stream LLM proxy", docs_url=None, redoc_url=None, openapi_url=None)
    guard(app, allowed_hosts(proxy.options.host, proxy.settings.extra_hosts), proxy_token(proxy))
    app.state.proxy = proxy
    app.add_route("/metrics", metrics.metrics_endpoint, methods=["GET"])
    app.include_router(router)
    if proxy.options.agl_v1 is not None:
        install(app, proxy, proxy.options.agl_v1)
    return app


def _proxy(request: Request) -> LLMProxy:
    proxy: LLMProxy = request.app.state.proxy
    return proxy


Proxy = Annotated[LLMProxy, Depends(_proxy)]
router = APIRouter()


@router.get("/health")
async def health(proxy: Proxy) -> dict[str, Any]:
    return proxy.health()


@router.get("/v1/models")
@router.get("/rollout/{rollout_id}/attempt/{attempt_id}/v1/models")
async def models(proxy: Proxy) -> dict[str, Any]:
    data = [{"id": m, "object": "model", "created": proxy.started, "owned_by": "agl-stream"} for m in proxy.models]
    return {"object": "list", "data": data}


@router.post("/rollout/{rollout_id}/attempt/{attempt_id}/v1/chat/completions")
async def attempt_chat(rollout_id: str, attempt_id: str, request: Request, proxy: Proxy) -> Response:
    return await proxy.handle(CHAT, await _json_body(request), rollout_id, attempt_id, request.headers)


@router.post("/rollout/{rollout_id}/attempt/{attempt_id}/v1/completions")
async def attempt_completion(rollout_id: str, attempt_id: str, request: Request, proxy: Proxy) -> Response:
    return await proxy.handle(COMPLETION, await _json_body(request), rollout_id, attempt_id, request.headers)


@router.post("/v1/chat/completions")
async def chat(request: Request, proxy: Proxy) -> Response:
    return await proxy.handle(CHAT, await _json_body(request), None, None)


@router.post("/v1/completions")
async def completion(request: Request, proxy: Proxy) -> Response:
    return await proxy.handle(COMPLETION, await _json_body(request), None, None)


def proxy_token(proxy: LLMProxy) -> str | None:
    """The token the listener requires: the stack's (``listener_token``) or the 1.0 key given
    for Agent Lightning 1.0's clients, which send it as theirs. Both given must agree."""
    token = listener_token(proxy.settings, proxy.options.host)
    key = proxy.options.agl_v1_key
    if key and token is not None and key != token:
        raise ConfigError(
            "--agl-v1-key differs from the API token this listener requires (AGL_API_TOKEN): give 1.0's "
            "clients that token as their key, and leave --agl-v1-key unset"
        )
    return key or token


@contextlib.asynccontextmanager
async def serving(
    settings: Settings, model_list: Sequence[Mapping[str, Any]], options: ProxyOptions | None = None
) -> AsyncIterator[LLMProxy]:
    """Run the proxy on ``options.host:port`` (0: a free port) until the block exits; ``proxy.url`` is its URL."""
    options = options or ProxyOptions()
    proxy = LLMProxy(settings, model_list, options)
    sock = listen(options.host, options.port, reuse_port=options.reuse_port)  # a taken port fails fast
    try:
        await proxy.start()
    except BaseException:
        sock.close()
        raise
    host, port = sock.getsockname()[:2]
    url_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    proxy.url = f"http://[{url_host}]:{port}" if ":" in url_host else f"http://{url_host}:{port}"
    server = QuietServer(server_config(create_app(proxy)))
    task = asyncio.create_task(server.serve(sockets=[sock]), name="llm-proxy:http")
    try:
        # The socket already listens: clients connecting now queue until uvicorn accepts them.
        yield proxy
    finally:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await task
        sock.close()
        await proxy.close()


async def run(
    settings: Settings, model_list: Sequence[Mapping[str, Any]], options: ProxyOptions, stop: asyncio.Event
) -> None:
    async with serving(settings, model_list, options) as proxy:
        attempt_url = f"{proxy.url}/rollout/<rollout_id>/attempt/<attempt_id>/v1"
        log.info("LLM proxy started", url=proxy.url, models=proxy.models, attempt_url=attempt_url)
        # Workers sharing one port (SO_REUSEPORT) would each answer a scrape of it at random:
        # each serves its own metrics on a port of its own instead.
        if options.reuse_port:
            endpoint: contextlib.AbstractContextManager[Any] = metrics.expose(settings, metrics.role())
        else:
            endpoint = metrics.advertised(settings, metrics.role(), f"{proxy.url}/metrics")
        with endpoint:
            await stop.wait()
        log.info("LLM proxy stopping", **asdict(proxy.stats))


def main(settings: Settings, model_list: Sequence[Mapping[str, Any]], options: ProxyOptions) -> None:
    """Run the proxy until SIGTERM or Ctrl-C (``agl-stream llm-proxy``)."""
    if options.workers <= 1:
        run_until_stopped(lambda stop: run(settings, model_list, options, stop))
        return
    # The parent holds the port (bound, never listening, so the kernel hands it no connection):
    # port 0 resolves once and every worker joins the same SO_REUSEPORT group.
    holder = bind(options.host, options.port, reuse_port=True)
    child = replace(options, port=holder.getsockname()[1], workers=1, reuse_port=True)
    context = multiprocessing.get_context("spawn")
    children = [
        context.Process(target=_worker, args=(settings, list(model_list), child), name=f"llm-proxy-{i}")
        for i in range(options.workers)
    ]
    for process in children:
        process.start()

    def forward(signum: int, _frame: object) -> None:
        for process in children:
            if process.pid is not None and process.is_alive():
                os.kill(process.pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    for process in children:
        process.join()
    holder.close()
    failed = [p.exitcode for p in children if p.exitcode]
    if failed:
        raise AglError(
            f"{len(failed)} of {len(children)} LLM proxy workers failed (exit codes {failed}); see their logs"
        )


def _worker(settings: Settings, model_list: list[dict[str, Any]], options: ProxyOptions) -> None:
    configure_logging(settings.log_level, settings.log_format)  # a spawned process starts bare
    metrics.set_role("llm-proxy")
    run_until_stopped(lambda stop: run(settings, model_list, options, stop))
