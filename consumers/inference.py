"""The inference server: the tiny policy behind an OpenAI-compatible HTTP API, vLLM-shaped.

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
import dataclasses
import json
import signal
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers import PreTrainedModel, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from agl_stream.auth import listener_token
from agl_stream.config import Settings
from agl_stream.http_serving import MalformedBodyError, QuietServer, allowed_hosts, guard, listen, parse_json
from agl_stream.logs import get_logger
from agl_stream.models import ModelCheckpoint, ResourcesUpdate
from agl_stream.policy import Generation, StepToken, build_model, build_tokenizer, generate, load_checkpoint
from agl_stream.semconv import POLICY_VERSION_HEADER
from agl_stream.store.resources_cache import ResourcesCache

log = get_logger("agl.inference")

MAX_LOGPROBS = 20  # vLLM's default max_logprobs
VERSION_HEADER = POLICY_VERSION_HEADER


# -- the loaded policy and the generation worker ---------------------------------------------


@dataclass(frozen=True)
class Policy:
    """Weights and tokenizer of one policy version (immutable: swapping replaces the object)."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerFast
    version: int
    source: str  # "random(seed=N)" or the checkpoint directory

    @property
    def max_model_len(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 1024))

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)


@dataclass(frozen=True)
class Sampling:
    """What must be equal for two jobs to share a batch."""

    max_new_tokens: int
    temperature: float
    top_p: float
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    top_logprobs: int = 0


@dataclass
class Job:
    prompts: list[list[int]]
    seeds: list[int | None]
    sampling: Sampling
    on_step: Callable[[list[StepToken]], None] | None = None  # called on the worker thread
    started: asyncio.Future[Policy] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    done: asyncio.Future[list[Generation]] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Engine:
    """Runs jobs one batch at a time on a single thread, batching the queued jobs that sample alike."""

    def __init__(self, policy: Policy, *, max_batch_rows: int = 64) -> None:
        self.policy = policy
        self.max_batch_rows = max_batch_rows
        self._pending: list[Job] = []
        self._wake = asyncio.Event()
        # One thread: torch already uses the cores for one batch; two batches would only contend.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="agl-generate")
        self.batches = 0

    def submit(self, job: Job) -> Job:
        self._pending.append(job)
        self._wake.set()
        return job

    async def run(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._pending:
                    batch = self._take_batch()
                    await self._run_batch(batch)
        finally:
            for job in self._pending:
                for future in (job.started, job.done):
                    if not future.done():
                        future.set_exception(RuntimeError("the inference server is stopping"))
            self._executor.shutdown(wait=False, cancel_futures=True)

    def _take_batch(self) -> list[Job]:
        """The oldest job plus every queued job with the same sampling, up to max_batch_rows."""
        first = self._pending[0]
        batch, rest, rows = [], [], 0
        for job in self._pending:
            fits = rows + len(job.prompts) <= self.max_batch_rows
            if job is first or (job.sampling == first.sampling and fits):
                batch.append(job)
                rows += len(job.prompts)
            else:
                rest.append(job)
        self._pending = rest
        return batch

    async def _run_batch(self, batch: list[Job]) -> None:
        policy = self.policy  # read once: a swap during the batch applies to the next one
        for job in batch:
            if not job.started.done():
                job.started.set_result(policy)
        owners: list[tuple[Job, int]] = [(job, i) for job in batch for i in range(len(job.prompts))]
        sampling = batch[0].sampling

        def on_step(events: list[StepToken]) -> None:
            by_job: dict[int, tuple[Job, list[StepToken]]] = {}
            for event in events:
                job, local = owners[event.row]
                if job.on_step is not None:
                    entry = by_job.setdefault(id(job), (job, []))
                    entry[1].append(dataclasses.replace(event, row=local))  # rows of the job, not the batch
            for job, job_events in by_job.values():
                assert job.on_step is not None
                job.on_step(job_events)

        def work() -> list[Generation]:
            return generate(
                policy.model,
                policy.tokenizer,
                [p for job in batch for p in job.prompts],
                sampling.max_new_tokens,
                sampling.temperature,
                sampling.top_p,
                [s for job in batch for s in job.seeds],
                stop=sampling.stop,
                stop_token_ids=sampling.stop_token_ids,
                top_logprobs=sampling.top_logprobs,
                on_step=on_step if any(job.on_step for job in batch) else None,
            )

        try:
            results = await asyncio.get_running_loop().run_in_executor(self._executor, work)
        except Exception as error:
            log.exception("generation failed", rows=len(owners))
            for job in batch:
                if not job.done.done():
                    job.done.set_exception(error)
            return
        self.batches += 1
        start = 0
        for job in batch:
            if not job.done.done():
                job.done.set_result(results[start : start + len(job.prompts)])
            start += len(job.prompts)


# -- requests ----------------------------------------------------------------------------------


class ApiError(Exception):
    """An error answered to the client in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError", 500: "InternalServerError"}


def _error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = _ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # like vLLM: unknown fields are ignored


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingRequest(_Body):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=64)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    return_token_ids: bool = False

    def stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops):
            raise ApiError(400, "stop strings must not be empty", param="stop")
        return tuple(stops)


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None


class ChatRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    max_completion_tokens: int | None = Field(None, ge=1)
    add_generation_prompt: bool = True


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[list[int]] | list[str]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None


def _parse(model: type[BaseModel], body: Any) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ApiError(400, f"{where}: {first['msg']}" if where else first["msg"], param=where or None) from None


async def _json_body(request: Request) -> Any:
    try:
        return parse_json(await request.body())
    except MalformedBodyError as error:
        raise ApiError(400, str(error)) from None


def _message_text(message: ChatMessage, index: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    texts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise ApiError(400, f"only text content parts are supported, got {part.type!r}", param=f"messages.{index}")
        texts.append(part.text)
    return "".join(texts)


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
        for resource in update.resources.values():
            if not isinstance(resource, ModelCheckpoint) or resource.model != self.options.model_name:
                continue
            newest = max(self.policy.version, self._wanted.policy_version if self._wanted else -1)
            if resource.policy_version <= newest or resource.policy_version in self._failed:
                continue
            if resource.format != "hf":
                log.warning("checkpoint format not supported", format=resource.format, version=resource.policy_version)
                continue
            self._wanted = resource
            self._reload.set()

    async def _load_wanted(self) -> None:
        wanted = self._wanted
        if wanted is None or wanted.policy_version <= self.policy.version:
            return
        try:
            path = _local_path(wanted.uri)
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
            config = uvicorn.Config(
                self.app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=10
            )
            self._server = QuietServer(config)
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


def _local_path(uri: str) -> Path:
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        return Path(parsed.path if parsed.scheme else uri)
    raise ValueError(f"only local checkpoint directories are supported, got {uri!r}")


# -- request handling -------------------------------------------------------------------------


@dataclass
class Prepared:
    """A validated request: the prompts (one per choice) and how to sample them."""

    prompts: list[list[int]]  # distinct prompts
    n: int
    sampling: Sampling
    seed: int | None
    policy: Policy

    def job(self, on_step: Callable[[list[StepToken]], None] | None = None) -> Job:
        rows = [p for p in self.prompts for _ in range(self.n)]
        seeds = [None if self.seed is None else self.seed + i for i in range(len(rows))]
        return Job(rows, seeds, self.sampling, on_step)


def _prepare(
    server: InferenceServer, request: _SamplingRequest, prompts: list[list[int]], max_tokens: int | None
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


def _chat_prompt(policy: Policy, request: ChatRequest) -> list[int]:
    messages = [{"role": m.role, "content": _message_text(m, i)} for i, m in enumerate(request.messages)]
    try:
        text = policy.tokenizer.apply_chat_template(
            messages, add_generation_prompt=request.add_generation_prompt, tokenize=False
        )
    except Exception as error:  # a template that rejects the conversation is the request's fault
        raise ApiError(400, f"the chat template rejected the messages: {error}", param="messages") from None
    assert isinstance(text, str)
    return list(policy.tokenizer.encode(text, add_special_tokens=False))


def _completion_prompts(policy: Policy, request: CompletionRequest) -> list[list[int]]:
    prompt = request.prompt
    if isinstance(prompt, str):
        return [list(policy.tokenizer.encode(prompt, add_special_tokens=False))]
    if not prompt:
        raise ApiError(400, "the prompt is empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return [
        list(policy.tokenizer.encode(p, add_special_tokens=False)) if isinstance(p, str) else list(p)  # type: ignore[arg-type]
        for p in prompt
    ]


def _token_text(tokenizer: PreTrainedTokenizerFast, token_id: int) -> str:
    return str(tokenizer.decode([token_id]))


def _finite(logprob: float) -> float:
    return max(logprob, -9999.0)  # vLLM's floor: JSON has no -Infinity


def _chat_logprob(tokenizer: PreTrainedTokenizerFast, token_id: int, logprob: float) -> dict[str, Any]:
    token = _token_text(tokenizer, token_id)
    return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode("utf-8"))}


def _chat_logprobs(
    tokenizer: PreTrainedTokenizerFast,
    ids: Sequence[int],
    logprobs: Sequence[float],
    tops: Sequence[list[tuple[int, float]]],
    k: int,
) -> dict[str, Any]:
    content = []
    for token_id, logprob, top in zip(ids, logprobs, tops, strict=True):
        entry = _chat_logprob(tokenizer, token_id, logprob)
        entry["top_logprobs"] = [_chat_logprob(tokenizer, t, v) for t, v in top[:k]]
        content.append(entry)
    return {"content": content}


def _completion_logprobs(
    tokenizer: PreTrainedTokenizerFast,
    ids: Sequence[int],
    logprobs: Sequence[float],
    tops: Sequence[list[tuple[int, float]]],
    k: int,
    offset: int,
) -> dict[str, Any]:
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    special = set(tokenizer.all_special_ids)
    for token_id, logprob, top in zip(ids, logprobs, tops, strict=True):
        token = _token_text(tokenizer, token_id)
        tokens.append(token)
        token_logprobs.append(_finite(logprob))
        # vLLM's completions list the sampled token among the top ones even when it is not.
        ranked = {_token_text(tokenizer, t): _finite(v) for t, v in top[:k]}
        ranked.setdefault(token, _finite(logprob))
        top_logprobs.append(ranked)
        text_offset.append(offset)
        if token_id not in special:
            offset += len(token)
    return {
        "text_offset": text_offset,
        "token_logprobs": token_logprobs,
        "tokens": tokens,
        "top_logprobs": top_logprobs,
    }


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
    }


def _chat_response(
    request: ChatRequest, prepared: Prepared, policy: Policy, results: list[Generation], name: str
) -> dict[str, Any]:
    choices = []
    for index, gen in enumerate(results):
        logprobs = None
        if request.logprobs:
            k = request.top_logprobs or 0
            logprobs = _chat_logprobs(policy.tokenizer, gen.response_token_ids, gen.logprobs, gen.top_logprobs, k)
        choices.append(
            {
                "index": index,
                "message": {
                    "role": "assistant",
                    "content": gen.text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "tool_calls": [],
                    "reasoning_content": None,
                },
                "logprobs": logprobs,
                "finish_reason": gen.finish_reason,
                "stop_reason": gen.stop_reason,
                "token_ids": gen.response_token_ids if request.return_token_ids else None,
            }
        )
    prompt = prepared.prompts[0]
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": name,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": _usage(len(prompt), sum(len(g.response_token_ids) for g in results)),
        "prompt_logprobs": None,
        "prompt_token_ids": prompt if request.return_token_ids else None,
        "kv_transfer_params": None,
    }


def _completion_response(
    request: CompletionRequest, prepared: Prepared, policy: Policy, results: list[Generation], name: str
) -> dict[str, Any]:
    choices = []
    for index, gen in enumerate(results):
        logprobs = None
        if request.logprobs is not None:
            logprobs = _completion_logprobs(
                policy.tokenizer, gen.response_token_ids, gen.logprobs, gen.top_logprobs, request.logprobs, 0
            )
        choices.append(
            {
                "index": index,
                "text": gen.text,
                "logprobs": logprobs,
                "finish_reason": gen.finish_reason,
                "stop_reason": gen.stop_reason,
                "prompt_logprobs": None,
                "prompt_token_ids": gen.prompt_token_ids if request.return_token_ids else None,
                "token_ids": gen.response_token_ids if request.return_token_ids else None,
            }
        )
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": name,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
        # Like vLLM: each distinct prompt counts once, whatever n is.
        "usage": _usage(sum(len(p) for p in prepared.prompts), sum(len(g.response_token_ids) for g in results)),
        "kv_transfer_params": None,
    }


def _held_back(text: str, stop: Sequence[str]) -> int:
    """How many trailing characters of ``text`` could still begin a stop string."""
    longest = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest


@dataclass
class _ChoiceStream:
    emitted: int = 0  # characters of text sent so far
    started: bool = False  # the first chunk (prompt_token_ids for completions) went out


def _sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


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
    choices = [_ChoiceStream() for _ in job.prompts]

    def chunk(choice_list: list[dict[str, Any]], **extra: Any) -> str:
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        payload = {"id": chunk_id, "object": obj, "created": created, "model": name, "choices": choice_list}
        payload.update(extra)
        return _sse(payload)

    def step_choice(event: StepToken) -> dict[str, Any]:
        state = choices[event.row]
        visible = len(event.text) if event.finish_reason else len(event.text) - _held_back(event.text, stop)
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
                _chat_logprobs(tokenizer, ids, lps, tops, request.top_logprobs or 0) if request.logprobs else None
            )
        else:
            assert isinstance(request, CompletionRequest)
            choice["text"] = delta
            choice["logprobs"] = (
                _completion_logprobs(tokenizer, ids, lps, tops, request.logprobs, offset)
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
            yield _sse({"error": {"message": str(error), "type": "InternalServerError", "param": None, "code": 500}})
            yield _sse("[DONE]")
            return
        if include_usage:
            prompt_tokens = sum(len(p) for p in prepared.prompts)
            yield chunk([], usage=_usage(prompt_tokens, sum(len(g.response_token_ids) for g in results)))
        yield _sse("[DONE]")

    return StreamingResponse(
        body(),
        media_type="text/event-stream",
        headers={VERSION_HEADER: str(policy.version), "Cache-Control": "no-cache"},
    )


def create_app(server: InferenceServer) -> FastAPI:
    app = FastAPI(title="agl-stream inference", docs_url=None, redoc_url=None)
    extra = server.settings.extra_hosts if server.settings is not None else []
    guard(app, allowed_hosts(server.options.host, extra), listener_token(server.settings, server.options.host))

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, error: ApiError) -> JSONResponse:
        return _error_response(error.status, error.message, error.param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, error: StarletteHTTPException) -> JSONResponse:
        return _error_response(error.status_code, str(error.detail))

    @app.exception_handler(Exception)
    async def server_error(_request: Request, error: Exception) -> JSONResponse:
        log.exception("request failed")
        return _error_response(500, f"internal error: {type(error).__name__}: {error}")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        policy = server.policy
        return {
            "status": "stopping" if server.stopping else "ok",
            "model": server.options.model_name,
            "policy_version": policy.version,
            "source": policy.source,
            "following": server.options.follow,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
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

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        request: ChatRequest = _parse(ChatRequest, await _json_body(raw))
        policy = server.policy
        if request.top_logprobs and not request.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        prompt = _chat_prompt(policy, request)
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        prepared = _prepare(server, request, [prompt], max_tokens)
        if request.stream:
            return await _stream(server, "chat", request, prepared)
        job = server.engine.submit(prepared.job())
        used = await job.started
        results = await job.done
        body = _chat_response(request, prepared, used, results, server.options.model_name)
        return JSONResponse(body, headers={VERSION_HEADER: str(used.version)})

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        request: CompletionRequest = _parse(CompletionRequest, await _json_body(raw))
        if request.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        if request.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix")
        prompts = _completion_prompts(server.policy, request)
        # Completions may ask for top-k via logprobs (an int); generation needs the larger of both.
        request.top_logprobs = max(request.top_logprobs or 0, request.logprobs or 0)
        prepared = _prepare(server, request, prompts, request.max_tokens)
        if request.stream:
            return await _stream(server, "completion", request, prepared)
        job = server.engine.submit(prepared.job())
        used = await job.started
        results = await job.done
        body = _completion_response(request, prepared, used, results, server.options.model_name)
        return JSONResponse(body, headers={VERSION_HEADER: str(used.version)})

    return app


# -- entry points -----------------------------------------------------------------------------


async def run_inference(settings: Settings | None, options: InferenceOptions) -> None:
    server = InferenceServer(settings, options)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.stop)
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
