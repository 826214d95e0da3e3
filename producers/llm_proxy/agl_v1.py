"""Agent Lightning 1.0's server protocol, served by the LLM proxy (``llm-proxy --agl-v1-model``).

A 1.0 user's controller, trainer (rollout manager) and agents run unchanged against this
listener: ``/healthz``; ``/api/rollouts`` (create, list by state, the terminal cursor, read,
PATCH, DELETE); per-attempt events; ``/api/models``; the per-rollout OpenAI proxy path
``/proxy/rollout/{rid}/attempt/{aid}/mode/{train|val}/openai/v1/{chat/completions|completions}``
and ``/proxy/pause|resume|state``. Errors are FastAPI's ``{"detail": ...}`` with 1.0's statuses
and messages. The mapping onto the store is ``agl_stream/domain/agl_v1.py``; writes are events on
Kafka through the proxy's store client, reads come from ClickHouse fenced on its writes (so a
client reads what it wrote, through this listener).

Why the proxy serves it: in 1.0 one server is both the control API and the model proxy, and the
proxy path is the hot one (every LLM call), so it stays in the process that already records
calls as spans; the control routes are a thin layer over the same store client.

Auth is the listener's token (``AGL_API_TOKEN``, or ``--agl-v1-key``): 1.0 clients send it as
their key (``Authorization: Bearer``, or ``x-api-key``); ``/healthz`` needs none.

Concurrency model: every route runs on the proxy's one event loop; the model registry, the pause
gate and the in-flight count are plain attributes of :class:`V1Server`, changed only there.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Protocol

from aiokafka.errors import KafkaError, MessageSizeTooLargeError
from fastapi import APIRouter, FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import TypeAdapter, ValidationError

from agl_stream.domain import agl_v1
from agl_stream.domain.agl_v1 import (
    ATTEMPT_ID,
    EventCreate,
    ModelEntry,
    PauseBody,
    RolloutCreate,
    RolloutPatch,
    TransitionConflict,
    V1State,
)
from agl_stream.domain.llm_calls import CHAT, COMPLETION, CallKind
from agl_stream.errors import AglError, CodecError
from agl_stream.http_serving import MalformedBodyError, parse_json
from agl_stream.logs import get_logger
from agl_stream.models import Rollout
from agl_stream.store.client import AglStore
from agl_stream.store.queries import rollout_from_row

log = get_logger("agl.llm_proxy.agl_v1")

MAX_ROLLOUTS = 10_000
"""Rollouts one create may carry."""
KNOWN_ROLLOUTS = 100_000
"""Rollout ids the proxy path remembers as existing (so a call costs no read after the first)."""
UPSTREAM_PATHS: dict[str, CallKind] = {"chat/completions": CHAT, "completions": COMPLETION}
_CREATES = TypeAdapter(list[RolloutCreate])
_MODELS = TypeAdapter(list[ModelEntry])


@dataclass(frozen=True)
class AglV1Options:
    """1.0's server settings (its ``default_proxy`` block)."""

    model_name: str
    """The model the proxy path routes to (what 1.0's trainer registers under ``/api/models``)."""
    train_temperature: float | None = 1.0
    val_temperature: float | None = 0.7
    include_log_probs: bool = True


class ProxyCore(Protocol):
    """What the 1.0 layer needs of the LLM proxy (producers/llm_proxy/proxy.py's LLMProxy)."""

    store: AglStore | None
    model_list: list[dict[str, Any]]

    def use_backends(self, model_list: Sequence[Mapping[str, Any]]) -> None: ...

    async def handle(
        self,
        kind: CallKind,
        body: Any,
        rollout_id: str | None,
        attempt_id: str | None,
        headers: Mapping[str, str] | None = None,
        route: str | None = None,
    ) -> Response: ...

    async def next_sequence_id(self, rollout_id: str, attempt_id: str) -> int | None: ...


@dataclass
class V1Server:
    """The 1.0 layer's state: the registered models, the pause gate, calls in flight."""

    proxy: ProxyCore
    options: AglV1Options
    base_backends: list[dict[str, Any]]
    models: dict[tuple[str, str], ModelEntry] = field(default_factory=dict)
    paused: bool = False
    retry_after_seconds: int = 5
    reason: str | None = None
    inflight: int = 0
    known: OrderedDict[str, None] = field(default_factory=OrderedDict)

    @property
    def store(self) -> AglStore:
        if self.proxy.store is None:
            raise HTTPException(503, "the store client is not started")
        return self.proxy.store

    def endpoints(self) -> list[str]:
        return sorted(e.endpoint for e in self.models.values() if e.model == self.options.model_name)

    def route_name(self, index: int) -> str:
        return f"{self.options.model_name}#agl-v1-{index}"

    def sync_backends(self) -> None:
        """The proxy's backends: those it was started with, plus one group per registered
        endpoint of the 1.0 model (a rollout is pinned to one, as 1.0 pins it)."""
        pinned = [
            {
                "model_name": self.route_name(i),
                "litellm_params": {"model": f"openai/{self.options.model_name}", "api_base": url, "api_key": "none"},
            }
            for i, url in enumerate(self.endpoints())
        ]
        self.proxy.use_backends([*self.base_backends, *pinned])

    def state(self) -> dict[str, Any]:
        return {
            "paused": self.paused,
            "retry_after_seconds": self.retry_after_seconds,
            "reason": self.reason,
            "inflight": self.inflight,
        }

    async def rollouts(self, *, rollout_ids: Sequence[str] | None = None, **where: Any) -> list[tuple[Rollout, Any]]:
        """1.0 rollouts with their attempt's metadata (read after this client's writes)."""
        store = self.store
        query = store.sql.v1_rollouts(rollout_ids=rollout_ids, **where)
        rows = await store.read(query, "rollout-state")
        return [(rollout_from_row(row), _json(row["attempt_metadata"])) for row in rows]

    async def one(self, rollout_id: str) -> tuple[Rollout, Any]:
        found = await self.rollouts(rollout_ids=[rollout_id])
        if not found:
            raise HTTPException(404, f"Rollout not found: {rollout_id}")
        return found[0]


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) and value else None


def _server(request: Request) -> V1Server:
    server: V1Server = request.app.state.agl_v1
    return server


async def _body(request: Request) -> Any:
    try:
        return parse_json(await request.body())
    except MalformedBodyError as exc:
        raise HTTPException(400, "Invalid JSON in request body") from exc


def _parsed(adapter: TypeAdapter[Any], value: Any) -> Any:
    try:
        return adapter.validate_python(value)
    except ValidationError as exc:
        raise HTTPException(422, exc.errors(include_url=False, include_context=False)) from exc


def _attempts(rollout: Rollout, attempt_metadata: Any) -> list[str]:
    """1.0 lists an attempt once it has events: here, once the controller or a span started it."""
    started = agl_v1.lifecycle_of(attempt_metadata).get("state") is not None or rollout.status != "preparing"
    return [ATTEMPT_ID] if started else []


# -- routes -------------------------------------------------------------------------------------

router = APIRouter()


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.post("/api/rollouts", status_code=201)
async def create_rollouts(request: Request) -> JSONResponse:
    server = _server(request)
    creates: list[RolloutCreate] = _parsed(_CREATES, await _body(request))
    if len(creates) > MAX_ROLLOUTS:
        raise HTTPException(413, f"{len(creates):,} rollouts in one request, over {MAX_ROLLOUTS:,}")
    ids = [create.rollout_id or agl_v1.new_rollout_id() for create in creates]
    found = {rollout.rollout_id: (rollout, meta) for rollout, meta in await server.rollouts(rollout_ids=ids)}
    now = time.time()
    fresh: dict[str, Rollout] = {}
    for rollout_id, create in zip(ids, creates, strict=True):
        if rollout_id not in found and rollout_id not in fresh:
            fresh[rollout_id] = agl_v1.new_rollout(create, rollout_id, now)
    if fresh:
        try:
            started = await server.store.start_rollouts(list(fresh.values()), attempt_id=ATTEMPT_ID)
        except ValueError:  # another create of the same id got there first: answer with what it made
            started = []
        found.update({r.rollout_id: (r, r.attempt.metadata) for r in started if agl_v1.is_v1(r)})
        missing = [rid for rid in fresh if rid not in found]
        if missing:
            found.update({r.rollout_id: (r, m) for r, m in await server.rollouts(rollout_ids=missing)})
    taken = [rid for rid in ids if rid not in found]
    if taken:
        raise HTTPException(
            409, f"Rollout ids already used by rollouts that are not Agent Lightning 1.0's: {taken[:5]}"
        )
    return JSONResponse([agl_v1.view(*found[rid]) for rid in ids], status_code=201)


@router.get("/api/rollouts")
async def list_rollouts(
    request: Request, state_in: Annotated[list[V1State], Query()], limit: Annotated[int, Query(ge=0)] = 500
) -> JSONResponse:
    found = await _server(request).rollouts(states=state_in, limit=limit)
    return JSONResponse([agl_v1.view(rollout, meta) for rollout, meta in found])


@router.get("/api/rollouts/terminal")
async def terminal_rollouts(request: Request, after: int = 0, limit: int = 1000) -> dict[str, Any]:
    store = _server(request).store
    after, limit = max(after, 0), max(limit, 1)
    rows = await store.read(store.sql.v1_terminal(after=after, limit=limit), "rollout-state")
    [total] = await store.read(store.sql.v1_terminal_total(), "rollout-state")
    items = [
        {
            "rollout_id": row["rollout_id"],
            "state": row["v1_state"],
            "data_id": agl_v1.data_id_of(_json(row["input"])),
            "is_train": row["mode"] == "train",
        }
        for row in rows
    ]
    return {"items": items, "next_after": after + len(items), "total_terminal": int(total["total"])}


@router.get("/api/rollouts/{rollout_id}")
async def get_rollout(request: Request, rollout_id: str) -> dict[str, Any]:
    rollout, meta = await _server(request).one(rollout_id)
    return {"rollout": agl_v1.view(rollout, meta), "attempts": _attempts(rollout, meta)}


@router.patch("/api/rollouts/{rollout_id}")
async def patch_rollout(request: Request, rollout_id: str) -> dict[str, Any]:
    server = _server(request)
    patch: RolloutPatch = _parsed(TypeAdapter(RolloutPatch), await _body(request))
    rollout, meta = await server.one(rollout_id)
    if patch.status is None:
        return agl_v1.view(rollout, meta)
    lifecycle = agl_v1.lifecycle_of(meta)
    state = agl_v1.state_of(rollout.status, lifecycle)
    try:
        change = agl_v1.patched(rollout_id, state, lifecycle, patch.status, time.time())
    except TransitionConflict as exc:
        raise HTTPException(409, str(exc)) from exc
    if change is None:
        return agl_v1.view(rollout, meta)
    status, new_lifecycle = change
    metadata = {**(meta if isinstance(meta, Mapping) else {}), agl_v1.V1_KEY: new_lifecycle}
    try:
        if status is None:
            await server.store.update_attempt(rollout_id, ATTEMPT_ID, metadata=metadata)
        else:
            await server.store.update_attempt(rollout_id, ATTEMPT_ID, status=status, metadata=metadata)
    except ValueError as exc:  # the store refused (the attempt finished meanwhile)
        raise HTTPException(409, f"Rollout {rollout_id}: {exc}") from exc
    rollout, meta = await server.one(rollout_id)
    return agl_v1.view(rollout, meta)


@router.delete("/api/rollouts/{rollout_id}", status_code=204)
async def delete_rollout(rollout_id: str) -> Response:
    """Answered as 1.0 answers it; the rollout stays in the log and the tables (agl-stream keeps
    history: replay, SQL), and the 1.0 listings still show it once."""
    return Response(status_code=204)


@router.post("/api/rollouts/{rollout_id}/attempt/{attempt_id}/events")
async def post_event(request: Request, rollout_id: str, attempt_id: str) -> dict[str, Any]:
    server = _server(request)
    event: EventCreate = _parsed(TypeAdapter(EventCreate), await _body(request))
    sequence_id = await server.proxy.next_sequence_id(rollout_id, attempt_id)
    if sequence_id is None:
        raise HTTPException(404, f"Rollout not found: {rollout_id} (attempt {attempt_id})")
    span = agl_v1.event_span(rollout_id, attempt_id, sequence_id, event, time.time())
    await server.store.export_spans([span])
    [stored] = agl_v1.events_of([span])
    return stored


@router.get("/api/rollouts/{rollout_id}/events")
async def list_events(
    request: Request,
    rollout_id: str,
    event_type: str | None = None,
    format: str | None = None,
    include_routed_experts: bool = True,
) -> JSONResponse:
    server = _server(request)
    _, meta = await server.one(rollout_id)
    attempt_id = agl_v1.lifecycle_of(meta).get("last_attempt_id") or ATTEMPT_ID
    spans = await server.store.query_spans(rollout_id, attempt_id)
    events = agl_v1.events_of(spans)
    if event_type is not None:
        events = [e for e in events if e["event_type"] == event_type]
    if format == "triplet":
        events = agl_v1.triplet_events(events)
    if not include_routed_experts:
        events = agl_v1.without_routed_experts(events)
    return JSONResponse(events)


@router.post("/api/models", status_code=201)
async def register_models(request: Request) -> JSONResponse:
    server = _server(request)
    entries: list[ModelEntry] = _parsed(_MODELS, await _body(request))
    for entry in entries:
        server.models[(entry.model, entry.endpoint)] = entry
    server.sync_backends()
    log.info("models registered", endpoints=server.endpoints(), model=server.options.model_name)
    return JSONResponse([e.model_dump() for e in entries], status_code=201)


@router.delete("/api/models")
async def delete_models(request: Request) -> dict[str, str]:
    server = _server(request)
    server.models.clear()
    server.sync_backends()
    return {"status": "ok"}


@router.post("/proxy/pause")
async def pause(request: Request) -> dict[str, Any]:
    server = _server(request)
    raw = await request.body()
    body: PauseBody = _parsed(TypeAdapter(PauseBody), parse_json(raw) if raw.strip() else {})
    server.paused, server.retry_after_seconds, server.reason = True, body.retry_after_seconds, body.reason
    return server.state()


@router.post("/proxy/resume")
async def resume(request: Request) -> dict[str, Any]:
    server = _server(request)
    server.paused, server.reason = False, None
    return server.state()


@router.get("/proxy/state")
async def proxy_state(request: Request) -> dict[str, Any]:
    return _server(request).state()


@router.post("/proxy/rollout/{rollout_id}/attempt/{attempt_id}/mode/{mode}/openai/v1/{upstream_path:path}")
async def proxy_call(request: Request, rollout_id: str, attempt_id: str, mode: str, upstream_path: str) -> Response:
    server = _server(request)
    kind = UPSTREAM_PATHS.get(upstream_path)
    if mode not in ("train", "val") or kind is None:
        raise HTTPException(404, "Not Found")
    if rollout_id not in server.known:
        await server.one(rollout_id)
        server.known[rollout_id] = None
        while len(server.known) > KNOWN_ROLLOUTS:
            server.known.popitem(last=False)
    body = await _body(request)
    if not isinstance(body, dict):
        raise HTTPException(400, "Request body must be a JSON object")
    endpoints = server.endpoints()
    if not endpoints:
        raise HTTPException(503, f"No servers available for model '{server.options.model_name}'")
    if server.paused:
        return JSONResponse(
            {"error": "gateway paused", "reason": server.reason},
            status_code=429,
            headers={"Retry-After": str(server.retry_after_seconds), "X-Agl-Paused": "true"},
        )
    options = server.options
    body = {**body, "model": options.model_name}
    temperature = options.train_temperature if mode == "train" else options.val_temperature
    if temperature is not None:
        body["temperature"] = temperature
    if mode == "train" and options.include_log_probs and kind == CHAT:
        body["logprobs"] = True
    pin = int.from_bytes(hashlib.sha256(rollout_id.encode()).digest()[:8], "big") % len(endpoints)
    server.inflight += 1
    try:
        return await server.proxy.handle(
            kind, body, rollout_id, attempt_id, request.headers, route=server.route_name(pin)
        )
    finally:
        server.inflight -= 1


async def _store_failed(request: Request, exc: Exception) -> JSONResponse:
    """What the store or the broker refused, as 1.0's clients expect errors (``detail``): a value
    too large or unencodable is the caller's (413/422); anything else is ours for now (503, which
    1.0's clients retry)."""
    if isinstance(exc, MessageSizeTooLargeError):
        return JSONResponse({"detail": f"a value is too large to store: {exc}"}, status_code=413)
    if isinstance(exc, CodecError):
        return JSONResponse({"detail": f"a value cannot be stored: {exc}"}, status_code=422)
    log.warning("the store failed a 1.0 request", path=request.url.path, error=f"{type(exc).__name__}: {exc}")
    return JSONResponse(
        {"detail": f"the store is unavailable ({type(exc).__name__}): retry"},
        status_code=503,
        headers={"Retry-After": "2"},
    )


def install(app: FastAPI, proxy: ProxyCore, options: AglV1Options) -> V1Server:
    """Serve 1.0's routes on ``app`` (the proxy's own); the proxy's backends named
    ``options.model_name`` count as registered endpoints from the start."""
    base = [dict(entry) for entry in proxy.model_list]
    server = V1Server(proxy, options, base)
    for entry in base:
        if entry.get("model_name") == options.model_name:
            endpoint = str(entry.get("litellm_params", {}).get("api_base") or "")
            if endpoint:
                server.models[(options.model_name, endpoint)] = ModelEntry(model=options.model_name, endpoint=endpoint)
    if server.models:
        server.sync_backends()
    app.state.agl_v1 = server
    app.include_router(router)
    for error in (AglError, KafkaError):
        app.add_exception_handler(error, _store_failed)
    return server
