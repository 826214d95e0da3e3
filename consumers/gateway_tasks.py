"""``POST /v1/tasks`` on the gateway: task requests over HTTP, onto agl.task-requests.

The body is one request or a JSON array of them, each a JSON object with TaskRequest's fields
(``input`` and ``metadata`` as JSON values; ``request_id`` optional: a random UUID when absent,
which a retry then does not deduplicate). Every item is checked with the ingress processor's own
rules (agl_stream/domain/ingress.py) before anything is sent:

- any item invalid: 422 ``{"error": "invalid_task_requests", "message", "items": [{"index",
  "request_id", "error", "reason"}]}``, and nothing is sent (a request id repeated inside one
  body is such an item, ``DuplicateRequestError``);
- then the gateway's own ClickHouse is asked what the items' rollouts hold, and each item is
  classified as the ingress would (``classify``): any item whose rollout holds a different
  request (its request id used before with another input, or a rollout id collision): 409
  ``{"error": "conflicting_task_requests", ...}`` with the same items list
  (``RequestConflictError``), and nothing is sent;
- otherwise the new ones are produced to agl.task-requests keyed by their request ids and, once
  the broker acknowledged all of them, 202 ``{"accepted": [{"request_id", "rollout_id",
  "outcome"}]}``, ``outcome`` being ``queued`` (sent) or ``already_enqueued`` (a copy of a
  request whose rollout exists: not sent, nothing changes). The ``rollout_id`` is the derived
  one (``ro-`` + 32 hex), or the legacy ``ro-`` + 12 hex one of a request enqueued before
  128-bit ids.

202 ``queued`` means "queued for the ingress processor", which then enqueues the rollout; what
ClickHouse did not hold yet (a copy sent moments after the first) the ingress answers itself
(counted, no dead letter), and an unknown ``resources_id`` or a conflict it meets first is
refused there on agl.dlq. When ClickHouse cannot be asked, every valid item is sent.
400 for a body that is not JSON, 413 over the size limits, 503 (``Retry-After``) while the
gateway's producer is not up or the broker does not answer.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Annotated, Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from agl_stream import metrics
from agl_stream.background import BackgroundClient
from agl_stream.config import Settings
from agl_stream.domain.ingress import (
    HeldRequest,
    IngressLimits,
    TaskRequestError,
    classify,
    held_from_rows,
    request_from_json,
    rollout_id_for,
    stored_for,
    stored_rollouts_query,
)
from agl_stream.http_serving import (
    MAX_BODY_BYTES,
    BodyTooLargeError,
    MalformedBodyError,
    Refusal,
    answering,
    parse_json,
    read_body,
    refuse_while_stopping,
)
from agl_stream.kafka.io import make_producer
from agl_stream.logs import describe, get_logger
from agl_stream.models import TaskRequest
from agl_stream.wire.codec import Codec

log = get_logger("agl.gateway.tasks")

LOOKUP_TIMEOUT_S = 10.0
"""How long a POST waits for ClickHouse's answer about its rollouts before sending unchecked."""
QUEUED = "queued"
ALREADY = "already_enqueued"

MAX_ITEMS = 10_000

Query = Callable[[str, Mapping[str, Any]], Awaitable[bytes]]
"""The gateway's read-only query runner: SQL and parameters -> ``{"columns", "rows"}`` as JSON."""


class TasksUnavailableError(Refusal):
    """The gateway cannot produce right now (starting, stopping, broker unreachable): 503, retry."""

    def __init__(self, message: str) -> None:
        super().__init__(503, "unavailable", message, headers={"Retry-After": "2"})


class TaskSubmitter:
    """The gateway's producer to agl.task-requests; started with the gateway, in the background
    (a broker that is down must not stop the gateway from serving reads), closed with it."""

    def __init__(self, settings: Settings, codec: Codec | None = None, *, query: Query | None = None) -> None:
        self.settings = settings
        self._query = query
        self.codec = codec or Codec.default()
        self.limits = IngressLimits.of(settings)
        self.topic = settings.topic("task-requests")
        self._client = BackgroundClient[AIOKafkaProducer](
            "task producer", self._open, _stop_producer, TasksUnavailableError
        )

    def start(self) -> None:
        self._client.start()

    async def _open(self) -> AIOKafkaProducer:
        producer = make_producer(self.settings)
        try:
            await producer.start()
        except Exception as error:
            log.warning("the task producer did not start", error=describe(error))
            await producer.stop()
            raise
        return producer

    async def producer(self) -> AIOKafkaProducer:
        return await self._client.get("the gateway cannot reach Kafka")

    async def close(self) -> None:
        await self._client.close()

    async def stored(self, requests: list[TaskRequest]) -> dict[str, HeldRequest]:
        """What ClickHouse says the rollouts of these requests hold (empty when it cannot be
        asked: the ingress then answers the copies itself)."""
        if self._query is None or not requests:
            return {}
        sql, parameters = stored_rollouts_query(self.settings.clickhouse_database, [r.request_id for r in requests])
        try:
            body = json.loads(await asyncio.wait_for(self._query(sql, parameters), LOOKUP_TIMEOUT_S))
        except Exception as error:  # any failure of the look-up: the ingress still classifies
            log.warning("could not ask ClickHouse what task rollouts hold", error=describe(error))
            return {}
        return held_from_rows(body["rows"])

    async def submit(self, requests: list[TaskRequest]) -> None:
        """Produce every request and wait until the broker acknowledged all of them."""
        producer = await self.producer()
        try:
            futures = [
                await producer.send(self.topic, self.codec.encode(r), key=r.request_id.encode("utf-8"))
                for r in requests
            ]
            for future in futures:
                await future
            metrics.count_out(self.topic, len(futures))
        except KafkaError as error:
            # Resending is safe: the ingress enqueues a request id once.
            raise TasksUnavailableError(f"producing to {self.topic} failed: {type(error).__name__}: {error}") from error


def check_items(body: Any, limits: IngressLimits) -> tuple[list[TaskRequest], list[dict[str, Any]]]:
    """The requests of a body (one object or a list), and a reason per invalid item."""
    items = body if isinstance(body, list) else [body]
    requests: list[TaskRequest] = []
    problems: list[dict[str, Any]] = []
    first_index: dict[str, int] = {}
    for index, item in enumerate(items):
        given = item.get("request_id") if isinstance(item, dict) else None
        try:
            request = request_from_json(item, limits, default_request_id=str(uuid.uuid4()))
        except TaskRequestError as error:
            shown = given if isinstance(given, str) else None
            problems.append({"index": index, "request_id": shown, "error": type(error).__name__, "reason": str(error)})
            continue
        if request.request_id in first_index:
            problems.append(
                {
                    "index": index,
                    "request_id": request.request_id,
                    "error": "DuplicateRequestError",
                    "reason": f"request_id {request.request_id!r} is also item {first_index[request.request_id]}",
                }
            )
            continue
        first_index[request.request_id] = index
        requests.append(request)
    return requests, problems


def _submitter(request: Request) -> TaskSubmitter:
    submitter: TaskSubmitter = request.app.state.tasks
    return submitter


router = APIRouter(route_class=answering(), dependencies=[Depends(refuse_while_stopping)])
"""``POST /v1/tasks`` on an app whose ``state.tasks`` is the gateway's TaskSubmitter."""


@router.post("/v1/tasks", status_code=202)
async def post_tasks(request: Request, submitter: Annotated[TaskSubmitter, Depends(_submitter)]) -> JSONResponse:
    try:
        parsed = parse_json(await read_body(request, MAX_BODY_BYTES, "send fewer tasks per request"))
    except BodyTooLargeError as exc:
        raise Refusal(413, "too_large", str(exc)) from exc
    except MalformedBodyError as exc:
        raise Refusal(400, "malformed_json", str(exc)) from exc
    if isinstance(parsed, list) and not parsed:
        raise Refusal(422, "invalid_task_requests", "the list of tasks is empty", items=[])
    if isinstance(parsed, list) and len(parsed) > MAX_ITEMS:
        raise Refusal(413, "too_large", f"{len(parsed):,} tasks in one request, over the limit of {MAX_ITEMS:,}")
    requests, problems = check_items(parsed, submitter.limits)
    if problems:
        raise Refusal(
            422,
            "invalid_task_requests",
            f"{len(problems)} of {len(requests) + len(problems)} task requests are invalid; nothing was sent",
            items=problems,
        )
    await submitter.producer()  # nothing can be sent: 503 at once, before asking ClickHouse
    stored = await submitter.stored(requests)
    accepted: list[dict[str, Any]] = []
    conflicts: list[dict[str, Any]] = []
    new: list[TaskRequest] = []
    for index, item in enumerate(requests):
        try:
            answer = classify(item, stored_for(stored, item.request_id))
        except TaskRequestError as error:
            conflicts.append(
                {"index": index, "request_id": item.request_id, "error": type(error).__name__, "reason": str(error)}
            )
            continue
        if answer is not None:
            accepted.append({"request_id": item.request_id, "rollout_id": answer.rollout_id, "outcome": ALREADY})
        else:
            new.append(item)
            accepted.append(
                {"request_id": item.request_id, "rollout_id": rollout_id_for(item.request_id), "outcome": QUEUED}
            )
    if conflicts:
        raise Refusal(
            409,
            "conflicting_task_requests",
            f"{len(conflicts)} of {len(requests)} task requests name rollouts that hold other requests; "
            "nothing was sent",
            items=conflicts,
        )
    if new:
        await submitter.submit(new)
    return JSONResponse({"accepted": accepted}, status_code=202)


async def _stop_producer(producer: AIOKafkaProducer) -> None:
    await producer.stop()
