"""The gateway: the one process that owns the ClickHouse engine, runs every sink and serves reads.

chDB allows one process per data dir, so the sinks (writers) and the query API (readers) live
here together: the sinks (consumers/clickhouse_sink.py, a client each) run on an event loop of
their own in a thread of their own (``SinkThread``), and a FastAPI app under uvicorn on the main
loop, so a slow request delays no sink and a sink's batch delays no request. Queries run on a
small pool of clients of their own, in threads, so they run in parallel with each other and with
the sinks' INSERTs.

HTTP API (JSON):
- ``GET /v1/health``: liveness and the sinks it runs.
- ``GET /v1/offsets``: per sink, its topic and the next offset it has applied per partition.
- ``POST /v1/query`` ``{"sql", "parameters", "fence", "timeout"}``: waits until the sinks have
  applied the fence (see agl_stream/store/readside.py for the convention), woken by the sinks
  themselves after each batch (no polling), then runs the query read-only and answers
  ``{"columns": [...], "rows": [[...]]}``. 504 ``fence_timeout`` when the fence does not hold
  within ``timeout`` seconds; 400 ``query_error`` with ClickHouse's message (and code/name) when
  the engine refuses or fails the query; 400 ``unknown_topic`` for a fence on a topic no sink
  reads; 503 while shutting down.
- ``GET/POST /v1/sql``: read-only SQL analytics with limits, as JSON, CSV or a text table
  (consumers/gateway_sql.py; system tables refused by the engine's own analysis).
- ``POST /v1/traces``: an OTLP/HTTP trace receiver (protobuf or JSON, optionally gzip). Spans
  tagged with ``agentlightning.rollout_id``/``agentlightning.attempt_id`` are written to agl.spans
  through the gateway's own store client (semantics in agl_stream/trace_ingest.py, shared with
  the Kafka consumer of consumers/otlp_kafka.py; decoding is agl_stream/wire/otlp.py).
- ``/dashboard/`` and ``/v1/dashboard/...``: the web dashboard and the fixed read-only queries
  it runs on the query clients below (consumers/dashboard.py).
- ``/v1/agl/...``: Agent Lightning's store REST API (the seed's ``LightningStoreClient`` works
  against it), mapped onto that same store client (consumers/gateway_agl.py).

Read-only is the engine's doing, not ours: query clients run with the ClickHouse setting
``readonly=1`` (``readonly=2`` on a server, where per-request settings must pass), which refuses
writes, DDL, SET and table functions such as file(). ``readonly=1`` also freezes every other
setting, so the query time limit (``max_execution_time``) is fixed per gateway.

On start it records ``{"url", "pid"}`` in ``run_dir/gateway.json`` for clients
(agl_stream.store.readside.read_side_for); SIGTERM/SIGINT stop the HTTP server and the sinks
(each writes and commits the batch it holds) and remove the file.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Any, TypeVar

from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import DatabaseError
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field, ValidationError

from agl_stream import metrics
from agl_stream.auth import listener_token
from agl_stream.clickhouse.access import QUERY_RESULT_BYTES_FACTOR
from agl_stream.clickhouse.client import get_client
from agl_stream.clickhouse.migrations import migrate
from agl_stream.config import Settings
from agl_stream.errors import ConfigError, FenceTimeoutError, GatewayUnavailableError, QueryError, ReadSideError
from agl_stream.http_serving import (
    MAX_BODY_BYTES,
    BodyTooLargeError,
    QuietServer,
    Refusal,
    allowed_hosts,
    answering,
    error_json,
    guard,
    listen,
    read_body,
    server_config,
)
from agl_stream.local.processes import stop_on_signals
from agl_stream.logs import get_logger
from agl_stream.store.readside import DEFAULT_TIMEOUT, GATEWAY_FILE, Fence, QueryResult, fence_behind
from agl_stream.trace_ingest import TraceIngest, TracesUnavailableError, TracesWriteError
from agl_stream.wire import otlp
from consumers.clickhouse_sink import SinkGroup, SinkThread
from consumers.dashboard import DASHBOARD_PAGES, Backlog, serve_dashboard
from consumers.gateway_agl import serve_agl
from consumers.gateway_sql import (
    FunctionPolicy,
    SqlLimits,
    SqlRefusedError,
    SqlRunner,
    ast_refusal,
    jsonable,
    load_function_policy,
    within,
)
from consumers.gateway_sql import router as sql_router
from consumers.gateway_tasks import TaskSubmitter
from consumers.gateway_tasks import router as tasks_router
from consumers.sink_specs import SPECS, SinkSpec

log = get_logger("agl.gateway")


_IDENTIFIER_PARAMETER = re.compile(r"\{(\w+)\s*:\s*Identifier\s*\}")
_FIRST_TABLE = re.compile(r"\bFROM\s+(?:[A-Za-z_][A-Za-z0-9_]*\.)?([A-Za-z_][A-Za-z0-9_]*)", re.IGNORECASE)
_UNCHECKED: Any = object()
T = TypeVar("T")

_VERDICTS = 4096
"""Policy verdicts remembered (distinct query texts; the store's own are a few dozen)."""


class GatewayClosingError(Exception):
    """The gateway is shutting down; fences will not be waited for any more."""


class UnknownTopicError(ReadSideError):
    """A fence names a topic none of this gateway's sinks reads."""


class AppliedOffsets:
    """What the sinks have applied (next offset per topic and partition), and waiting on it.

    :meth:`update` is called in this event loop after each batch of the sinks; every waiter
    wakes and re-checks its own fence. Waking is an Event swapped on each update, so a waiter
    never misses one that lands between its check and its wait. :meth:`wanted` may be called
    from the sinks' thread (a counter read); ``on_wait`` is called when a reader starts waiting
    (the sinks' wake-up, safe from this thread).
    """

    def __init__(self, on_wait: Callable[[], None] | None = None) -> None:
        self._next: dict[str, dict[int, int]] = {}
        self._changed = asyncio.Event()
        self._closed = False
        self._waiting: Counter[str] = Counter()  # topic -> readers waiting for its records
        self.on_wait = on_wait

    def wanted(self, topic: str) -> bool:
        """Whether a reader waits for records of ``topic``: its sink should flush without lingering."""
        return self._waiting[topic] > 0

    def update(self, topic: str, offsets: Mapping[int, int]) -> None:
        partitions = self._next.setdefault(topic, {})
        moved = False
        for partition, next_offset in offsets.items():
            if next_offset > partitions.get(partition, 0):
                partitions[partition] = next_offset
                moved = True
        if moved:
            self._wake()

    def snapshot(self) -> dict[str, dict[int, int]]:
        return {topic: dict(partitions) for topic, partitions in self._next.items()}

    def close(self) -> None:
        self._closed = True
        self._wake()

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def wait(self, fence: Mapping[str, Mapping[int, int]], timeout: float) -> None:
        """Return once every fenced record is applied; FenceTimeoutError after ``timeout`` s."""
        started = time.monotonic()
        deadline = started + timeout
        behind = fence_behind(self._next, fence)
        if not behind:
            metrics.FENCE_WAIT_SECONDS.labels(metrics.role()).observe(0.0)
            return
        self._waiting.update(behind.keys())
        if self.on_wait is not None:
            self.on_wait()  # after the count: a sink woken by it sees this reader waiting
        try:
            await self._wait(fence, deadline, timeout)
        except FenceTimeoutError:
            metrics.FENCE_TIMEOUTS.labels(metrics.role()).inc()
            raise
        finally:
            self._waiting.subtract(behind.keys())
            metrics.FENCE_WAIT_SECONDS.labels(metrics.role()).observe(time.monotonic() - started)

    async def _wait(self, fence: Mapping[str, Mapping[int, int]], deadline: float, timeout: float) -> None:
        while fence_behind(self._next, fence):
            if self._closed:
                raise GatewayClosingError("the gateway is shutting down")
            changed = self._changed
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise FenceTimeoutError(
                    f"the sinks did not apply the fence within {timeout}s; still behind (applied next "
                    f"offsets): {fence_behind(self._next, fence)}"
                )
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass  # re-check once more, then report


class QueryRunner:
    """A pool of read-only engine clients, each used by one query at a time in its own thread."""

    def __init__(self, settings: Settings, *, size: int, time_limit_s: int) -> None:
        self.settings = settings
        self.size = size
        self.time_limit_s = time_limit_s
        self._idle: asyncio.Queue[Client] = asyncio.Queue()
        self._clients: list[Client] = []
        self._executor = ThreadPoolExecutor(max_workers=size, thread_name_prefix="agl-query")
        self._policy: FunctionPolicy | None = None
        # (sql, Identifier parameters) -> the analytics policy's refusal or None; plain dict ops
        # are atomic under the GIL, and two threads computing one verdict agree.
        self._verdicts: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[str, str] | None] = {}

    def open(self) -> None:
        for _ in range(self.size):
            client = self._read_only_client()
            self._clients.append(client)
            self._idle.put_nowait(client)

    def _read_only_client(self) -> Client:
        # The analytics limits, but no row cap: a store read is complete or an error. Its result
        # bytes have a larger cap (a listing of a very large store is paged).
        limits = {
            **SqlLimits.of(self.settings).checking(self.time_limit_s),
            "max_result_bytes": QUERY_RESULT_BYTES_FACTOR * self.settings.sql_max_result_bytes,
            "result_overflow_mode": "throw",
        }
        if self.settings.uses_embedded_clickhouse:
            # Not chDB's mode=ro: that opens the whole engine read-only, and the sinks share it.
            client = get_client(self.settings, **limits)
            client.set_client_setting("readonly", "1")
        else:
            client = get_client(self.settings, readonly=True, **limits)
        readonly = int(str(client.command("SELECT getSetting('readonly')")))
        if readonly == 0:
            client.close()
            raise ConfigError("the engine did not accept readonly for the query clients; refusing to serve queries")
        return client

    async def run(self, sql: str, parameters: Mapping[str, Any], *, checked: bool = True) -> bytes:
        """The JSON response body. Built in the query's thread: the sinks share the event loop.

        ``checked=False`` skips the analytics policy (still read-only, under the same limits):
        only for SQL written in this code base that reads a system table on purpose (the
        dashboard's schema of the agl database), never for SQL a caller sent."""
        return await self._in_thread(self._json_body, sql, parameters, checked)

    async def result(self, sql: str, parameters: Mapping[str, Any]) -> QueryResult:
        """The columns and rows, each value as the JSON body would carry it (see :meth:`run`)."""
        return await self._in_thread(self._result, sql, parameters, True)

    async def _in_thread(
        self,
        work: Callable[[Client, str, dict[str, Any], bool], T],
        sql: str,
        parameters: Mapping[str, Any],
        checked: bool,
    ) -> T:
        client = await self._idle.get()
        try:
            loop = asyncio.get_running_loop()
            running = loop.run_in_executor(self._executor, work, client, sql, dict(parameters), checked)
        except BaseException:
            self._idle.put_nowait(client)
            raise
        running.add_done_callback(lambda _: self._idle.put_nowait(client))  # an abandoned query holds it
        return await within(running, self.time_limit_s)

    def _json_body(self, client: Client, sql: str, parameters: dict[str, Any], checked: bool) -> bytes:
        result = self._result(client, sql, parameters, checked)
        body = {"columns": result.columns, "rows": result.rows}
        return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode(errors="replace")

    def _result(self, client: Client, sql: str, parameters: dict[str, Any], checked: bool) -> QueryResult:
        # The engine's parser first: only one SELECT parses as a subquery (chDB writes INTO
        # OUTFILE even under readonly=1), and this endpoint takes SQL from its caller, so the
        # analytics policy applies: allowed functions, tables of the agl database only (query
        # parameters are substituted by the parser, so an Identifier parameter is checked too).
        if checked:
            # The verdict depends on the functions and tables the SQL names, which only its text
            # and its Identifier parameters decide (other parameters are literals): the store's
            # own queries are a few templates, so after the first of each the check costs a
            # lookup instead of a second engine call per read.
            key = (sql, tuple(sorted((n, str(parameters.get(n))) for n in _IDENTIFIER_PARAMETER.findall(sql))))
            refused = self._verdicts.get(key, _UNCHECKED)
            if refused is _UNCHECKED:
                ast = client.query(f"EXPLAIN AST SELECT * FROM (\n{sql}\n)", parameters=parameters or None).result_rows
                if self._policy is None:
                    self._policy = load_function_policy(client)
                refused = ast_refusal([str(row[0]) for row in ast], self._policy, self.settings.clickhouse_database)
                self._verdicts[key] = refused
                while len(self._verdicts) > _VERDICTS:
                    self._verdicts.pop(next(iter(self._verdicts)))
            if refused is not None:
                raise SqlRefusedError(refused[1], kind=refused[0])
        result = client.query(sql, parameters=parameters or None)
        table = _FIRST_TABLE.search(sql)
        metrics.CLICKHOUSE_READS.labels(metrics.role(), table.group(1) if table else "none").inc()
        return QueryResult(list(result.column_names), [[jsonable(v) for v in row] for row in result.result_rows])

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        for client in self._clients:
            client.close()


class LocalReadSide:
    """The gateway's own store client reads here: what ``POST /v1/query`` does (wait for the
    fence, then the query, under the analytics policy and limits), as a call in this process
    instead of an HTTP request to itself. Errors are those GatewayReadSide raises for the same
    answers."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def query(
        self,
        sql: str,
        parameters: Mapping[str, Any] | None = None,
        *,
        fence: Fence | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> QueryResult:
        try:
            await self.gateway.fenced(fence or {}, timeout)
        except GatewayClosingError as exc:
            raise GatewayUnavailableError(str(exc)) from exc
        try:
            return await self.gateway.queries.result(sql, parameters or {})
        except SqlRefusedError as exc:
            raise QueryError(str(exc), name=exc.kind) from exc
        except DatabaseError as exc:
            raise QueryError(str(exc), code=getattr(exc, "code", None), name=getattr(exc, "name", None)) from exc
        except (ValueError, TypeError, KeyError) as exc:  # parameters clickhouse-connect cannot bind
            raise QueryError(f"{type(exc).__name__}: {exc}") from exc

    async def aclose(self) -> None:
        """Nothing to close: the gateway owns the engine clients."""


MAX_QUERY_BODY_BYTES = 8 << 20
"""The store's parameterised queries: id lists of tens of thousands fit; a larger body is 413."""


class QueryRequest(BaseModel):
    sql: str
    parameters: dict[str, Any] = Field(default_factory=dict)
    fence: dict[str, dict[int, int]] = Field(default_factory=dict)
    timeout: float = Field(30.0, gt=0, le=3600, description="Seconds to wait for the fence.")


def create_app(gateway: Gateway) -> FastAPI:
    """The gateway's HTTP app: its own routes (health, offsets, ``/v1/query``, ``/v1/traces``,
    ``/metrics``), ``/v1/tasks``, ``/v1/sql``, the seed's ``/v1/agl`` and the dashboard, every one
    a module-level route reading what it needs from ``app.state``."""
    app = FastAPI(title="agl-stream gateway", docs_url=None, redoc_url=None)
    settings = gateway.settings
    guard(
        app,
        allowed_hosts(settings.gateway_host, settings.extra_hosts),
        listener_token(settings, settings.gateway_host),
        max_body_bytes=max(otlp.MAX_BODY_BYTES, MAX_BODY_BYTES),
        media_types={"/v1/traces": frozenset({otlp.PROTOBUF})},
        public_pages=(DASHBOARD_PAGES,),
    )
    app.state.gateway = gateway
    app.state.stopping = lambda: gateway.stopping
    app.state.tasks = gateway.tasks
    app.state.sql = SqlRunner(settings)
    app.add_route("/metrics", metrics.metrics_endpoint, methods=["GET"])
    app.include_router(router)
    app.include_router(tasks_router)
    app.include_router(sql_router)
    serve_agl(app, gateway.traces.store)
    backlog = Backlog(
        settings, gateway.applied.snapshot, {spec.name: settings.topic(spec.topic) for spec in gateway.specs}
    )
    serve_dashboard(app, gateway.queries, settings.clickhouse_database, backlog)
    return app


def _decode_otlp(body: bytes, content_encoding: str | None, encoding: otlp.Encoding) -> otlp.DecodedTraces:
    return otlp.decode_body(otlp.decompress(body, content_encoding), encoding)


def _otlp_error(
    encoding: otlp.Encoding, status: int, code: int, kind: str, message: str, headers: dict[str, str] | None = None
) -> Response:
    """An OTLP/HTTP failure: a protobuf ``google.rpc.Status`` for protobuf clients, as the spec
    says; for JSON clients the gateway's error shape plus the gRPC ``code``, so the body also
    reads as a JSON ``google.rpc.Status`` (code, message) to clients that ignore other keys."""
    if encoding == "protobuf":
        return Response(otlp.error_status(code, message), status_code=status, media_type=otlp.PROTOBUF, headers=headers)
    return error_json(status, kind, message, headers=headers, code=code)


class Gateway:
    def __init__(
        self,
        settings: Settings,
        *,
        specs: Sequence[SinkSpec] = SPECS,
        query_clients: int = 4,
        query_time_limit_s: int = 30,
        sink_options: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        self.settings = settings
        self.specs = tuple(specs)
        self.topics = frozenset(settings.topic(spec.topic) for spec in self.specs)
        self.applied = AppliedOffsets()
        self.sinks = SinkThread(
            SinkGroup(
                settings, self.specs, on_applied=self.applied.update, wanted=self.applied.wanted, options=sink_options
            )
        )
        self.applied.on_wait = self.sinks.wake
        self.queries = QueryRunner(settings, size=query_clients, time_limit_s=query_time_limit_s)
        self.traces = TraceIngest(settings, read_side=LocalReadSide(self))
        self.tasks = TaskSubmitter(settings, query=self.queries.run)  # copies and conflicts answered before sending
        self.started = time.monotonic()
        self.stopping = False
        self.url: str | None = None
        self._server: QuietServer | None = None

    async def fenced(self, fence: Fence, timeout: float) -> None:
        """Return once the sinks applied ``fence``: FenceTimeoutError after ``timeout`` s,
        UnknownTopicError for a topic no sink here reads, GatewayClosingError when stopping."""
        wanted = {t: {int(p): int(o) for p, o in ps.items()} for t, ps in fence.items()}
        unknown = sorted(set(wanted) - self.topics)
        if unknown:
            raise UnknownTopicError(
                f"no sink of this gateway reads {unknown}; fences name full topic names, one of {sorted(self.topics)}"
            )
        await self.applied.wait(wanted, timeout)

    def stop(self) -> None:
        if self.stopping:
            return
        self.stopping = True
        log.info("gateway stopping")
        if self._server is not None:
            self._server.should_exit = True
        self.sinks.stop()
        self.applied.close()

    def _load_applied(self) -> None:
        """Migrate, then start from what sink_offsets says was applied before this process."""
        client = get_client(self.settings)
        try:
            migrate(client, self.settings.clickhouse_database, ttl_days=self.settings.clickhouse_ttl_days)
            rows = client.query(
                f"SELECT Topic, Partition, max(NextOffset) FROM {self.settings.clickhouse_database}.sink_offsets "
                "GROUP BY Topic, Partition"
            ).result_rows
        finally:
            client.close()
        for topic, partition, next_offset in rows:
            self.applied.update(str(topic), {int(partition): int(next_offset)})

    async def run(self) -> None:
        await asyncio.to_thread(self._load_applied)
        try:
            await asyncio.to_thread(self.queries.open)
            sock = listen(self.settings.gateway_host, self.settings.gateway_port)
        except BaseException:
            await asyncio.to_thread(self.queries.close)
            raise
        host, port = sock.getsockname()[:2]
        url_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        self.url = f"http://[{url_host}]:{port}" if ":" in url_host else f"http://{url_host}:{port}"
        self._server = QuietServer(server_config(create_app(self)))
        self._server.should_exit = self.stopping  # a signal during start-up
        record = self.settings.run_dir / GATEWAY_FILE
        server_task = asyncio.create_task(self._server.serve(sockets=[sock]), name="gateway:http")
        sinks_task = asyncio.create_task(self.sinks.run(), name="gateway:sinks")
        self.traces.start(self.url)
        self.tasks.start()
        # The socket already listens: clients that read the file now queue until uvicorn accepts.
        _write_record(record, self.url)
        log.info("gateway started", url=self.url, sinks=[s.name for s in self.specs], record=str(record))
        advertised = metrics.advertised(self.settings, metrics.role(), f"{self.url}/metrics")
        try:
            with advertised:
                await asyncio.wait({server_task, sinks_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.stop()  # whichever ended first (or a signal), the other one stops too
            results = await asyncio.gather(server_task, sinks_task, return_exceptions=True)
            await self.traces.close()
            await self.tasks.close()
            await asyncio.to_thread(self.queries.close)
            _remove_record(record)
            sock.close()
        for result in results:
            if isinstance(result, BaseException):
                raise result
        log.info("gateway stopped")


def _write_record(path: Path, url: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"url": url, "pid": os.getpid()}))
    tmp.replace(path)  # atomic: a reader sees the old file or the whole new one


def _remove_record(path: Path) -> None:
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


async def run_gateway(settings: Settings, **options: Any) -> None:
    gateway = Gateway(settings, **options)
    with stop_on_signals(gateway.stop):
        await gateway.run()


def main(settings: Settings, **options: Any) -> None:
    """Run the gateway until SIGTERM/SIGINT (``agl-stream gateway``)."""
    asyncio.run(run_gateway(settings, **options))


# -- the routes -----------------------------------------------------------------------------------


def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


Gw = Annotated[Gateway, Depends(_gateway)]
router = APIRouter(route_class=answering())


@router.get("/v1/health")
async def health(gateway: Gw) -> dict[str, Any]:
    return {
        "status": "stopping" if gateway.stopping else "ok",
        "pid": os.getpid(),
        "sinks": [spec.name for spec in gateway.specs],
        "uptime_s": round(time.monotonic() - gateway.started, 3),
    }


@router.get("/v1/offsets")
async def offsets(gateway: Gw) -> dict[str, Any]:
    applied = gateway.applied.snapshot()
    sinks = {}
    for spec in gateway.specs:
        topic = gateway.settings.topic(spec.topic)
        sinks[spec.name] = {"topic": topic, "applied": {str(p): o for p, o in applied.get(topic, {}).items()}}
    return {"sinks": sinks}


@router.post("/v1/query")
async def query(http: Request, gateway: Gw) -> Response:
    try:
        request = QueryRequest.model_validate_json(await read_body(http, MAX_QUERY_BODY_BYTES))
    except BodyTooLargeError as exc:
        raise Refusal(413, "too_large", str(exc)) from exc
    except ValidationError as exc:
        raise Refusal(400, "bad_request", "; ".join(f"{e['loc']}: {e['msg']}" for e in exc.errors())) from exc
    try:
        await gateway.fenced(request.fence, request.timeout)
    except UnknownTopicError as exc:
        raise Refusal(400, "unknown_topic", str(exc)) from exc
    except FenceTimeoutError as exc:
        raise Refusal(504, "fence_timeout", str(exc)) from exc
    except GatewayClosingError as exc:
        raise Refusal(503, "stopping", str(exc)) from exc
    try:
        result = await gateway.queries.run(request.sql, request.parameters)
    except SqlRefusedError as exc:
        raise Refusal(403, exc.kind, str(exc)) from exc
    except DatabaseError as exc:
        code, name = getattr(exc, "code", None), getattr(exc, "name", None)
        raise Refusal(400, "query_error", str(exc), code=code, name=name) from exc
    except (ValueError, TypeError, KeyError) as exc:  # parameters clickhouse-connect cannot bind
        raise Refusal(400, "query_error", f"{type(exc).__name__}: {exc}") from exc
    return Response(result, media_type="application/json")


@router.post("/v1/traces")
async def traces(request: Request, gateway: Gw) -> Response:
    try:
        encoding = otlp.content_encoding(request.headers.get("content-type"))
    except otlp.UnsupportedOtlpContentError as exc:
        raise Refusal(415, "unsupported_media_type", str(exc)) from exc
    if gateway.stopping:
        return _otlp_error(encoding, 503, otlp.GRPC_UNAVAILABLE, "stopping", "the gateway is shutting down")
    try:
        body = await read_body(
            request,
            otlp.MAX_BODY_BYTES,
            "export fewer spans per request (the SDK batch processor's max_export_batch_size)",
        )
        # Off the event loop: decoding a large batch would hold up the sinks sharing it.
        decoded = await asyncio.to_thread(_decode_otlp, body, request.headers.get("content-encoding"), encoding)
    except otlp.UnsupportedOtlpContentError as exc:
        return _otlp_error(encoding, 415, otlp.GRPC_INVALID_ARGUMENT, "unsupported_media_type", str(exc))
    except (otlp.OtlpTooLargeError, BodyTooLargeError) as exc:
        return _otlp_error(encoding, 413, otlp.GRPC_RESOURCE_EXHAUSTED, "too_large", str(exc))
    except otlp.MalformedOtlpError as exc:
        return _otlp_error(encoding, 400, otlp.GRPC_INVALID_ARGUMENT, "malformed_otlp", str(exc))
    try:
        rejected, message = await gateway.traces.export(decoded)
    except TracesUnavailableError as exc:
        return _otlp_error(encoding, 503, otlp.GRPC_UNAVAILABLE, "unavailable", str(exc), headers={"Retry-After": "2"})
    except TracesWriteError as exc:
        return _otlp_error(encoding, 500, otlp.GRPC_INTERNAL, "write_failed", str(exc))
    media_type = otlp.PROTOBUF if encoding == "protobuf" else otlp.JSON
    return Response(otlp.export_response(rejected, message, encoding), media_type=media_type)
