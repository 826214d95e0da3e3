"""The inference server: the tiny policy, or any Hugging Face causal LM folder (CPU, float32),
behind an OpenAI-compatible HTTP API, vLLM-shaped.

Runners' agents reach it through the LLM proxy; the trainer publishes new weights as
``ModelCheckpoint`` resources and this server picks them up.

HTTP API (response shapes follow vLLM's OpenAI server, vLLM >= 0.10.2):
- ``POST /v1/chat/completions`` and ``POST /v1/completions``, non-streaming or streaming
  (server-sent events ``data: {...}`` ending with ``data: [DONE]``). Honoured: model,
  messages / prompt (text, token ids, or a list of either), max_tokens
  (max_completion_tokens), temperature (0 = greedy), top_p, n, seed, stop, stop_token_ids,
  logprobs (bool for chat, int for completions), top_logprobs, stream_options.include_usage
  and vLLM's ``return_token_ids``: chat answers then carry top-level ``prompt_token_ids`` and
  ``choices[i].token_ids``, completions ``choices[i].prompt_token_ids`` and
  ``choices[i].token_ids``. Token ids include the token that ended a response (eos, as vLLM
  does); the text leaves it out. Logprobs are the model's raw log-probabilities (temperature 1,
  no top-p), see agl_stream/policy/model.py. Every answer carries the header
  ``x-agl-policy-version``: the policy version that generated it.
- ``GET /v1/models``, ``GET /health``: the served model and its loaded policy version.
- Errors are OpenAI-style ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad
  request (bad fields or messages, too many tokens), 404 for an unknown model (as vLLM and
  OpenAI answer it), 500 only for the server's own failures.

Generation runs on one worker thread; requests that queue while it is busy and sample alike
(same max_tokens, temperature, top_p, stop, top_logprobs) are generated as one batch. Each
choice draws from its own seeded generator, so a seeded request gives the same answer whatever
it was batched with.

Checkpoints: with Kafka settings the server follows ``agl.resources`` (ResourcesCache). A
snapshot holding a ``ModelCheckpoint`` for the served model name with a higher policy version
than the loaded one is loaded in a thread and swapped in between batches: requests already
generating finish on the old weights. At start the cache catches up first, so a restarted
server serves the latest published version from its first request.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers.utils import logging as hf_logging

from agl_stream import metrics
from agl_stream.auth import listener_token
from agl_stream.config import Settings
from agl_stream.domain.checkpoints import choose_checkpoint, local_checkpoint_path
from agl_stream.http_serving import QuietServer, allowed_hosts, guard, listen, server_config
from agl_stream.local.processes import stop_on_signals
from agl_stream.logs import get_logger
from agl_stream.models import ModelCheckpoint, ResourcesUpdate
from agl_stream.policy import StepToken, build_model, build_tokenizer, load_checkpoint
from agl_stream.store.resources_cache import ResourcesCache
from consumers.inference.engine import Engine, Policy, Sampling
from consumers.inference.openai_api import (
    VERSION_HEADER,
    ApiError,
    ChatRequest,
    ChoiceStream,
    CompletionRequest,
    Prepared,
    SamplingRequest,
    chat_logprobs,
    chat_prompt,
    chat_response,
    completion_logprobs,
    completion_prompts,
    completion_response,
    error_response,
    held_back,
    json_body,
    parse,
    sse,
    usage,
)

log = get_logger("agl.inference")

# -- the server -------------------------------------------------------------------------------


@dataclass
class InferenceOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = "agl-tiny"
    seed: int = 0  # weights of the initial random model
    follow: bool = True  # follow agl.resources for new checkpoints
    checkpoint: Path | None = None  # start from this checkpoint instead of random weights
    policy_version: int = 0  # the version of the initial weights
    max_batch_rows: int = 64
    default_max_tokens: int = 256  # when a request sets none (vLLM: the rest of the context)


class InferenceServer:
    def __init__(self, settings: Settings | None, options: InferenceOptions | None = None) -> None:
        self.settings = settings
        self.options = options or InferenceOptions()
        if self.options.follow and settings is None:
            raise ValueError("following checkpoints needs Kafka settings (or follow=False)")
        self.engine = Engine(self._initial_policy(), max_batch_rows=self.options.max_batch_rows)
        self.cache: ResourcesCache | None = None
        self.url: str | None = None
        self.stopping = False
        self.created = int(time.time())
        self._wanted: ModelCheckpoint | None = None  # the newest checkpoint seen for our model
        self._failed: set[int] = set()  # versions that failed to load (not retried)
        self._reload = asyncio.Event()
        self._version_changed = asyncio.Condition()
        self._ready = asyncio.Event()
        self._server: QuietServer | None = None
        self.app = create_app(self)

    def _initial_policy(self) -> Policy:
        if self.options.checkpoint is not None:
            model, tokenizer = load_checkpoint(self.options.checkpoint)
            if tokenizer.chat_template is None:
                log.warning(
                    "the tokenizer has no chat template: /v1/chat/completions will refuse requests",
                    checkpoint=str(self.options.checkpoint),
                )
            return Policy(model, tokenizer, self.options.policy_version, str(self.options.checkpoint))
        return Policy(
            build_model(self.options.seed),
            build_tokenizer(),
            self.options.policy_version,
            f"random(seed={self.options.seed})",
        )

    @property
    def policy(self) -> Policy:
        return self.engine.policy

    # -- checkpoints --------------------------------------------------------------------------

    def _on_resources(self, update: ResourcesUpdate) -> None:
        """ResourcesCache callback (event loop): remember the newest checkpoint of our model."""
        choice = choose_checkpoint(
            update.resources.values(),
            model=self.options.model_name,
            loaded_version=self.policy.version,
            chosen=self._wanted,
            failed=self._failed,
        )
        for refused, why in choice.refused:
            log.warning("checkpoint not loaded", version=refused.policy_version, reason=why)
        if choice.checkpoint is not None and choice.checkpoint is not self._wanted:
            self._wanted = choice.checkpoint
            self._reload.set()

    async def _load_wanted(self) -> None:
        wanted = self._wanted
        if wanted is None or wanted.policy_version <= self.policy.version:
            return
        try:
            path = local_checkpoint_path(wanted.uri)
            model, tokenizer = await asyncio.to_thread(load_checkpoint, path)
        except Exception as error:  # a bad checkpoint must not take the server down
            self._failed.add(wanted.policy_version)
            if self._wanted is wanted:  # a lower version, still newer than the loaded one, may load
                self._wanted = None
            log.warning("checkpoint not loaded", uri=wanted.uri, version=wanted.policy_version, error=str(error))
            return
        self.engine.policy = Policy(model, tokenizer, wanted.policy_version, str(path))
        log.info("checkpoint loaded", version=wanted.policy_version, uri=wanted.uri)
        async with self._version_changed:
            self._version_changed.notify_all()

    async def _reloader(self) -> None:
        while True:
            await self._reload.wait()
            self._reload.clear()
            await self._load_wanted()

    async def wait_for_version(self, version: int, timeout: float = 30.0) -> Policy:
        """Wait until a policy of at least ``version`` is loaded."""
        async with self._version_changed:
            await asyncio.wait_for(self._version_changed.wait_for(lambda: self.policy.version >= version), timeout)
        return self.policy

    async def wait_ready(self, timeout: float = 60.0) -> str:
        """Wait until the server accepts requests; its URL."""
        await asyncio.wait_for(self._ready.wait(), timeout)
        assert self.url is not None
        return self.url

    # -- lifecycle ----------------------------------------------------------------------------

    def stop(self) -> None:
        if self.stopping:
            return
        self.stopping = True
        log.info("inference server stopping")
        if self._server is not None:
            self._server.should_exit = True

    async def run(self) -> None:
        tasks: list[asyncio.Task[None]] = [asyncio.create_task(self.engine.run(), name="inference:engine")]
        sock: socket.socket | None = None
        try:
            if self.options.follow:
                assert self.settings is not None
                self.cache = ResourcesCache(self.settings)
                self.cache.on_update.append(self._on_resources)
                await self.cache.start()  # catches up: the newest published checkpoint is known now
                await self._load_wanted()
                tasks.append(asyncio.create_task(self._reloader(), name="inference:reloader"))
            sock = listen(self.options.host, self.options.port)
            host, port = sock.getsockname()[:2]
            url_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
            self.url = f"http://[{url_host}]:{port}" if ":" in url_host else f"http://{url_host}:{port}"
            self._server = QuietServer(server_config(self.app))
            self._server.should_exit = self.stopping
            server_task = asyncio.create_task(self._server.serve(sockets=[sock]), name="inference:http")
            self._ready.set()
            log.info(
                "inference server started",
                url=self.url,
                model=self.options.model_name,
                policy_version=self.policy.version,
                source=self.policy.source,
            )
            endpoint: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
            if self.settings is not None:  # a data dir to say where the metrics are
                endpoint = metrics.advertised(self.settings, metrics.role(), f"{self.url}/metrics")
            with endpoint:
                await asyncio.wait({server_task, *tasks}, return_when=asyncio.FIRST_COMPLETED)
            self.stop()
            await server_task
            for task in tasks:
                error = task.exception() if task.done() and not task.cancelled() else None
                if error is not None:
                    raise error
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if self.cache is not None:
                await self.cache.stop()
            if sock is not None:
                sock.close()
        log.info("inference server stopped")


# -- request handling -----------------------------------------------------------------------


def _prepare(
    server: InferenceServer, request: SamplingRequest, prompts: list[list[int]], max_tokens: int | None
) -> Prepared:
    policy = server.policy
    if request.model is not None and request.model != server.options.model_name:
        raise ApiError(404, f"The model `{request.model}` does not exist.", param="model")
    for prompt in prompts:
        if not prompt:
            raise ApiError(400, "the prompt is empty", param="prompt")
        if any(not 0 <= t < policy.vocab_size for t in prompt):
            raise ApiError(400, f"prompt token ids must be in [0, {policy.vocab_size})", param="prompt")
        room = policy.max_model_len - len(prompt)
        if room < 1 or (max_tokens is not None and max_tokens > room):
            asked = max_tokens if max_tokens is not None else 1
            raise ApiError(
                400,
                f"This model's maximum context length is {policy.max_model_len} tokens. However, you requested "
                f"{len(prompt) + asked} tokens ({len(prompt)} in the messages, {asked} in the completion). "
                "Please reduce the length of the messages or completion.",
                param="max_tokens",
            )
    longest = max(len(p) for p in prompts)
    limit = (
        max_tokens if max_tokens is not None else min(server.options.default_max_tokens, policy.max_model_len - longest)
    )
    stop_ids = tuple(request.stop_token_ids or ())
    if any(not 0 <= t < policy.vocab_size for t in stop_ids):
        raise ApiError(400, f"stop_token_ids must be in [0, {policy.vocab_size})", param="stop_token_ids")
    sampling = Sampling(
        max_new_tokens=limit,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        stop=request.stops(),
        stop_token_ids=stop_ids,
        top_logprobs=request.top_logprobs or 0,
    )
    seed = None if request.seed is None else request.seed % (1 << 63)
    return Prepared(prompts, request.n, sampling, seed, policy)


async def _stream(
    server: InferenceServer,
    kind: Literal["chat", "completion"],
    request: ChatRequest | CompletionRequest,
    prepared: Prepared,
) -> Response:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[list[StepToken] | None] = asyncio.Queue()

    def on_step(events: list[StepToken]) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, events)

    job = server.engine.submit(prepared.job(on_step))
    job.done.add_done_callback(lambda _: queue.put_nowait(None))
    policy = await job.started
    name = server.options.model_name
    created = int(time.time())
    chunk_id = f"chatcmpl-{uuid.uuid4().hex}" if kind == "chat" else f"cmpl-{uuid.uuid4().hex}"
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    stop = prepared.sampling.stop
    choices = [ChoiceStream() for _ in job.prompts]

    def chunk(choice_list: list[dict[str, Any]], **extra: Any) -> str:
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        payload = {"id": chunk_id, "object": obj, "created": created, "model": name, "choices": choice_list}
        payload.update(extra)
        return sse(payload)

    def step_choice(event: StepToken) -> dict[str, Any]:
        state = choices[event.row]
        visible = len(event.text) if event.finish_reason else len(event.text) - held_back(event.text, stop)
        delta = event.text[state.emitted : max(visible, state.emitted)]
        offset = state.emitted
        state.emitted = max(visible, state.emitted)
        tokenizer = policy.tokenizer
        ids, lps, tops = [event.token_id], [event.logprob], [event.top_logprobs]
        choice: dict[str, Any] = {"index": event.row}
        if kind == "chat":
            assert isinstance(request, ChatRequest)
            choice["delta"] = {"content": delta}
            choice["logprobs"] = (
                chat_logprobs(tokenizer, ids, lps, tops, request.top_logprobs or 0) if request.logprobs else None
            )
        else:
            assert isinstance(request, CompletionRequest)
            choice["text"] = delta
            choice["logprobs"] = (
                completion_logprobs(tokenizer, ids, lps, tops, request.logprobs, offset)
                if request.logprobs is not None
                else None
            )
        choice["finish_reason"] = event.finish_reason
        choice["stop_reason"] = event.stop_reason
        if kind == "completion":
            first = not state.started
            choice["prompt_token_ids"] = job.prompts[event.row] if first and request.return_token_ids else None
        state.started = True
        choice["token_ids"] = [event.token_id] if request.return_token_ids else None
        return choice

    async def body() -> AsyncIterator[str]:
        if kind == "chat":
            # vLLM opens each choice with a role chunk, which also carries the prompt's token ids.
            extra = {"prompt_token_ids": job.prompts[0]} if request.return_token_ids else {}
            for i in range(len(choices)):
                opening = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
                yield chunk([{**opening, "finish_reason": None}], **extra)
        while (events := await queue.get()) is not None:
            for event in events:
                yield chunk([step_choice(event)])
        try:
            results = job.done.result()
        except Exception as error:  # the stream has started: report in-band, as vLLM does
            yield sse({"error": {"message": str(error), "type": "InternalServerError", "param": None, "code": 500}})
            yield sse("[DONE]")
            return
        if include_usage:
            prompt_tokens = sum(len(p) for p in prepared.prompts)
            yield chunk([], usage=usage(prompt_tokens, sum(len(g.response_token_ids) for g in results)))
        yield sse("[DONE]")

    return StreamingResponse(
        body(),
        media_type="text/event-stream",
        headers={VERSION_HEADER: str(policy.version), "Cache-Control": "no-cache"},
    )


def create_app(server: InferenceServer) -> FastAPI:
    """The OpenAI-compatible app of ``server``: module-level routes reading it from ``app.state``,
    errors in OpenAI's shape."""
    app = FastAPI(
        title="agl-stream inference",
        docs_url=None,
        redoc_url=None,
        exception_handlers={ApiError: _api_error, StarletteHTTPException: _http_error, Exception: _server_error},
    )
    extra = server.settings.extra_hosts if server.settings is not None else []
    guard(app, allowed_hosts(server.options.host, extra), listener_token(server.settings, server.options.host))
    app.add_route("/metrics", metrics.metrics_endpoint, methods=["GET"])
    app.state.server = server

    app.include_router(router)
    return app


async def _api_error(_request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, ApiError)
    return error_response(error.status, error.message, error.param)


async def _http_error(_request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, StarletteHTTPException)
    return error_response(error.status_code, str(error.detail))


async def _server_error(_request: Request, error: Exception) -> JSONResponse:
    log.exception("request failed")
    return error_response(500, f"internal error: {type(error).__name__}: {error}")


def _server(request: Request) -> InferenceServer:
    server: InferenceServer = request.app.state.server
    return server


def _request_seconds() -> Any:
    return metrics.INFERENCE_REQUEST_SECONDS.labels(metrics.role())


Server = Annotated[InferenceServer, Depends(_server)]
router = APIRouter()


@router.get("/health")
async def health(server: Server) -> dict[str, Any]:
    policy = server.policy
    return {
        "status": "stopping" if server.stopping else "ok",
        "model": server.options.model_name,
        "policy_version": policy.version,
        "source": policy.source,
        "following": server.options.follow,
    }


@router.get("/v1/models")
async def models(server: Server) -> dict[str, Any]:
    policy = server.policy
    card = {
        "id": server.options.model_name,
        "object": "model",
        "created": server.created,
        "owned_by": "agl-stream",
        "root": policy.source,
        "parent": None,
        "max_model_len": policy.max_model_len,
        "permission": [],
        "policy_version": policy.version,
    }
    return {"object": "list", "data": [card]}


@router.post("/v1/chat/completions")
async def chat_completions(raw: Request, server: Server) -> Response:
    started = time.monotonic()
    request: ChatRequest = parse(ChatRequest, await json_body(raw))
    policy = server.policy
    if request.top_logprobs and not request.logprobs:
        raise ApiError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    prompt = chat_prompt(policy, request)
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    prepared = _prepare(server, request, [prompt], max_tokens)
    if request.stream:
        return await _stream(server, "chat", request, prepared)
    job = server.engine.submit(prepared.job())
    used = await job.started
    results = await job.done
    body = chat_response(request, prepared, used, results, server.options.model_name)
    _request_seconds().observe(time.monotonic() - started)  # streams are not timed: they end in the client
    return JSONResponse(body, headers={VERSION_HEADER: str(used.version)})


@router.post("/v1/completions")
async def completions(raw: Request, server: Server) -> Response:
    started = time.monotonic()
    request: CompletionRequest = parse(CompletionRequest, await json_body(raw))
    if request.echo:
        raise ApiError(400, "echo is not supported", param="echo")
    if request.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix")
    prompts = completion_prompts(server.policy, request)
    # Completions may ask for top-k via logprobs (an int); generation needs the larger of both.
    request.top_logprobs = max(request.top_logprobs or 0, request.logprobs or 0)
    prepared = _prepare(server, request, prompts, request.max_tokens)
    if request.stream:
        return await _stream(server, "completion", request, prepared)
    job = server.engine.submit(prepared.job())
    used = await job.started
    results = await job.done
    body = completion_response(request, prepared, used, results, server.options.model_name)
    _request_seconds().observe(time.monotonic() - started)  # streams are not timed: they end in the client
    return JSONResponse(body, headers={VERSION_HEADER: str(used.version)})


# -- entry points -----------------------------------------------------------------------------


async def run_inference(settings: Settings | None, options: InferenceOptions) -> None:
    server = InferenceServer(settings, options)
    with stop_on_signals(server.stop):
        await server.run()


def main(
    settings: Settings | None,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    torch_threads: int = 1,
    **options: Any,
) -> None:
    """Serve until SIGTERM/SIGINT (``agl-stream inference``). ``options``: InferenceOptions fields."""
    # The machine is shared with the broker, the processors and the runners; torch would take all cores.
    torch.set_num_threads(torch_threads)
    hf_logging.disable_progress_bar()  # a bar per checkpoint load is noise in a server's log
    asyncio.run(run_inference(settings, InferenceOptions(host=host, port=port, **options)))
