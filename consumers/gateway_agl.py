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
import re
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any, Literal, TypeAlias, TypeVar

from aiokafka.errors import KafkaError, MessageSizeTooLargeError
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from starlette.datastructures import QueryParams

from agl_stream.errors import AglError, CodecError
from agl_stream.http_serving import (
    MAX_BODY_BYTES,
    BodyTooLargeError,
    FiniteJSONResponse,
    MalformedBodyError,
    parse_json,
    read_body,
)
from agl_stream.logs import get_logger
from agl_stream.models import Rollout, Span
from agl_stream.models.base import AttemptStatus, EpochSeconds, RolloutMode, RolloutStatus, WorkerStatus
from agl_stream.models.resources import Resource
from agl_stream.models.rollouts import RolloutConfig
from agl_stream.models.spans import OtelResource, SpanContext, SpanEvent, SpanLink, SpanStatus
from agl_stream.store.client import AglStore
from agl_stream.store.replies import QueueFullError
from agl_stream.store.types import AttemptedRollout, EnqueueRolloutRequest

log = get_logger("agl.gateway.agl")

PREFIX = "/v1/agl"
MAX_ITEMS = 10_000
"""Rollouts one enqueue may carry, claims one dequeue may make, and ids one wait may name."""
WAIT_BATCH = 500
"""Ids of one wait that are watched in one stretch (one store request each): between batches
the event loop serves everything else, so a wait for many ids never holds the gateway."""
MAX_INT64 = 2**63 - 1
"""The largest integer the store's records and ClickHouse's columns hold (Avro long, Int64)."""
MAX_WAIT_SECONDS = 25.0
"""The longest one ``waits/rollouts`` request is held (its ``timeout`` null included): under the
seed client's 30 s request timeout, so a wait without a timeout ends with the finished subset
instead of a client-side timeout and its retries; and a held request is a coroutine on the
gateway, which must not outlive a client that has gone."""

M = TypeVar("M", bound=BaseModel)
StoreGetter = Callable[[], Awaitable[AglStore]]


# -- request shapes (the seed's field names and defaults) ---------------------------------------


class _Shape(BaseModel):
    model_config = ConfigDict(extra="ignore")  # as the seed's request models: unknown keys pass


class _Paging(_Shape):
    limit: int = -1
    offset: int = 0
    sort_by: str | None = None
    sort_order: Literal["asc", "desc"] = "asc"


P = TypeVar("P", bound=_Paging)
Listing: TypeAlias = Callable[[AglStore, P, Mapping[str, Any], int, int], Awaitable[Sequence[BaseModel]]]
"""One listing's store call: (client, query, path parameters, limit, offset) -> the page."""
Counting: TypeAlias = Callable[[AglStore, P, Mapping[str, Any]], Awaitable[int]]
"""One listing's count: (client, query, path parameters) -> how many match, unpaged."""


class RolloutsQuery(_Paging):
    status_in: list[RolloutStatus] | None = None
    rollout_id_in: list[str] | None = None
    rollout_id_contains: str | None = None
    filter_logic: Literal["and", "or"] = "and"


class AttemptsQuery(_Paging):
    sort_by: str | None = "sequence_id"


class ResourcesQuery(_Paging):
    resources_id: str | None = None
    resources_id_contains: str | None = None


class WorkersQuery(_Paging):
    status_in: list[WorkerStatus] | None = None
    worker_id_contains: str | None = None
    filter_logic: Literal["and", "or"] = "and"


class SpansQuery(_Paging):
    rollout_id: str
    attempt_id: str | None = None
    trace_id: str | None = None
    trace_id_contains: str | None = None
    span_id: str | None = None
    span_id_contains: str | None = None
    parent_id: str | None = None
    parent_id_contains: str | None = None
    name: str | None = None
    name_contains: str | None = None
    filter_logic: Literal["and", "or"] = "and"
    sort_by: str | None = "sequence_id"

    def filters(self) -> dict[str, Any]:
        """The span filters as query_spans takes them (paging included)."""
        return self.model_dump(exclude={"rollout_id", "attempt_id"})


class EnqueueBody(_Shape):
    rollouts: list[EnqueueRolloutRequest]


class DequeueBody(_Shape):
    limit: int = 1
    worker_id: str | None = None


class StartRolloutBody(_Shape):
    input: Any
    mode: RolloutMode | None = None
    resources_id: str | None = None
    config: RolloutConfig | None = None
    metadata: dict[str, Any] | None = None
    worker_id: str | None = None


class RolloutChanges(_Shape):
    input: Any = None
    mode: RolloutMode | None = None
    resources_id: str | None = None
    status: RolloutStatus | None = None
    config: RolloutConfig | None = None
    metadata: dict[str, Any] | None = None


class StartAttemptBody(_Shape):
    worker_id: str | None = None


class AttemptChanges(_Shape):
    status: AttemptStatus | None = None
    worker_id: str | None = None
    last_heartbeat_time: EpochSeconds | None = None
    metadata: dict[str, Any] | None = None


class WorkerChanges(_Shape):
    heartbeat_stats: dict[str, Any] | None = None


class SequenceBody(_Shape):
    rollout_id: str
    attempt_id: str


class WaitBody(_Shape):
    rollout_ids: list[str]
    timeout: float | None = Field(None, ge=0, allow_inf_nan=False)


NAMED_RESOURCES: TypeAdapter[dict[str, Resource]] = TypeAdapter(dict[str, Resource])
"""A resources body: names -> LLM, ProxyLLM, PromptTemplate (or ModelCheckpoint)."""

ROLLOUT_NOT_NULL = frozenset({"status", "config"})
"""Fields of a rollout update that may be left out but not sent as null (the seed's rule)."""
ATTEMPT_NOT_NULL = frozenset({"status", "worker_id", "last_heartbeat_time", "metadata"})
WORKER_NOT_NULL = frozenset({"heartbeat_stats"})


# -- pure mapping ---------------------------------------------------------------------------------


class Refusal(Exception):
    """A request answered with an error before (or instead of) reaching the store."""

    def __init__(self, status: int, kind: str, message: str, detail: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message
        self.detail: Any = message if detail is None else detail  # the message, or a JSON value

    def response(self) -> JSONResponse:
        return error_response(self.status, self.kind, self.message, self.detail)


def error_response(
    status: int, kind: str, message: str, detail: Any = None, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    """The gateway's error shape plus the seed's ``detail``."""
    return JSONResponse(
        {"error": kind, "message": message, "detail": message if detail is None else detail},
        status_code=status,
        headers=dict(headers) if headers else None,
    )


def validation_refusal(error: ValidationError, where: str) -> Refusal:
    """422 with each problem as FastAPI reports them (``loc`` starts with body or query); the
    offending values are not echoed back."""
    detail = [
        {"type": e["type"], "loc": [where, *e["loc"]], "msg": e["msg"]}
        for e in error.errors(include_url=False, include_input=False)
    ]
    summary = "; ".join(f"{'.'.join(str(p) for p in d['loc'])}: {d['msg']}" for d in detail[:10])
    more = f" (and {len(detail) - 10} more)" if len(detail) > 10 else ""
    return Refusal(422, "invalid_request", f"the request is not what this route takes: {summary}{more}", detail)


def check_paging(paging: _Paging) -> None:
    """The paging the seed's server refuses with 400 before asking its store."""
    if paging.limit == 0 or paging.limit < -1:
        raise Refusal(400, "bad_request", f"limit must be -1 (no limit) or at least 1, not {paging.limit}")
    if paging.offset < 0:
        raise Refusal(400, "bad_request", f"offset must be 0 or more, not {paging.offset}")
    for name, value in (("limit", paging.limit), ("offset", paging.offset)):
        if value > MAX_INT64:
            raise Refusal(400, "bad_request", f"{name} must be at most {MAX_INT64}, not {value}")


def explicit_changes(body: BaseModel, not_null: Collection[str]) -> dict[str, Any]:
    """The fields a body sets (left-out fields keep their value in the store); Refusal 400 for a
    field in ``not_null`` sent as null."""
    changes = {name: getattr(body, name) for name in body.model_fields_set}
    nulls = sorted(name for name in not_null if name in changes and changes[name] is None)
    if nulls:
        raise Refusal(400, "bad_request", f"{', '.join(nulls)} cannot be null (leave a field out to keep it)")
    return changes


def known_total(limit: int, offset: int, count: int) -> int | None:
    """A page's total when the page itself tells it (it ends before the limit and is not past
    the end); None when the matches have to be counted."""
    if limit != -1 and count >= limit:
        return None
    if count == 0 and offset > 0:
        return None  # past the end, or exactly at it: the page does not say where the end is
    return offset + count


def page_body(items: Sequence[BaseModel], limit: int, offset: int, total: int) -> dict[str, Any]:
    return {"items": [item.model_dump(mode="json") for item in items], "limit": limit, "offset": offset, "total": total}


_NOT_FOUND = re.compile(r"^unknown (rollout|attempt)\b|\bdo(es)? not exist\b")
_TOO_LARGE = re.compile(r"\bbytes, over the [0-9,]+-byte limit\b")


def store_refusal(error: ValueError) -> tuple[int, str]:
    """HTTP status and kind of a ValueError of the store: an unknown id, an event over the
    record size limit, or a refused change."""
    message = str(error)
    if _NOT_FOUND.search(message):
        return 404, "not_found"
    if _TOO_LARGE.search(message):
        return 413, "too_large"
    return 400, "rejected"


def _known(model: type[BaseModel], value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    return {key: item for key, item in value.items() if key in model.model_fields}


def _kind(value: Any) -> Any:
    # The seed may carry OpenTelemetry's enum as text ("SpanKind.CLIENT"); the span keeps "CLIENT".
    return value.rsplit(".", 1)[-1] if isinstance(value, str) else value


def _link(value: Any) -> Any:
    link = _known(SpanLink, value)
    if isinstance(link, dict):
        if "context" in link:
            link["context"] = _known(SpanContext, link["context"])
        if link.get("attributes", {}) is None:  # optional in the seed's Link
            link["attributes"] = {}
    return link


def _out_of_range(value: Any) -> list[str | int] | None:
    """Where in a JSON value an integer lies outside the 64 bits a record holds; None if nowhere."""
    stack: list[tuple[list[str | int], Any]] = [([], value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, int) and not isinstance(item, bool):
            if not -MAX_INT64 - 1 <= item <= MAX_INT64:
                return path
        elif isinstance(item, dict):
            stack.extend(([*path, key], child) for key, child in item.items())
        elif isinstance(item, list):
            stack.extend(([*path, index], child) for index, child in enumerate(item))
    return None


def span_from_wire(data: Any) -> Span:
    """A span as the seed's client sends it -> agl-stream's Span.

    The seed's Span keeps unknown fields as extras; agl-stream's has fixed fields, so keys it does
    not have are dropped at every level (a missing or wrong field still fails validation).
    """
    if not isinstance(data, dict):
        return Span.model_validate(data)
    where = _out_of_range(data)
    if where is not None:  # the model would take it as a float, or the records refuse it
        message = f"{'.'.join(map(str, where))}: an integer must be from {-MAX_INT64 - 1} to {MAX_INT64}"
        detail = [{"type": "out_of_range", "loc": ["body", *where], "msg": message}]
        raise Refusal(422, "invalid_request", f"the request is not what this route takes: {message}", detail)
    body = _known(Span, data)
    for key, model in (
        ("status", SpanStatus),
        ("context", SpanContext),
        ("parent", SpanContext),
        ("resource", OtelResource),
    ):
        if key in body:
            body[key] = _known(model, body[key])
    if isinstance(body.get("events"), list):
        body["events"] = [_known(SpanEvent, event) for event in body["events"]]
    if isinstance(body.get("links"), list):
        body["links"] = [_link(link) for link in body["links"]]
    if "kind" in body:
        body["kind"] = _kind(body["kind"])
    span = Span.model_validate(body)
    if span.sequence_id < 0:
        message = f"sequence_id must be 0 or more, not {span.sequence_id}"
        detail = [{"type": "out_of_range", "loc": ["body", "sequence_id"], "msg": message}]
        raise Refusal(422, "invalid_request", f"the request is not what this route takes: {message}", detail)
    return span


_LIST_PARAMETERS = frozenset({"status_in", "rollout_id_in"})
"""Query parameters given once per value (``?status_in=failed&status_in=cancelled``)."""


def query_values(params: QueryParams, shape: type[BaseModel]) -> dict[str, Any]:
    """The query parameters that are fields of ``shape``, lists where a field takes a list."""
    return {
        name: params.getlist(name) if name in _LIST_PARAMETERS else params[name]
        for name in shape.model_fields
        if name in params
    }


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
    fetch: Callable[[int, int], Awaitable[Sequence[BaseModel]]],
    count: Callable[[], Awaitable[int]],
    limit: int,
    offset: int,
) -> JSONResponse:
    """A page and its total: told by the page itself, or else counted (one COUNT query)."""
    items = await fetch(limit, offset)
    total = known_total(limit, offset, len(items))
    if total is None:
        total = await count()
    return FiniteJSONResponse(page_body(items, limit, offset, total))


def agl_router(store: StoreGetter, stopping: Callable[[], bool]) -> APIRouter:
    """The routes, on the store client ``store()`` returns (started on demand)."""
    router = APIRouter(prefix=PREFIX)

    async def answer(work: Callable[[], Awaitable[Response]]) -> Response:
        if stopping():
            return error_response(503, "stopping", "the gateway is shutting down", headers={"Retry-After": "2"})
        try:
            return await work()
        except Refusal as refusal:
            return refusal.response()
        except ValidationError as exc:  # a value the store's records refuse (checked after parsing)
            return validation_refusal(exc, "body").response()
        except CodecError as exc:  # a value the records' schema cannot hold: nothing was written
            return error_response(422, "invalid_request", f"a value cannot be stored: {exc}")
        except MessageSizeTooLargeError as exc:  # one record over the producer's limit: not sent
            return error_response(413, "too_large", f"a record is too large to store: {exc}; send smaller values")
        except QueueFullError as exc:  # back-pressure, not a mistake: 503, which the seed's client retries
            return error_response(503, "queue_full", str(exc), headers={"Retry-After": "5"})
        except ValueError as exc:  # the store's verdict (RejectedError included)
            status, kind = store_refusal(exc)
            return error_response(status, kind, str(exc))
        except (AglError, KafkaError) as exc:  # not up, the processor silent, the broker down
            return error_response(503, "unavailable", str(exc), headers={"Retry-After": "2"})
        except Exception as exc:
            log.exception("agl route failed", error=f"{type(exc).__name__}: {exc}")
            return error_response(500, "internal", f"the gateway failed this request ({type(exc).__name__})")

    def listing(
        path: str, shape: type[P], fetch: Listing[P], count: Counting[P], *, body_required: bool = False
    ) -> None:
        """One paged listing, served twice as the seed serves it: ``GET path`` with the query
        in the query string and ``POST path/search`` with it as a JSON body."""

        async def run(request: Request, query: P) -> Response:
            check_paging(query)
            client = await store()
            return await _paged(
                lambda limit, offset: fetch(client, query, request.path_params, limit, offset),
                lambda: count(client, query, request.path_params),
                query.limit,
                query.offset,
            )

        async def by_query(request: Request) -> Response:
            return await answer(lambda: run(request, _query(request, shape)))

        async def by_body(request: Request) -> Response:
            async def work() -> Response:
                return await run(request, await _body(request, shape, optional=not body_required))

            return await answer(work)

        router.add_api_route(path, by_query, methods=["GET"])
        router.add_api_route(f"{path}/search", by_body, methods=["POST"])

    # -- health and statistics --------------------------------------------------------------

    @router.get("/health")
    async def health() -> Response:
        if stopping():
            return JSONResponse({"status": "stopping"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @router.get("/statistics")
    async def statistics() -> Response:
        async def work() -> Response:
            return JSONResponse(dict(await (await store()).statistics()))

        return await answer(work)

    # -- the queue --------------------------------------------------------------------------

    @router.post("/queues/rollouts/enqueue")
    async def enqueue(request: Request) -> Response:
        async def work() -> Response:
            body = await _body(request, EnqueueBody)
            if len(body.rollouts) > MAX_ITEMS:
                raise Refusal(413, "too_large", f"{len(body.rollouts):,} rollouts in one request, over {MAX_ITEMS:,}")
            if not body.rollouts:
                return _json([], 201)
            return _json(await (await store()).enqueue_many_rollouts(body.rollouts), 201)

        return await answer(work)

    @router.post("/queues/rollouts/dequeue")
    async def dequeue(request: Request) -> Response:
        async def work() -> Response:
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

        return await answer(work)

    # -- rollouts ---------------------------------------------------------------------------

    @router.post("/rollouts")
    async def start_rollout(request: Request) -> Response:
        async def work() -> Response:
            body = await _body(request, StartRolloutBody)
            started = await (await store()).start_rollout(
                input=body.input,
                mode=body.mode,
                resources_id=body.resources_id,
                config=body.config,
                metadata=body.metadata,
                worker_id=body.worker_id,
            )
            return _json(started, 201)

        return await answer(work)

    listing(
        "/rollouts",
        RolloutsQuery,
        lambda client, query, _, limit, offset: client.query_rollouts(
            status_in=query.status_in,
            rollout_id_in=query.rollout_id_in,
            rollout_id_contains=query.rollout_id_contains,
            filter_logic=query.filter_logic,
            sort_by=query.sort_by,
            sort_order=query.sort_order,
            limit=limit,
            offset=offset,
        ),
        lambda client, query, _: client.count_rollouts(
            status_in=query.status_in,
            rollout_id_in=query.rollout_id_in,
            rollout_id_contains=query.rollout_id_contains,
            filter_logic=query.filter_logic,
        ),
    )

    @router.get("/rollouts/{rollout_id}")
    async def get_rollout(rollout_id: str) -> Response:
        async def work() -> Response:
            return _json(await (await store()).get_rollout_by_id(rollout_id))

        return await answer(work)

    @router.post("/rollouts/{rollout_id}")
    async def update_rollout(rollout_id: str, request: Request) -> Response:
        async def work() -> Response:
            changes = explicit_changes(await _body(request, RolloutChanges), ROLLOUT_NOT_NULL)
            return _json(await (await store()).update_rollout(rollout_id, **changes))

        return await answer(work)

    # -- attempts ---------------------------------------------------------------------------

    @router.post("/rollouts/{rollout_id}/attempts")
    async def start_attempt(rollout_id: str, request: Request) -> Response:
        async def work() -> Response:
            body = await _body(request, StartAttemptBody, optional=True)
            client = await store()
            started = await client.start_attempt(rollout_id, worker_id=body.worker_id)
            return _json(started, 201)

        return await answer(work)

    listing(
        "/rollouts/{rollout_id}/attempts",
        AttemptsQuery,
        lambda client, query, path, limit, offset: client.query_attempts(
            path["rollout_id"], sort_by=query.sort_by, sort_order=query.sort_order, limit=limit, offset=offset
        ),
        lambda client, _, path: client.count_attempts(path["rollout_id"]),
    )

    @router.get("/rollouts/{rollout_id}/attempts/latest")
    async def latest_attempt(rollout_id: str) -> Response:
        async def work() -> Response:
            return _json(await (await store()).get_latest_attempt(rollout_id))

        return await answer(work)

    @router.post("/rollouts/{rollout_id}/attempts/{attempt_id}")
    async def update_attempt(rollout_id: str, attempt_id: str, request: Request) -> Response:
        async def work() -> Response:
            changes = explicit_changes(await _body(request, AttemptChanges), ATTEMPT_NOT_NULL)
            return _json(await (await store()).update_attempt(rollout_id, attempt_id, **changes))

        return await answer(work)

    # -- workers ----------------------------------------------------------------------------

    listing(
        "/workers",
        WorkersQuery,
        lambda client, query, _, limit, offset: client.query_workers(
            status_in=query.status_in,
            worker_id_contains=query.worker_id_contains,
            filter_logic=query.filter_logic,
            sort_by=query.sort_by,
            sort_order=query.sort_order,
            limit=limit,
            offset=offset,
        ),
        lambda client, query, _: client.count_workers(
            status_in=query.status_in, worker_id_contains=query.worker_id_contains, filter_logic=query.filter_logic
        ),
    )

    @router.get("/workers/{worker_id}")
    async def get_worker(worker_id: str) -> Response:
        async def work() -> Response:
            return _json(await (await store()).get_worker_by_id(worker_id))

        return await answer(work)

    @router.post("/workers/{worker_id}")
    async def update_worker(worker_id: str, request: Request) -> Response:
        async def work() -> Response:
            changes = explicit_changes(await _body(request, WorkerChanges, optional=True), WORKER_NOT_NULL)
            return _json(await (await store()).update_worker(worker_id, **changes))

        return await answer(work)

    # -- resources --------------------------------------------------------------------------

    async def _named_resources(request: Request) -> dict[str, Any]:
        try:
            return dict(NAMED_RESOURCES.validate_python(await _json_body(request)))
        except ValidationError as exc:
            raise validation_refusal(exc, "body") from exc

    @router.get("/resources")
    async def query_resources(request: Request) -> Response:
        async def work() -> Response:
            query = _query(request, ResourcesQuery)
            check_paging(query)
            client = await store()

            async def fetch(limit: int, offset: int) -> Sequence[BaseModel]:
                return await client.query_resources(
                    resources_id=query.resources_id,
                    resources_id_contains=query.resources_id_contains,
                    sort_by=query.sort_by,
                    sort_order=query.sort_order,
                    limit=limit,
                    offset=offset,
                )

            async def count() -> int:
                return await client.count_resources(
                    resources_id=query.resources_id, resources_id_contains=query.resources_id_contains
                )

            return await _paged(fetch, count, query.limit, query.offset)

        return await answer(work)

    @router.post("/resources")
    async def add_resources(request: Request) -> Response:
        async def work() -> Response:
            resources = await _named_resources(request)
            return _json(await (await store()).add_resources(resources), 201)

        return await answer(work)

    @router.get("/resources/latest")
    async def latest_resources() -> Response:
        async def work() -> Response:
            return _json(await (await store()).get_latest_resources())

        return await answer(work)

    @router.get("/resources/{resources_id}")
    async def get_resources(resources_id: str) -> Response:
        async def work() -> Response:
            return _json(await (await store()).get_resources_by_id(resources_id))

        return await answer(work)

    @router.post("/resources/{resources_id}")
    async def update_resources(resources_id: str, request: Request) -> Response:
        async def work() -> Response:
            resources = await _named_resources(request)
            return _json(await (await store()).update_resources(resources_id, resources))

        return await answer(work)

    # -- spans ------------------------------------------------------------------------------

    @router.post("/spans")
    async def add_span(request: Request) -> Response:
        async def work() -> Response:
            parsed = await _json_body(request)
            try:
                span = span_from_wire(parsed)
            except ValidationError as exc:
                raise validation_refusal(exc, "body") from exc
            return _json(await (await store()).add_span(span), 201)

        return await answer(work)

    listing(
        "/spans",
        SpansQuery,
        lambda client, query, _, limit, offset: client.query_spans(
            query.rollout_id, query.attempt_id, **{**query.filters(), "limit": limit, "offset": offset}
        ),
        lambda client, query, _: client.count_spans(query.rollout_id, query.attempt_id, **query.filters()),
        body_required=True,
    )

    @router.post("/spans/next")
    async def next_sequence_id(request: Request) -> Response:
        async def work() -> Response:
            body = await _body(request, SequenceBody)
            sequence_id = await (await store()).get_next_span_sequence_id(body.rollout_id, body.attempt_id)
            return JSONResponse({"sequence_id": sequence_id})

        return await answer(work)

    # -- waits ------------------------------------------------------------------------------

    @router.post("/waits/rollouts")
    async def wait_for_rollouts(request: Request) -> Response:
        async def work() -> Response:
            body = await _body(request, WaitBody)
            if len(body.rollout_ids) > MAX_ITEMS:
                raise Refusal(
                    413, "too_large", f"{len(body.rollout_ids):,} rollout ids in one wait, over {MAX_ITEMS:,}"
                )
            timeout = MAX_WAIT_SECONDS if body.timeout is None else min(body.timeout, MAX_WAIT_SECONDS)
            client = await store()
            # A wait per batch of ids, each started after the loop served whatever else was
            # waiting: the ids the client has not heard of are watched (a store request each)
            # a batch at a time instead of all in one stretch of the loop.
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

        return await answer(work)

    return router
