"""The dashboard: a static page (``/dashboard/``) and the JSON endpoints it reads (``/v1/dashboard/...``).

The page is plain HTML and ES modules (consumers/dashboard_static/, vendored uPlot for charts):
nothing to build. Its data comes from fixed, parameterised SQL (consumers/dashboard_sql.py) run
on the gateway's read-only query clients, the ones ``POST /v1/query`` uses: the same
``readonly=1``, limits and analytics policy (functions, agl tables only); its SQL console posts
to ``/v1/sql`` like any other client. Errors are the gateway's typed JSON (``{"error",
"message"}``), which the page shows as text.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Protocol, TypeVar, get_args

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError
from clickhouse_connect.driver.exceptions import DatabaseError
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response
from pydantic import BaseModel, ValidationError

from agl_stream.config import Settings
from agl_stream.errors import QueryError
from agl_stream.http_serving import Refusal, answering, error_json, refuse_while_stopping
from agl_stream.kafka.admin import admin_client
from agl_stream.resources import resource_path
from consumers import dashboard_sql as dsql
from consumers.gateway_sql import SqlRefusedError
from consumers.sink_specs import Lane, sinks_group_id

STATIC = Path(__file__).resolve().parent / "dashboard_static"
DASHBOARD_PAGES = "/dashboard"
"""Where the page and its static files live: no data there, so a listener that requires its
token serves them without one (the page sends the token on its API requests)."""
_MEDIA = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".txt": "text/plain"}
# The page loads nothing from elsewhere and runs no inline script: a span's text that smuggles
# markup in is inert even if some value escaped escaping.
_CSP = "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; object-src 'none'"


class Runs(Protocol):
    """The gateway's read-only query pool (consumers.gateway.QueryRunner)."""

    async def run(self, sql: str, parameters: Mapping[str, Any], *, checked: bool = True) -> bytes: ...


class DashboardQueries:
    """Runs the dashboard's statements and shapes their answers."""

    def __init__(self, runner: Runs, database: str) -> None:
        self.runner = runner
        self.database = database

    async def rows(self, query: dsql.Query, *, checked: bool = True) -> list[dict[str, Any]]:
        body = json.loads(await self.runner.run(query.sql, query.parameters, checked=checked))
        return dsql.records(body["columns"], body["rows"])

    async def many(self, queries: Mapping[str, dsql.Query]) -> dict[str, list[dict[str, Any]]]:
        # In parallel: the pool has several clients, and the overview is seven small reads.
        names = list(queries)
        answers = await asyncio.gather(*(self.rows(queries[n]) for n in names))
        return dict(zip(names, answers, strict=True))

    async def overview(self, window: int) -> dict[str, Any]:
        got = await self.many(dsql.overview(self.database, window))
        totals = got["totals"][0] if got["totals"] else {}
        steps = list(reversed(got["steps"]))  # oldest first, for the charts
        return {
            "window": window,
            "bucket_s": dsql.bucket_seconds(window),
            "status": {r["status"]: r["n"] for r in got["status"]},
            "rates": {
                name: dsql.series([(r["t"], r["n"]) for r in got[name]], window)
                for name in ("rollouts", "spans", "triplets")
            },
            "totals": totals,
            "policy_version": _first_not_none(totals.get("trained_version"), totals.get("rollout_version")),
            "rewards": got["rewards"],
            "steps": steps,
        }

    async def rollouts(self, f: dsql.RolloutFilter) -> dict[str, Any]:
        page, count = dsql.rollouts_page(self.database, f)
        rows, total = await asyncio.gather(self.rows(page), self.rows(count))
        return {
            "rows": rows,
            "total": total[0]["n"] if total else 0,
            "limit": f.limit,
            "offset": f.offset,
            "sort": f.sort,
            "order": f.order,
        }

    async def rollout(self, rollout_id: str) -> dict[str, Any] | None:
        got = await self.many(dsql.rollout_detail(self.database, rollout_id))
        if not got["rollout"]:
            return None
        return {"rollout": got["rollout"][0], "attempts": got["attempts"], "triplets": got["triplets"]}

    async def spans(self, rollout_id: str, attempt_id: str) -> dict[str, Any]:
        rows = await self.rows(dsql.attempt_spans(self.database, rollout_id, attempt_id))
        cut = len(rows) > dsql.MAX_SPANS
        rows = rows[: dsql.MAX_SPANS]
        layout = dsql.waterfall(dsql.span_rows(rows))
        details = {
            str(r["SpanId"]): {
                "attributes": r["SpanAttributes"],
                "status_message": r["StatusMessage"],
                "events": [
                    {"name": n, "attributes": a}
                    for n, a in zip(r["event_names"] or [], r["event_attributes"] or [], strict=False)
                ],
            }
            for r in rows
        }
        return {"spans": [{**bar, **details[bar["span_id"]]} for bar in layout], "cut": cut}

    async def version(self, version: int) -> dict[str, Any] | None:
        got = await self.many(dsql.version_lineage(self.database, version))
        if not got["steps"]:
            return None
        lineage = got["lineage"]
        return {
            "policy_version": version,
            "steps": got["steps"],
            "batches": got["batches"],
            "attempts": got["attempts"],
            "spans": lineage[: dsql.MAX_LINEAGE],
            "cut": len(lineage) > dsql.MAX_LINEAGE,
            "query": dsql.trained_by_version(self.database),
        }

    async def dead_letters(self, f: dsql.DeadLetterFilter) -> dict[str, Any]:
        got = await self.many(dsql.dead_letters(self.database, f))
        return {"counts": got["counts"], "newest": got["newest"], "total": got["total"][0]["n"], "limit": f.limit}

    async def schema(self) -> dict[str, Any]:
        rows = await self.rows(dsql.schema(self.database), checked=False)
        tables = dsql.schema_tables((r["table"], r["name"], r["type"]) for r in rows)
        return {"database": self.database, "tables": tables}


class Backlog:
    """Queue depth per consumer: each consumer group of this stack (its topic prefix) by what it
    committed, and each of the gateway's sinks by what it applied to ClickHouse, against the
    topics' log-end offsets. Read from Kafka, at most once per ``ttl_s``: every open page polls."""

    def __init__(
        self,
        settings: Settings,
        applied: Callable[[], Mapping[str, Mapping[int, int]]],
        sinks: Mapping[str, str],
        *,
        ttl_s: float = 3.0,
    ) -> None:
        self.settings = settings
        self.applied = applied
        self.sinks = dict(sinks)  # sink name -> topic
        self.ttl_s = ttl_s
        self._cached: tuple[float, list[dict[str, Any]]] | None = None
        self._lock = asyncio.Lock()

    async def rows(self) -> list[dict[str, Any]]:
        async with self._lock:  # one Kafka read at a time, whoever asks
            if self._cached is not None and time.monotonic() - self._cached[0] < self.ttl_s:
                return self._cached[1]
            rows = await asyncio.wait_for(self._read(), 10)
            self._cached = (time.monotonic(), rows)
            return rows

    async def _read(self) -> list[dict[str, Any]]:
        prefix = f"{self.settings.topic_prefix}."
        committed: dict[str, dict[tuple[str, int], int]] = {}
        admin = admin_client(self.settings)
        await admin.start()
        try:
            # The gateway's own sinks are reported by what they applied to ClickHouse (where they
            # resume from), not by their groups' commits, which would list each of them twice;
            # nor by the per-sink groups they had before the lanes (left behind by an upgrade).
            own = {sinks_group_id(self.settings, lane) for lane in get_args(Lane)}
            own |= {f"{prefix}sink.{name}" for name in self.sinks}
            listed = await admin.list_consumer_groups()
            groups = sorted(str(g[0]) for g in listed if str(g[0]).startswith(prefix) and str(g[0]) not in own)
            for group in groups:
                offsets = await admin.list_consumer_group_offsets(group)
                committed[group] = {(tp.topic, tp.partition): m.offset for tp, m in offsets.items() if m.offset >= 0}
            applied = self.applied()
            for name, topic in self.sinks.items():
                committed[f"sink {name}"] = {(topic, p): o for p, o in applied.get(topic, {}).items()}
            topics = sorted({t for offsets in committed.values() for t, _ in offsets} | set(self.sinks.values()))
            existing = set(await admin.list_topics())
            described = await admin.describe_topics([t for t in topics if t in existing]) if topics else []
        finally:
            await admin.close()
        tps = [TopicPartition(d["topic"], p["partition"]) for d in described for p in d["partitions"]]
        consumer = AIOKafkaConsumer(**self.settings.kafka_client_options(), enable_auto_commit=False)
        await consumer.start()
        try:
            ends = await consumer.end_offsets(tps) if tps else {}
        finally:
            await consumer.stop()
        # A sink whose topic has no records yet has applied nothing: still a row (lag 0).
        for name, topic in self.sinks.items():
            if not committed[f"sink {name}"]:
                committed[f"sink {name}"] = {(topic, tp.partition): 0 for tp in tps if tp.topic == topic}
        return dsql.lag_rows(committed, {(tp.topic, tp.partition): int(end) for tp, end in ends.items()})


def _first_not_none(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _cookbook() -> list[dict[str, str]]:
    try:
        return dsql.cookbook(resource_path("docs/sql.md").read_text())
    except FileNotFoundError:
        return []


@dataclass(frozen=True)
class Dashboard:
    """What the dashboard's routes read (``app.state.dashboard``)."""

    queries: DashboardQueries
    backlog: Backlog | None
    cookbook: list[dict[str, str]]


def serve_dashboard(app: FastAPI, runner: Runs, database: str, backlog: Backlog | None = None) -> None:
    """Serve the page and its endpoints on ``app`` (whose ``state.stopping()`` says when it shuts
    down), from the query pool ``runner``."""
    app.state.dashboard = Dashboard(DashboardQueries(runner, database), backlog, _cookbook())
    app.include_router(pages)
    app.include_router(data)


def _query_errors(exc: Exception) -> Response | None:
    if isinstance(exc, ValidationError):
        parts = [f"{'.'.join(str(p) for p in e['loc']) or 'query'}: {e['msg']}" for e in exc.errors()]
        return error_json(400, "bad_request", "; ".join(parts))
    if isinstance(exc, SqlRefusedError):
        return error_json(403, exc.kind, str(exc))
    if isinstance(exc, (DatabaseError, QueryError)):
        text = str(exc).strip()
        return error_json(400, "query_error", text.splitlines()[0] if text else repr(exc))
    return None


def _board(request: Request) -> Dashboard:
    board: Dashboard = request.app.state.dashboard
    return board


Board = Annotated[Dashboard, Depends(_board)]
M = TypeVar("M", bound=BaseModel)


def _params(shape: type[M]) -> Any:
    """A dependency: the query string as ``shape`` (a 400 ``bad_request`` naming each mistake)."""

    def parse(request: Request) -> M:
        return shape.model_validate(dict(request.query_params))

    return Depends(parse)


def _found(result: dict[str, Any] | None, missing: str = "no such rollout") -> Response:
    if result is None:
        raise Refusal(404, "not_found", missing)
    return JSONResponse(result)


pages = APIRouter(include_in_schema=False)
data = APIRouter(route_class=answering(_query_errors), dependencies=[Depends(refuse_while_stopping)])


@pages.get("/dashboard")
async def page_redirect() -> Response:
    return RedirectResponse("/dashboard/")


@pages.get("/dashboard/")
async def page() -> Response:
    return _static("index.html")


@pages.get("/dashboard/static/{name:path}")
async def static(name: str) -> Response:
    return _static(name)


@data.get("/v1/dashboard/overview")
async def overview(params: Annotated[dsql.OverviewParams, _params(dsql.OverviewParams)], board: Board) -> Response:
    return JSONResponse(await board.queries.overview(params.window))


@data.get("/v1/dashboard/rollouts")
async def rollouts(f: Annotated[dsql.RolloutFilter, _params(dsql.RolloutFilter)], board: Board) -> Response:
    return JSONResponse(await board.queries.rollouts(f))


@data.get("/v1/dashboard/rollouts/{rollout_id}")
async def rollout(rollout_id: str, board: Board) -> Response:
    return _found(await board.queries.rollout(rollout_id))


@data.get("/v1/dashboard/rollouts/{rollout_id}/attempts/{attempt_id}/spans")
async def spans(rollout_id: str, attempt_id: str, board: Board) -> Response:
    return JSONResponse(await board.queries.spans(rollout_id, attempt_id))


@data.get("/v1/dashboard/versions/{version}")
async def version(version: str, board: Board) -> Response:
    number = dsql.VersionParams.model_validate({"version": version}).version
    return _found(
        await board.queries.version(number),
        f"no trainer step made policy version {number} (version 0 is the starting model)",
    )


@data.get("/v1/dashboard/resources")
async def resources(board: Board) -> Response:
    return JSONResponse(await board.queries.rows(dsql.resources(board.queries.database)))


@data.get("/v1/dashboard/workers")
async def workers(params: Annotated[dsql.WorkersParams, _params(dsql.WorkersParams)], board: Board) -> Response:
    return JSONResponse(await board.queries.rows(dsql.workers(board.queries.database, params.gone_after_s)))


@data.get("/v1/dashboard/dead-letters")
async def dead_letters(f: Annotated[dsql.DeadLetterFilter, _params(dsql.DeadLetterFilter)], board: Board) -> Response:
    return JSONResponse(await board.queries.dead_letters(f))


@data.get("/v1/dashboard/schema")
async def schema(board: Board) -> Response:
    return JSONResponse(await board.queries.schema())


@data.get("/v1/dashboard/backlog")
async def backlog_rows(board: Board) -> Response:
    if board.backlog is None:
        raise Refusal(404, "not_found", "this gateway reads no Kafka backlog")
    try:
        return JSONResponse(await board.backlog.rows())
    except (KafkaError, OSError, asyncio.TimeoutError) as exc:
        raise Refusal(503, "kafka_unavailable", f"the backlog could not be read from Kafka: {exc!r}") from exc


@data.get("/v1/dashboard/cookbook")
async def cookbook_queries(board: Board) -> Response:
    return JSONResponse(board.cookbook)


def _static(name: str) -> Response:
    path = (STATIC / name).resolve()
    # Only files inside the static folder: `..` and absolute names end up outside and are 404.
    if not path.is_file() or STATIC not in path.parents:
        return error_json(404, "not_found", f"no dashboard file {name!r}")
    media = _MEDIA.get(path.suffix, "application/octet-stream")
    headers = {"content-security-policy": _CSP, "x-content-type-options": "nosniff", "cache-control": "no-cache"}
    return FileResponse(path, media_type=media, headers=headers)
