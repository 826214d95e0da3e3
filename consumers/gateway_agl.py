"""``/v1/agl`` on the gateway: Agent Lightning's store REST API, so the seed's own HTTP client
(``LightningStoreClient``) and everything built on it (its runners, algorithms) work against an
agl-stream stack unchanged.

Every route is a thin mapping onto the gateway's one store client (the one its OTLP receiver
writes spans with, see agl_stream/trace_ingest.py): writes are events on Kafka folded by the
rollout processor, reads come from ClickHouse fenced on that client's writes. Because every
caller of this API shares that client, a read through ``/v1/agl`` sees every write made through
``/v1/agl`` or ``/v1/traces`` before it.

Routes (paths, bodies and answers as the seed's server has them; bodies are JSON):

- ``GET health``; ``GET statistics``.
- ``POST queues/rollouts/enqueue`` ``{"rollouts": [...]}`` (201), ``POST queues/rollouts/dequeue``
  ``{"limit", "worker_id"}`` (a list, empty when nothing is queued).
- ``POST rollouts`` (start a rollout with its first attempt, 201); ``GET rollouts`` (query
  parameters) and ``POST rollouts/search``: a page ``{"items", "limit", "offset", "total"}``;
  ``GET rollouts/{id}`` (null when unknown); ``POST rollouts/{id}`` (update the fields given).
- ``POST rollouts/{id}/attempts`` (a manual attempt, 201); ``GET rollouts/{id}/attempts`` and
  ``POST rollouts/{id}/attempts/search`` (a page); ``GET rollouts/{id}/attempts/latest``;
  ``POST rollouts/{id}/attempts/{attempt_id}`` (update; ``latest`` names the newest).
- ``GET workers``, ``POST workers/search`` (pages); ``GET workers/{id}`` (null when unknown);
  ``POST workers/{id}`` (a heartbeat with ``heartbeat_stats``).
- ``GET resources`` (a page; API keys redacted, as ClickHouse holds them); ``POST resources``
  (201); ``GET resources/latest`` and ``GET resources/{id}`` (null when none; API keys
  included, from agl.resources: runners need them); ``POST resources/{id}`` (a new version).
- ``POST spans`` (one span, 201); ``GET spans`` and ``POST spans/search`` (a page);
  ``POST spans/next`` ``{"rollout_id", "attempt_id"}`` -> ``{"sequence_id"}``.
- ``POST waits/rollouts`` ``{"rollout_ids", "timeout"}``: the finished subset after at most
  ``timeout`` seconds (null or over :data:`MAX_WAIT_SECONDS`: that many); at most
  :data:`MAX_ITEMS` ids, watched :data:`WAIT_BATCH` at a time.

Errors are JSON ``{"error": kind, "message", "detail"}`` (``detail`` is what the seed's
FastAPI answers carry: a message, or the list of validation errors): 422 ``invalid_request``
for a body or query that is not what the route takes (``malformed_json`` for one that is not
JSON), 400 ``bad_request`` for paging the seed refuses (limit 0, negative offset) and for a
field sent as null that cannot be null, 400 ``rejected`` when the store refuses a change (an
illegal transition), 404 ``not_found`` for an unknown rollout, attempt or resources id in a
change (reads of one item answer null instead, as the seed's), 413 over the size limits (the
body, :data:`MAX_ITEMS`, a record over the broker's or the store's record limit), 503
(``Retry-After``) while the store client is not up, the processor does not answer or the gateway
stops, and 503 ``queue_full`` (``Retry-After``) when an enqueue finds its partition's queue at
``AGL_MAX_QUEUED_PER_PARTITION``; the seed's client retries 5xx answers and gives up at once on 4xx ones. A caller's
mistake is always a 4xx: numbers JSON cannot carry back (``1e400``, which parses as infinity)
are refused with the body (422 ``malformed_json``), integers outside 64 bits and negative
sequence ids with 422 ``invalid_request``, a value the records' schema cannot hold with 422,
all before anything is written. Answers render a stored non-finite number (one written through
another path) as null rather than failing.

Where this differs from the seed's server, deliberately:
- The seed answers a store error (an unknown rollout in an update, an illegal transition) with
  500 and a traceback, which its client retries for seconds; here it is the 4xx above, once.
- ``GET rollouts/{id}`` for an unknown id answers null (the seed's server fails it with 500 and
  its client turns that into None after its retries).
- A page's ``total`` is exact; when the page is full the gateway counts the matches with one
  COUNT query (the store client's ``count_*`` methods).
- A span's fields beyond agl-stream's Span (the seed's model keeps unknown fields as extras)
  are dropped; ``kind``, ``scope_name`` and ``scope_version`` are kept when given.
- ``POST rollouts/{id}/attempts`` with a ``worker_id`` starts the attempt, then assigns the
  worker with an attempt update (the store client starts manual attempts without a worker).
- ``dequeue`` with ``limit`` > 1 claims one rollout at a time until the queue is empty or the
  limit is reached (at most :data:`MAX_ITEMS`).
- Auth is the gateway's: no token on loopback unless ``AGL_REQUIRE_TOKEN=1``; a gateway that
  requires one refuses the seed's client, which sends none.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Annotated, Any, TypeVar

from aiokafka.errors import KafkaError, MessageSizeTooLargeError
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from agl_stream.errors import AglError, CodecError
from agl_stream.http_serving import (
    MAX_BODY_BYTES,
    BodyTooLargeError,
    FiniteJSONResponse,
    MalformedBodyError,
    answering,
    parse_json,
    read_body,
    refuse_while_stopping,
)
from agl_stream.logs import get_logger
from agl_stream.models import Rollout
from agl_stream.store.client import AglStore
from agl_stream.store.replies import QueueFullError
from agl_stream.store.types import AttemptedRollout
from consumers.gateway_agl_shapes import (
    ATTEMPT_NOT_NULL,
    NAMED_RESOURCES,
    ROLLOUT_NOT_NULL,
    WORKER_NOT_NULL,
    AttemptChanges,
    AttemptsQuery,
    DequeueBody,
    EnqueueBody,
    Refusal,
    ResourcesQuery,
    RolloutChanges,
    RolloutsQuery,
    SequenceBody,
    SpansQuery,
    StartAttemptBody,
    StartRolloutBody,
    WaitBody,
    WorkerChanges,
    WorkersQuery,
    _Paging,
    check_paging,
    error_response,
    explicit_changes,
    known_total,
    page_body,
    query_values,
    span_from_wire,
    store_refusal,
    validation_refusal,
)

log = get_logger("agl.gateway.agl")

PREFIX = "/v1/agl"
MAX_ITEMS = 10_000
"""Rollouts one enqueue may carry, claims one dequeue may make, and ids one wait may name."""
WAIT_BATCH = 500
"""Ids of one wait that are watched in one stretch (one store request each): between batches
the event loop serves everything else, so a wait for many ids never holds the gateway."""
MAX_WAIT_SECONDS = 25.0
"""The longest one ``waits/rollouts`` request is held (its ``timeout`` null included): under the
seed client's 30 s request timeout, so a wait without a timeout ends with the finished subset
instead of a client-side timeout and its retries; and a held request is a coroutine on the
gateway, which must not outlive a client that has gone."""

M = TypeVar("M", bound=BaseModel)
StoreGetter = Callable[[], Awaitable[AglStore]]


# -- I/O helpers ----------------------------------------------------------------------------------


async def _json_body(request: Request, *, optional: bool = False) -> Any:
    """The parsed body; None for an empty one when ``optional``."""
    try:
        raw = await read_body(request, MAX_BODY_BYTES)
    except BodyTooLargeError as exc:
        raise Refusal(413, "too_large", str(exc)) from exc
    if not raw.strip():
        if optional:
            return None
        raise Refusal(
            422,
            "invalid_request",
            "this route takes a JSON body",
            [{"type": "missing", "loc": ["body"], "msg": "Field required"}],
        )
    try:
        return parse_json(raw)
    except MalformedBodyError as exc:
        raise Refusal(
            422, "malformed_json", str(exc), [{"type": "json_invalid", "loc": ["body"], "msg": str(exc)}]
        ) from exc


async def _body(request: Request, shape: type[M], *, optional: bool = False) -> M:
    parsed = await _json_body(request, optional=optional)
    try:
        return shape.model_validate({} if parsed is None else parsed)
    except ValidationError as exc:
        raise validation_refusal(exc, "body") from exc


def _query(request: Request, shape: type[M]) -> M:
    try:
        return shape.model_validate(query_values(request.query_params, shape))
    except ValidationError as exc:
        raise validation_refusal(exc, "query") from exc


def _json(value: Any, status: int = 200) -> JSONResponse:
    """An answer; a stored number that JSON cannot carry (infinity) is null in it."""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    elif isinstance(value, list):
        value = [item.model_dump(mode="json") if isinstance(item, BaseModel) else item for item in value]
    return FiniteJSONResponse(value, status_code=status)


async def _paged(
    request: Request,
    shape: type[_Paging],
    store: StoreGetter,
    fetch: Callable[..., Awaitable[Sequence[BaseModel]]],
    count: Callable[..., Awaitable[int]],
    **where: Any,
) -> JSONResponse:
    """A page of a listing and its total: told by the page itself, or else counted (one COUNT
    query). The query is the query string of ``GET path`` or the JSON body of ``POST
    path/search`` (which may be left out unless the query has a required field); ``fetch`` and
    ``count`` are the store's ``query_*`` and ``count_*``, given ``where`` and the query's fields."""
    if request.method == "GET":
        query = _query(request, shape)
    else:
        optional = not any(field.is_required() for field in shape.model_fields.values())
        query = await _body(request, shape, optional=optional)
    check_paging(query)
    client = await store()
    items = await fetch(client, **where, **query.model_dump())
    total = known_total(query.limit, query.offset, len(items))
    if total is None:
        total = await count(client, **where, **query.where())
    return FiniteJSONResponse(page_body(items, query.limit, query.offset, total))


# -- the routes -----------------------------------------------------------------------------------


def serve_agl(app: FastAPI, store: StoreGetter) -> None:
    """Serve the seed's REST API on ``app``, on the store client ``store()`` returns (started on
    demand); while the app's ``state.stopping()`` every route but health answers 503."""
    app.state.agl_store = store
    app.include_router(health_router)
    app.include_router(router)


def _store_errors(exc: Exception) -> Response | None:
    """Every error of the store as the gateway's error shape, in one place (the seed's client
    retries 5xx, gives up on 4xx)."""
    if isinstance(exc, ValidationError):  # a value the store's records refuse (checked after parsing)
        return validation_refusal(exc, "body").response()
    if isinstance(exc, CodecError):  # a value the records' schema cannot hold: nothing was written
        return error_response(422, "invalid_request", f"a value cannot be stored: {exc}")
    if isinstance(exc, MessageSizeTooLargeError):  # one record over the producer's limit: not sent
        return error_response(413, "too_large", f"a record is too large to store: {exc}; send smaller values")
    if isinstance(exc, QueueFullError):  # back-pressure, not a mistake: 503, which the seed's client retries
        return error_response(503, "queue_full", str(exc), headers={"Retry-After": "5"})
    if isinstance(exc, ValueError):  # the store's verdict (RejectedError included)
        status, kind = store_refusal(exc)
        return error_response(status, kind, str(exc))
    if isinstance(exc, (AglError, KafkaError)):  # not up, the processor silent, the broker down
        return error_response(503, "unavailable", str(exc), headers={"Retry-After": "2"})
    log.exception("agl route failed", error=f"{type(exc).__name__}: {exc}")
    return error_response(500, "internal", f"the gateway failed this request ({type(exc).__name__})")


def _store_getter(request: Request) -> StoreGetter:
    getter: StoreGetter = request.app.state.agl_store
    return getter


Store = Annotated[StoreGetter, Depends(_store_getter)]
"""The gateway's store client, started when a route first needs it."""

health_router = APIRouter(prefix=PREFIX)
router = APIRouter(prefix=PREFIX, route_class=answering(_store_errors), dependencies=[Depends(refuse_while_stopping)])
# Paged listings are served twice, as the seed serves them: ``GET path`` with the query in the
# query string and ``POST path/search`` with it as a JSON body (one function, see _paged). Fixed
# paths are declared before the parameterised ones beside them (``/rollouts/search`` before
# ``/rollouts/{rollout_id}``).


@health_router.get("/health")
async def health(request: Request) -> Response:
    if request.app.state.stopping():
        return JSONResponse({"status": "stopping"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/statistics")
async def statistics(store: Store) -> Response:
    return JSONResponse(dict(await (await store()).statistics()))


# -- the queue ------------------------------------------------------------------------------------


@router.post("/queues/rollouts/enqueue")
async def enqueue(request: Request, store: Store) -> Response:
    body = await _body(request, EnqueueBody)
    if len(body.rollouts) > MAX_ITEMS:
        raise Refusal(413, "too_large", f"{len(body.rollouts):,} rollouts in one request, over {MAX_ITEMS:,}")
    if not body.rollouts:
        return _json([], 201)
    return _json(await (await store()).enqueue_many_rollouts(body.rollouts), 201)


@router.post("/queues/rollouts/dequeue")
async def dequeue(request: Request, store: Store) -> Response:
    body = await _body(request, DequeueBody, optional=True)
    if body.limit > MAX_ITEMS:
        raise Refusal(400, "bad_request", f"limit {body.limit:,} is over {MAX_ITEMS:,}")
    client = await store() if body.limit > 0 else None
    claimed: list[AttemptedRollout] = []
    while client is not None and len(claimed) < body.limit:
        rollout = await client.dequeue_rollout(worker_id=body.worker_id)
        if rollout is None:
            break
        claimed.append(rollout)
    return _json(claimed)


# -- rollouts -------------------------------------------------------------------------------------


@router.post("/rollouts")
async def start_rollout(request: Request, store: Store) -> Response:
    body = await _body(request, StartRolloutBody)
    return _json(await (await store()).start_rollout(**dict(body)), 201)


@router.get("/rollouts")
@router.post("/rollouts/search")
async def query_rollouts(request: Request, store: Store) -> Response:
    return await _paged(request, RolloutsQuery, store, AglStore.query_rollouts, AglStore.count_rollouts)


@router.get("/rollouts/{rollout_id}")
async def get_rollout(rollout_id: str, store: Store) -> Response:
    return _json(await (await store()).get_rollout_by_id(rollout_id))


@router.post("/rollouts/{rollout_id}")
async def update_rollout(rollout_id: str, request: Request, store: Store) -> Response:
    changes = explicit_changes(await _body(request, RolloutChanges), ROLLOUT_NOT_NULL)
    return _json(await (await store()).update_rollout(rollout_id, **changes))


# -- attempts -------------------------------------------------------------------------------------


@router.post("/rollouts/{rollout_id}/attempts")
async def start_attempt(rollout_id: str, request: Request, store: Store) -> Response:
    body = await _body(request, StartAttemptBody, optional=True)
    return _json(await (await store()).start_attempt(rollout_id, worker_id=body.worker_id), 201)


@router.get("/rollouts/{rollout_id}/attempts")
@router.post("/rollouts/{rollout_id}/attempts/search")
async def query_attempts(rollout_id: str, request: Request, store: Store) -> Response:
    fetch, count = AglStore.query_attempts, AglStore.count_attempts
    return await _paged(request, AttemptsQuery, store, fetch, count, rollout_id=rollout_id)


@router.get("/rollouts/{rollout_id}/attempts/latest")
async def latest_attempt(rollout_id: str, store: Store) -> Response:
    return _json(await (await store()).get_latest_attempt(rollout_id))


@router.post("/rollouts/{rollout_id}/attempts/{attempt_id}")
async def update_attempt(rollout_id: str, attempt_id: str, request: Request, store: Store) -> Response:
    changes = explicit_changes(await _body(request, AttemptChanges), ATTEMPT_NOT_NULL)
    return _json(await (await store()).update_attempt(rollout_id, attempt_id, **changes))


# -- workers --------------------------------------------------------------------------------------


@router.get("/workers")
@router.post("/workers/search")
async def query_workers(request: Request, store: Store) -> Response:
    return await _paged(request, WorkersQuery, store, AglStore.query_workers, AglStore.count_workers)


@router.get("/workers/{worker_id}")
async def get_worker(worker_id: str, store: Store) -> Response:
    return _json(await (await store()).get_worker_by_id(worker_id))


@router.post("/workers/{worker_id}")
async def update_worker(worker_id: str, request: Request, store: Store) -> Response:
    changes = explicit_changes(await _body(request, WorkerChanges, optional=True), WORKER_NOT_NULL)
    return _json(await (await store()).update_worker(worker_id, **changes))


# -- resources ------------------------------------------------------------------------------------


async def _named_resources(request: Request) -> dict[str, Any]:
    try:
        return dict(NAMED_RESOURCES.validate_python(await _json_body(request)))
    except ValidationError as exc:
        raise validation_refusal(exc, "body") from exc


@router.get("/resources")
async def query_resources(request: Request, store: Store) -> Response:
    return await _paged(request, ResourcesQuery, store, AglStore.query_resources, AglStore.count_resources)


@router.post("/resources")
async def add_resources(request: Request, store: Store) -> Response:
    resources = await _named_resources(request)
    return _json(await (await store()).add_resources(resources), 201)


@router.get("/resources/latest")
async def latest_resources(store: Store) -> Response:
    return _json(await (await store()).get_latest_resources())


@router.get("/resources/{resources_id}")
async def get_resources(resources_id: str, store: Store) -> Response:
    return _json(await (await store()).get_resources_by_id(resources_id))


@router.post("/resources/{resources_id}")
async def update_resources(resources_id: str, request: Request, store: Store) -> Response:
    resources = await _named_resources(request)
    return _json(await (await store()).update_resources(resources_id, resources))


# -- spans ----------------------------------------------------------------------------------------


@router.post("/spans")
async def add_span(request: Request, store: Store) -> Response:
    parsed = await _json_body(request)
    try:
        span = span_from_wire(parsed)
    except ValidationError as exc:
        raise validation_refusal(exc, "body") from exc
    return _json(await (await store()).add_span(span), 201)


@router.get("/spans")
@router.post("/spans/search")
async def query_spans(request: Request, store: Store) -> Response:
    return await _paged(request, SpansQuery, store, AglStore.query_spans, AglStore.count_spans)


@router.post("/spans/next")
async def next_sequence_id(request: Request, store: Store) -> Response:
    body = await _body(request, SequenceBody)
    sequence_id = await (await store()).get_next_span_sequence_id(body.rollout_id, body.attempt_id)
    return JSONResponse({"sequence_id": sequence_id})


# -- waits ----------------------------------------------------------------------------------------


@router.post("/waits/rollouts")
async def wait_for_rollouts(request: Request, store: Store) -> Response:
    body = await _body(request, WaitBody)
    if len(body.rollout_ids) > MAX_ITEMS:
        raise Refusal(413, "too_large", f"{len(body.rollout_ids):,} rollout ids in one wait, over {MAX_ITEMS:,}")
    timeout = MAX_WAIT_SECONDS if body.timeout is None else min(body.timeout, MAX_WAIT_SECONDS)
    client = await store()
    # A wait per batch of ids, each started after the loop served whatever else was waiting:
    # the ids the client has not heard of are watched (a store request each) a batch at a time
    # instead of all in one stretch of the loop.
    ids = list(dict.fromkeys(body.rollout_ids))
    waits: list[asyncio.Task[list[Rollout]]] = []
    try:
        for start in range(0, len(ids), WAIT_BATCH):
            batch = ids[start : start + WAIT_BATCH]
            waits.append(asyncio.create_task(client.wait_for_rollouts(rollout_ids=batch, timeout=timeout)))
            await asyncio.sleep(0)
        finished = {rollout.rollout_id: rollout for done in await asyncio.gather(*waits) for rollout in done}
    finally:
        for wait in waits:
            wait.cancel()
    return _json([finished[rid] for rid in body.rollout_ids if rid in finished])
