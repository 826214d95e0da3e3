"""The LLM proxy (``agl-stream llm-proxy``): OpenAI-compatible, built on LiteLLM, every call a span.

Agents reach it on a per-attempt base URL, ``http://host:port/rollout/<rollout_id>/attempt/
<attempt_id>/v1`` (``ProxyLLM.get_base_url``), and call ``chat/completions`` or ``completions``
(streamed or not). The proxy forwards each call through a LiteLLM Router to the model's
OpenAI-compatible backends (vLLM; several per model are load-balanced), asking for token ids
and logprobs (``agl_stream.domain.llm_calls.backend_request``), and records the call as one span of the
attempt before the agent gets the answer. This module is the I/O edge (its routes and processes:
``server.py``; its backends as LiteLLM's model list: ``backends.py``); the rules are in
``agl_stream.domain.llm_calls``.

- **Raw responses.** LiteLLM 1.110 keeps vLLM's token ids in non-streamed answers, but drops
  ``prompt_token_ids`` from streams (a text completion's always, chat's with the
  ``hosted_vllm/`` provider). So the proxy reads what the backend really sent: LiteLLM's
  ``openai/`` provider sends every request through ``litellm.aclient_session``, an httpx client
  whose transport (:class:`CaptureTransport`, wrapping LiteLLM's own) copies the response bytes
  of requests that carry the proxy's call header. Spans are built from those bytes (the
  backend's truth); the agent receives LiteLLM's response.
- **Sequence ids.** The first call of an attempt reserves a block (:class:`SequenceBlocks`,
  one processor round trip, started with the backend call so the two overlap); later calls
  number inside it, in the order they arrived. An unknown rollout or attempt is remembered as
  such: its calls are answered and counted, never recorded.
- **The agent's request** reaches the backend as sent (plus ``return_token_ids`` and
  logprobs): LiteLLM routes it, but the body travels in ``extra_body``, so LiteLLM's message
  rewriting cannot change what the model sees.
- **Ordering.** The span is acknowledged by the broker before the response (or a stream's
  final ``[DONE]``) goes out, so an attempt that finishes after its last call finds every
  proxy span already in Kafka.
- **Failures.** Backend errors reach the agent as OpenAI error bodies with the backend's
  status and message, and are recorded as ERROR spans. A span that cannot be written (store
  down, unknown attempt) never costs the agent its answer: it is logged and counted
  (``GET /health``).
- **Version switches.** A vLLM backend run by ``agl-stream inference --engine vllm`` switches
  policy versions behind its hand-off gate (``consumers/switch_gate.py``): during a switch a
  call here is only slower (held there, then answered by the new server); past the gate's
  deadlines its typed 503 (``policy_switch_timeout``, with Retry-After) reaches the agent like
  any backend error. The version that served each call (the backend's ``x-agl-policy-version``,
  which the gate sets) is recorded on its span, errors included.
- ``/v1/...`` without the rollout and attempt is served too, unrecorded (there is no attempt
  to attach a span to), and counted as ``unattributed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Coroutine, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import httpx
from aiokafka.errors import MessageSizeTooLargeError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from agl_stream import metrics
from agl_stream.config import Settings
from agl_stream.domain.llm_calls import (
    CHAT,
    COMPLETION,
    CallError,
    CallKind,
    LLMCall,
    TraceParent,
    backend_error,
    backend_request,
    build_span,
    error_of_status,
    merge_chunks,
    parse_sse,
    slim,
    trace_parent,
)
from agl_stream.logs import describe, get_logger
from agl_stream.store.client import AglStore
from producers.llm_proxy.agl_v1 import AglV1Options
from producers.llm_proxy.backends import import_litellm, new_inner_transport, priced
from producers.llm_proxy.capture import CALL_HEADER, Capture, CaptureTransport
from producers.llm_proxy.sequence_ids import SequenceBlocks, SpanStore

log = get_logger("agl.llm_proxy")

_LOG_EVERY_S = 10.0


@dataclass
class ProxyOptions:
    """How the proxy runs (``agl-stream llm-proxy``'s options)."""

    host: str = "127.0.0.1"
    port: int = 8090
    logprobs: bool = True
    """Ask the backend for the sampled tokens' logprobs even when the agent did not."""
    sequence_block: int = 256
    """Sequence ids reserved per attempt at a time."""
    max_attempts: int = 10_000
    """Attempts whose id blocks are remembered (least recently used ones are forgotten)."""
    num_retries: int = 0
    """LiteLLM retries of a failed backend call (another backend of the model when it has several)."""
    timeout_s: float = 600.0
    """Longest a backend call may take."""
    span_write_timeout_s: float = 30.0
    """Longest the proxy waits for the broker to acknowledge a span before answering anyway."""
    agl_v1: AglV1Options | None = None
    """Serve Agent Lightning 1.0's protocol beside the proxy (producers/llm_proxy/agl_v1.py)."""
    agl_v1_key: str | None = None
    """The key 1.0's clients send (the listener's token), when the stack requires none."""
    workers: int = 1
    """Processes serving the port together (SO_REUSEPORT): LiteLLM costs milliseconds of CPU per
    call, so one process tops out at a few hundred calls a second."""
    reuse_port: bool = False


@dataclass
class ProxyStats:
    """Counters served by ``GET /health``."""

    calls: int = 0
    recorded: int = 0
    errors: int = 0
    """Calls answered with an error (their spans are recorded like the others)."""
    unattributed: int = 0
    unknown_attempts: int = 0
    """Calls of a rollout or attempt the store does not know (answered, not recorded)."""
    store_errors: int = 0
    """Calls whose sequence id could not be reserved (processor unreachable)."""
    span_write_failures: int = 0
    truncated_spans: int = 0
    """Spans written without their text attributes because they were over the message size."""


@dataclass(frozen=True)
class _Attribution:
    rollout_id: str
    attempt_id: str
    sequence_id: asyncio.Task[int | None]
    parent: TraceParent | None  # the caller's span (traceparent): the call's span is its child


class LLMProxy:
    """The proxy's state: the LiteLLM Router, the capture transport, the store client, counters."""

    def __init__(self, settings: Settings, model_list: Sequence[Mapping[str, Any]], options: ProxyOptions) -> None:
        if not model_list and options.agl_v1 is None:
            raise ValueError("the LLM proxy needs at least one backend (--backend MODEL=URL)")
        self.settings = settings
        self.options = options
        self.model_list: list[dict[str, Any]] = []
        self.models: list[str] = []
        self._set_model_list(model_list)
        self.stats = ProxyStats()
        self.started = int(time.time())
        self.url: str | None = None
        self.store: AglStore | None = None
        self.blocks: SequenceBlocks | None = None
        self.router: Any = None
        self.transport: CaptureTransport | None = None
        self._litellm: Any = None
        self._previous_session: Any = None
        self._background: set[asyncio.Task[None]] = set()
        self._last_log: dict[str, float] = {}

    def _set_model_list(self, model_list: Sequence[Mapping[str, Any]]) -> None:
        self.model_list = [priced(entry) for entry in model_list]
        self.models = sorted({str(entry["model_name"]) for entry in self.model_list})
        for entry in self.model_list:
            provider = str(entry.get("litellm_params", {}).get("model", "")).split("/", 1)[0]
            if provider != "openai":
                log.warning(
                    "backends should use LiteLLM's openai/ provider: the proxy reads raw responses through it, "
                    "and other providers may lose streamed token ids",
                    model=entry.get("model_name"),
                    provider=provider,
                )

    def use_backends(self, model_list: Sequence[Mapping[str, Any]]) -> None:
        """Serve these backends from now on instead of those before (calls in flight finish on theirs)."""
        self._set_model_list(model_list)
        if self.router is not None:
            self.router.set_model_list(self.model_list)

    async def start(self) -> LLMProxy:
        litellm = self._litellm = await asyncio.to_thread(import_litellm)  # ~3 s of imports
        self.transport = CaptureTransport(new_inner_transport(litellm))
        self._previous_session = litellm.aclient_session
        litellm.aclient_session = httpx.AsyncClient(transport=self.transport, timeout=self.options.timeout_s)
        self.router = litellm.Router(
            model_list=self.model_list, num_retries=self.options.num_retries, timeout=self.options.timeout_s
        )
        # The 1.0 routes read rollouts and spans; the proxy alone only writes (it needs no gateway).
        store = AglStore(self.settings) if self.options.agl_v1 is not None else SpanStore(self.settings)
        await store.start()
        self.store = store
        self.blocks = SequenceBlocks(
            store.reserve_span_sequence_ids, block=self.options.sequence_block, capacity=self.options.max_attempts
        )
        return self

    async def close(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self.store is not None:
            await self.store.close()
            self.store = None
        if self._litellm is not None:
            session = self._litellm.aclient_session
            self._litellm.aclient_session = self._previous_session
            if isinstance(session, httpx.AsyncClient):
                await session.aclose()

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "models": self.models, "stats": asdict(self.stats)}

    async def next_sequence_id(self, rollout_id: str, attempt_id: str) -> int | None:
        """A sequence id for a span of the attempt, from its reserved block; None for an attempt
        the store does not know."""
        assert self.blocks is not None, "the proxy is not started"
        return await self.blocks.next_id(rollout_id, attempt_id)

    def _log_limited(self, kind: str, message: str, where: _Attribution, error: BaseException) -> None:
        """Log a call that went unrecorded, at most once per ``kind`` every _LOG_EVERY_S seconds."""
        now = time.monotonic()
        if now - self._last_log.get(kind, -_LOG_EVERY_S) >= _LOG_EVERY_S:
            self._last_log[kind] = now
            log.error(message, rollout_id=where.rollout_id, attempt_id=where.attempt_id, error=describe(error))

    # -- one call ------------------------------------------------------------------------------

    async def handle(
        self,
        kind: CallKind,
        body: Any,
        rollout_id: str | None,
        attempt_id: str | None,
        headers: Mapping[str, str] | None = None,
        route: str | None = None,
    ) -> Response:
        """Serve one chat or text completion call and record it (when attributed); ``headers``:
        the request's, whose W3C trace context makes the call's span a child of the caller's;
        ``route``: the backend group to send it to, when not the one the body's model names."""
        self.stats.calls += 1
        start = time.time()
        where = self._attribution(rollout_id, attempt_id, headers or {})
        if not isinstance(body, dict):
            return self._error_response(error_of_status(400, "the request body must be a JSON object"))
        stream = bool(body.get("stream"))
        invalid = self._invalid(kind, body, route)
        if invalid is not None:
            await self._record(LLMCall(kind, body, start, time.time(), error=invalid, stream=stream), where)
            return self._error_response(invalid)
        assert self.transport is not None
        with contextlib.ExitStack() as stack:
            call_id, capture = stack.enter_context(self.transport.capturing())
            try:
                result = await self._forward(kind, body, call_id, stream, route)
            except Exception as error:
                failure = self._call_error(error, capture, str(body["model"]))
                await self._record(_answered(kind, body, start, capture, error=failure, stream=stream), where)
                return self._error_response(failure)
            if stream:
                # The capture must outlive this function: the stream is read by the response.
                pending = stack.pop_all()
                chunks = self._stream(kind, body, result, capture, pending, start, where)
                return StreamingResponse(chunks, media_type="text/event-stream")
            answer = result.model_dump_json()
            raw = capture.json() if capture.status is not None and capture.status < 400 else None
            response = raw if isinstance(raw, dict) else json.loads(answer)
            call = _answered(kind, body, start, capture, response=response)
        await self._record(call, where)
        return Response(answer, media_type="application/json")

    def _invalid(self, kind: CallKind, body: Mapping[str, Any], route: str | None = None) -> CallError | None:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            return error_of_status(400, "the request names no model", param="model")
        if (route or model) not in self.models:
            return error_of_status(
                404,
                f"the model {model!r} is not served by this proxy; it serves {', '.join(self.models)}",
                code="model_not_found",
                param="model",
            )
        if kind == CHAT and not isinstance(body.get("messages"), list):
            return error_of_status(400, "a chat completion needs a list of messages", param="messages")
        if kind == COMPLETION and body.get("prompt") is None:
            return error_of_status(400, "a completion needs a prompt", param="prompt")
        return None

    async def _forward(
        self, kind: CallKind, body: Mapping[str, Any], call_id: str, stream: bool, route: str | None = None
    ) -> Any:
        sent = backend_request(kind, body, logprobs=self.options.logprobs)
        model = route or sent.pop("model")
        sent.pop("model", None)
        sent.pop("stream", None)
        # The agent's body travels in extra_body, which the openai SDK merges into the request
        # last: the backend gets exactly what the agent sent (LiteLLM rewrites messages, e.g. it
        # drops an assistant message's "content": null, which can change a chat template's
        # rendering), vLLM extensions pass untouched, LiteLLM translates nothing (fewer cycles),
        # and an agent cannot steer LiteLLM itself (api_base, mock_response, ... stay body fields).
        # The messages or prompt also go as LiteLLM's own argument, which its routing needs.
        kwargs: dict[str, Any] = {"model": model, "extra_headers": {CALL_HEADER: call_id}, "extra_body": sent}
        if stream:
            kwargs["stream"] = True
            if "stream_options" in sent:
                kwargs["stream_options"] = sent.pop("stream_options")
        if kind == CHAT:
            return await self.router.acompletion(messages=sent["messages"], **kwargs)
        return await self.router.atext_completion(prompt=sent["prompt"], **kwargs)

    async def _stream(
        self,
        kind: CallKind,
        body: Mapping[str, Any],
        result: Any,
        capture: Capture,
        pending: contextlib.ExitStack,
        start: float,
        where: _Attribution | None,
    ) -> AsyncIterator[bytes]:
        failure: CallError | None = None
        recording: asyncio.Task[None] | None = None
        try:
            try:
                async for chunk in result:
                    if kind == COMPLETION:
                        for choice in chunk.choices:
                            # LiteLLM ends a text stream with a finish chunk whose text is null;
                            # OpenAI's schema (and agents joining the texts) need a string.
                            if choice.text is None:
                                choice.text = ""
                    yield b"data: " + chunk.model_dump_json().encode() + b"\n\n"
            except Exception as error:
                failure = self._call_error(error, capture, str(body["model"]))
            call = self._stream_call(kind, body, capture, start, failure)
            if call.error is not None:
                # OpenAI's (and vLLM's) way to fail a stream that already started: an error event.
                self.stats.errors += 1
                yield b"data: " + json.dumps(call.error.body()).encode() + b"\n\n"
            # Before [DONE] (see the module docstring), and shielded: a client that leaves now
            # must not cancel the write halfway.
            recording = self._in_background(self._record(call, where))
            await asyncio.shield(recording)
            yield b"data: [DONE]\n\n"
        finally:
            if recording is None:
                # The client went away mid-stream (this generator was closed or cancelled): record
                # what the backend produced so far and stop its generation, in a task of its own
                # because this one may be cancelled again at its next await.
                gone = CallError(499, "the client closed the stream before it ended", "client_closed_request")
                call = self._stream_call(kind, body, capture, start, gone)
                self._in_background(self._close_and_record(result, call, where))
            pending.close()

    async def _close_and_record(self, result: Any, call: LLMCall, where: _Attribution | None) -> None:
        with contextlib.suppress(Exception):
            await result.aclose()  # closes the backend connection: vLLM then aborts the request
        await self._record(call, where)

    def _stream_call(
        self, kind: CallKind, body: Mapping[str, Any], capture: Capture, start: float, failure: CallError | None
    ) -> LLMCall:
        response = merge_chunks(kind, parse_sse(capture.body))
        raw_error = response.get("error")
        if isinstance(raw_error, Mapping) and (failure is None or failure.status != 499):
            # The backend's own words beat LiteLLM's rewording of them.
            code = raw_error.get("code")
            status = code if isinstance(code, int) and 400 <= code < 600 else 500
            failure = backend_error(status, {"error": raw_error}, failure.message if failure else "the backend failed")
        return _answered(kind, body, start, capture, response=response, error=failure, stream=True)

    def _in_background(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """A task the proxy waits for when it closes."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _call_error(self, error: Exception, capture: Capture, model: str) -> CallError:
        """The agent's view of a failed call: the backend's own error when it answered one."""
        litellm = self._litellm
        text = str(error).split("\n\nLiteLLM:", 1)[0].strip() or type(error).__name__
        if capture.status is not None and capture.status >= 400:
            return backend_error(capture.status, bytes(capture.body), text)
        if isinstance(error, litellm.Timeout):
            return error_of_status(504, f"the backend of {model!r} did not answer within {self.options.timeout_s:g}s")
        if capture.status is None and isinstance(error, litellm.APIConnectionError | litellm.InternalServerError):
            return error_of_status(
                502, f"cannot reach the backend of {model!r} ({capture.url or 'no backend tried'}): {text}"
            )
        status = getattr(error, "status_code", None)
        if not isinstance(status, int) or not 400 <= status < 600:
            status = 500
        return error_of_status(status, text)

    def _error_response(self, error: CallError) -> JSONResponse:
        self.stats.errors += 1
        return JSONResponse(error.body(), status_code=error.status)

    def _attribution(
        self, rollout_id: str | None, attempt_id: str | None, headers: Mapping[str, str]
    ) -> _Attribution | None:
        """The call's attempt, its sequence id already on the way: a first call's reservation (a
        processor round trip) then overlaps the backend's work instead of adding to it."""
        if rollout_id is None or attempt_id is None:
            return None
        assert self.blocks is not None
        task = asyncio.get_running_loop().create_task(self.blocks.next_id(rollout_id, attempt_id))
        # A call whose stream never started records nothing; its failure must not go unretrieved.
        task.add_done_callback(lambda done: done.cancelled() or done.exception())
        return _Attribution(rollout_id, attempt_id, task, trace_parent(headers))

    async def _record(self, call: LLMCall, where: _Attribution | None) -> None:
        """Write the call's span and wait for the broker; failures are logged and counted, never raised."""
        model = call.request.get("model")
        metrics.PROXY_CALL_SECONDS.labels(
            metrics.role(),
            model if isinstance(model, str) and model in self.models else "other",  # what callers send is unbounded
            "error" if call.error is not None else "ok",
        ).observe(max(0.0, call.end_time - call.start_time))
        if where is None:
            self.stats.unattributed += 1
            return
        assert self.store is not None
        try:
            sequence_id = await where.sequence_id
        except Exception as error:
            self.stats.store_errors += 1
            message = "cannot reserve sequence ids, LLM calls go unrecorded: is the rollout processor running?"
            self._log_limited("reserve", message, where, error)
            return
        if sequence_id is None:
            self.stats.unknown_attempts += 1
            return
        try:
            rollout_id, attempt_id = where.rollout_id, where.attempt_id
            span = build_span(
                call, rollout_id=rollout_id, attempt_id=attempt_id, sequence_id=sequence_id, parent=where.parent
            )
        except ValueError as error:  # pydantic's ValidationError: a value no span attribute can hold
            self.stats.span_write_failures += 1
            message = "an LLM call could not become a span (a proxy bug: please report it with this error)"
            self._log_limited("build", message, where, error)
            return
        timeout = self.options.span_write_timeout_s
        try:
            try:
                await asyncio.wait_for(self.store.export_spans([span]), timeout)
            except MessageSizeTooLargeError:
                self.stats.truncated_spans += 1
                await asyncio.wait_for(self.store.export_spans([slim(span)]), timeout)
        except Exception as error:
            self.stats.span_write_failures += 1
            self._log_limited(
                "write", "cannot write LLM call spans: is the broker up (`agl-stream status`)?", where, error
            )
            return
        self.stats.recorded += 1


def _answered(kind: CallKind, body: Mapping[str, Any], start: float, capture: Capture, **fields: Any) -> LLMCall:
    """The call, ending now, as the backend answered it: the backend's base URL (from the URL of the
    request to it) and the policy version it reported come from the capture."""
    backend = capture.url
    for suffix in ("/chat/completions", "/completions"):
        if backend is not None and backend.endswith(suffix):
            backend = backend[: -len(suffix)]
            break
    return LLMCall(kind, body, start, time.time(), backend=backend, policy_version=capture.policy_version, **fields)
