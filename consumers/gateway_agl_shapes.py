"""``/v1/agl``'s functional core: the seed's request shapes (field names and defaults), and the
pure mapping between them, the store's records and the answers (refusals, pages, spans from the
seed's wire form). No I/O; the routes are consumers/gateway_agl.py.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from starlette.datastructures import QueryParams

from agl_stream import http_serving
from agl_stream.models import Span
from agl_stream.models.base import AttemptStatus, EpochSeconds, RolloutMode, RolloutStatus, WorkerStatus
from agl_stream.models.resources import Resource
from agl_stream.models.rollouts import RolloutConfig
from agl_stream.models.spans import OtelResource, SpanContext, SpanEvent, SpanLink, SpanStatus
from agl_stream.store.types import EnqueueRolloutRequest

MAX_INT64 = 2**63 - 1
"""The largest integer the store's records and ClickHouse's columns hold (Avro long, Int64)."""
# -- request shapes (the seed's field names and defaults) ---------------------------------------


class _Shape(BaseModel):
    model_config = ConfigDict(extra="ignore")  # as the seed's request models: unknown keys pass


class _Paging(_Shape):
    limit: int = -1
    offset: int = 0
    sort_by: str | None = None
    sort_order: Literal["asc", "desc"] = "asc"

    def where(self) -> dict[str, Any]:
        """The filters, as the store's ``count_*`` take them (its ``query_*`` take every field)."""
        return self.model_dump(exclude={"limit", "offset", "sort_by", "sort_order"})


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


class Refusal(http_serving.Refusal):
    """A request answered with an error before (or instead of) reaching the store, with the
    seed's ``detail`` (the message, or a JSON value)."""

    def __init__(self, status: int, kind: str, message: str, detail: Any = None) -> None:
        self.detail: Any = message if detail is None else detail
        super().__init__(status, kind, message, detail=self.detail)


def error_response(
    status: int, kind: str, message: str, detail: Any = None, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    """The gateway's error shape plus the seed's ``detail``."""
    return http_serving.error_json(status, kind, message, headers=headers, detail=message if detail is None else detail)


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
