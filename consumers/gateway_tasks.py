"""``POST /v1/tasks`` on the gateway: task requests over HTTP, onto agl.task-requests.

The body is one request or a JSON array of them, each a JSON object with TaskRequest's fields
(``input`` and ``metadata`` as JSON values; ``request_id`` optional: a random UUID when absent,
which a retry then does not deduplicate). Every item is checked with the ingress processor's own
rules (agl_stream/domain/ingress.py) before anything is sent:

- any item invalid: 422 ``{"error": "invalid_task_requests", "message", "items": [{"index",
  "request_id", "error", "reason"}]}``, and nothing is sent;
- all valid: each is produced to agl.task-requests keyed by its request id and, once the broker
  acknowledged all of them, 202 ``{"accepted": [{"request_id", "rollout_id"}]}``.

202 means "queued for the ingress processor", which then enqueues the rollout, answers a copy
of a request already enqueued as "already enqueued" (counted in its metrics, no dead letter), or
refuses it on agl.dlq: an unknown ``resources_id``, or a request whose rollout holds a different
request (its request id reused with another input, a rollout id collision:
``RequestConflictError``), is only known there. The ``rollout_id`` of the answer is the derived
one (``ro-`` + 32 hex, agl_stream.domain.ingress.rollout_id_for). A request id repeated inside
one body is refused here (``DuplicateRequestError`` item).
400 for a body that is not JSON, 413 over the size limits, 503 (``Retry-After``) while the
gateway's producer is not up or the broker does not answer.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from agl_stream import metrics
from agl_stream.background import BackgroundClient
from agl_stream.codec import Codec
from agl_stream.config import Settings
from agl_stream.domain.ingress import IngressLimits, TaskRequestError, request_from_json, rollout_id_for
from agl_stream.errors import AglError
from agl_stream.http_serving import MAX_BODY_BYTES, BodyTooLargeError, MalformedBodyError, parse_json, read_body
from agl_stream.kafka.io import make_producer
from agl_stream.logs import get_logger
from agl_stream.models import TaskRequest

log = get_logger("agl.gateway.tasks")

MAX_ITEMS = 10_000


class TasksUnavailableError(AglError):
    """The gateway cannot produce right now (starting, stopping, broker unreachable): retry."""


class TaskSubmitter:
    """The gateway's producer to agl.task-requests; started with the gateway, in the background
    (a broker that is down must not stop the gateway from serving reads), closed with it."""

    def __init__(self, settings: Settings, codec: Codec | None = None) -> None:
        self.settings = settings
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
            log.warning("the task producer did not start", error=f"{type(error).__name__}: {error}")
            await producer.stop()
            raise
        return producer

    async def producer(self) -> AIOKafkaProducer:
        return await self._client.get("the gateway cannot reach Kafka")

    async def close(self) -> None:
        await self._client.close()

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


def _error(status: int, kind: str, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": kind, "message": message, **extra}, status_code=status)


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


def tasks_router(submitter: TaskSubmitter, stopping: Callable[[], bool]) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/tasks", status_code=202)
    async def post_tasks(request: Request) -> JSONResponse:
        if stopping():
            return _error(503, "stopping", "the gateway is shutting down")
        try:
            parsed = parse_json(await read_body(request, MAX_BODY_BYTES, "send fewer tasks per request"))
        except BodyTooLargeError as exc:
            return _error(413, "too_large", str(exc))
        except MalformedBodyError as exc:
            return _error(400, "malformed_json", str(exc))
        if isinstance(parsed, list) and not parsed:
            return _error(422, "invalid_task_requests", "the list of tasks is empty", items=[])
        if isinstance(parsed, list) and len(parsed) > MAX_ITEMS:
            return _error(413, "too_large", f"{len(parsed):,} tasks in one request, over the limit of {MAX_ITEMS:,}")
        requests, problems = check_items(parsed, submitter.limits)
        if problems:
            return _error(
                422,
                "invalid_task_requests",
                f"{len(problems)} of {len(requests) + len(problems)} task requests are invalid; nothing was sent",
                items=problems,
            )
        try:
            await submitter.submit(requests)
        except TasksUnavailableError as exc:
            response = _error(503, "unavailable", str(exc))
            response.headers["Retry-After"] = "2"
            return response
        accepted = [{"request_id": r.request_id, "rollout_id": rollout_id_for(r.request_id)} for r in requests]
        return JSONResponse({"accepted": accepted}, status_code=202)

    return router


async def _stop_producer(producer: AIOKafkaProducer) -> None:
    await producer.stop()
