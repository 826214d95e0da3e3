"""How clients read the store: SQL over ClickHouse, behind offset fences.

Fence convention. A writer that wants to read its own write keeps the Kafka position of the
record it wrote (aiokafka's RecordMetadata: topic, partition, offset) and passes it as a fence
``{topic: {partition: offset}}`` (full topic names, e.g. ``agl.rollout-state``; the offset of the
record itself, not the one after it). A fence holds once every named partition's sink has
applied that record, i.e. its NextOffset in ``sink_offsets`` is at least ``offset + 1``. Records
a sink skips (tombstones, dead letters, offsets compacted away) count as applied. Merge several
writes into one fence with :func:`fence_of`.

Two ways to read:

- :class:`GatewayReadSide`: through the gateway's HTTP API (``consumers/gateway.py``), the
  process that owns the embedded engine; it waits for fences on the sinks' own notifications.
- :class:`ClickHouseReadSide`: straight to a ClickHouse server (``AGL_CLICKHOUSE_URL``); fences
  are waited for by polling ``sink_offsets`` at a short interval until a deadline.

:func:`read_side_for` picks one from the settings.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

from agl_stream.auth import auth_headers
from agl_stream.config import Settings
from agl_stream.errors import FenceTimeoutError, GatewayUnavailableError, QueryError, ReadSideError
from agl_stream.logs import get_logger
from agl_stream.retry import REREAD

log = get_logger(__name__)

Fence = Mapping[str, Mapping[int, int]]
"""``{topic: {partition: offset of the written record}}``."""

GATEWAY_FILE = "gateway.json"
"""Written by a running gateway into ``Settings.run_dir``: ``{"url": ..., "pid": ...}``."""

DEFAULT_TIMEOUT = 30.0


@dataclass(frozen=True)
class QueryResult:
    columns: list[str]
    rows: list[list[Any]]

    def dicts(self) -> list[dict[str, Any]]:
        return [dict(zip(self.columns, row, strict=True)) for row in self.rows]


class ReadSide(Protocol):
    async def query(
        self,
        sql: str,
        parameters: Mapping[str, Any] | None = None,
        *,
        fence: Fence | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> QueryResult:
        """Run ``sql`` read-only once ``fence`` holds; FenceTimeoutError after ``timeout`` s."""
        ...

    async def aclose(self) -> None: ...


class RecordPosition(Protocol):
    """What a producer acknowledgement carries (aiokafka's RecordMetadata has these)."""

    @property
    def topic(self) -> str: ...

    @property
    def partition(self) -> int: ...

    @property
    def offset(self) -> int: ...


def fence_of(records: Iterable[RecordPosition]) -> dict[str, dict[int, int]]:
    """One fence covering every record: per partition, the highest offset written."""
    fence: dict[str, dict[int, int]] = {}
    for record in records:
        partitions = fence.setdefault(record.topic, {})
        partitions[record.partition] = max(partitions.get(record.partition, -1), record.offset)
    return fence


def _raise(partitions: dict[int, int], partition: int, offset: int) -> None:
    if offset > partitions.get(partition, -1):
        partitions[partition] = offset


class KeyFences:
    """Read fences per key (a rollout id): for each topic, the newest record of that key a client
    wrote or was answered about, so a read of one rollout waits for that rollout's records only.

    Bounded: the least recently noted keys are forgotten into a per-topic floor (the fence of
    every forgotten key), and a record noted without a key raises the floor too; a key's fence
    is its own records' joined with the floor, so it is never below what a read of it needs.
    Pure bookkeeping, used from one event loop.
    """

    def __init__(self, memory: int) -> None:
        self.memory = memory
        self._keys: dict[tuple[str, str], dict[int, int]] = {}  # insertion order: least recent first
        self._floor: dict[str, dict[int, int]] = {}

    def note(self, topic: str, key: str | None, partition: int, offset: int) -> None:
        if key is None:
            _raise(self._floor.setdefault(topic, {}), partition, offset)
            return
        partitions = self._keys.pop((topic, key), None) or {}
        _raise(partitions, partition, offset)
        self._keys[(topic, key)] = partitions
        while len(self._keys) > self.memory:
            oldest = next(iter(self._keys))
            forgotten = self._keys.pop(oldest)
            floor = self._floor.setdefault(oldest[0], {})
            for p, o in forgotten.items():
                _raise(floor, p, o)

    def of(self, topic: str, key: str) -> dict[int, int]:
        """The fence of a read of ``key`` in ``topic`` (empty: nothing to wait for)."""
        fence = dict(self._floor.get(topic, {}))
        for partition, offset in self._keys.get((topic, key), {}).items():
            _raise(fence, partition, offset)
        return fence


def fence_behind(applied: Mapping[str, Mapping[int, int]], fence: Fence) -> dict[str, dict[int, int]]:
    """The fenced partitions not applied yet: ``{topic: {partition: applied next offset}}``.

    ``applied`` holds next offsets (what sink_offsets records); empty when the fence holds.
    """
    behind: dict[str, dict[int, int]] = {}
    for topic, partitions in fence.items():
        for partition, offset in partitions.items():
            next_offset = applied.get(topic, {}).get(partition, 0)
            if next_offset <= offset:
                behind.setdefault(topic, {})[partition] = next_offset
    return behind


def _normalize(fence: Fence | None) -> dict[str, dict[int, int]]:
    return {topic: {int(p): int(o) for p, o in partitions.items()} for topic, partitions in (fence or {}).items()}


_REFUSALS = frozenset({"forbidden_function", "forbidden_table", "read_only"})


class GatewayReadSide:
    """Reads through a gateway's ``POST /v1/query``.

    The HTTP timeout is the fence timeout plus ``query_margin`` seconds for the query itself
    (the gateway enforces its own query time limit).
    """

    def __init__(
        self,
        url: str,
        *,
        query_margin: float = 60.0,
        client: httpx.AsyncClient | None = None,
        locate: Callable[[], str | None] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.query_margin = query_margin
        self._client = client or httpx.AsyncClient(headers=dict(headers or {}))
        self._owns_client = client is None
        # Where the gateway is now (a restarted local gateway may listen on another port).
        self._locate = locate

    async def query(
        self,
        sql: str,
        parameters: Mapping[str, Any] | None = None,
        *,
        fence: Fence | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> QueryResult:
        body = {
            "sql": sql,
            "parameters": dict(parameters or {}),
            "fence": {t: {str(p): o for p, o in ps.items()} for t, ps in _normalize(fence).items()},
            "timeout": timeout,
        }
        response = await self._post("/v1/query", body, timeout + self.query_margin)
        payload = _json_body(response)
        if response.status_code == 200:
            return QueryResult(list(payload["columns"]), [list(r) for r in payload["rows"]])
        message = str(payload.get("message") or response.text)
        if response.status_code == 504 and payload.get("error") == "fence_timeout":
            raise FenceTimeoutError(message)
        if payload.get("error") == "query_error":
            raise QueryError(message, code=payload.get("code"), name=payload.get("name"))
        if payload.get("error") in _REFUSALS:  # the SQL policy's verdict: the query never ran
            raise QueryError(message, name=str(payload["error"]))
        raise ReadSideError(f"gateway {self.url} answered {response.status_code}: {message}")

    async def offsets(self) -> dict[str, Any]:
        """What each of the gateway's sinks has applied (``GET /v1/offsets``)."""
        try:
            response = await self._client.get(f"{self.url}/v1/offsets", timeout=10.0)
        except httpx.TransportError as exc:
            raise GatewayUnavailableError(f"gateway {self.url} does not answer: {exc}") from exc
        response.raise_for_status()
        result: dict[str, Any] = response.json()
        return result

    async def _post(self, path: str, body: dict[str, Any], timeout: float) -> httpx.Response:
        """POST a read; a gateway that does not answer or is shutting down is asked again with
        backoff (reads are idempotent) until ``timeout`` has passed, so a gateway's restart
        costs a caller a pause, not an exception."""
        deadline = time.monotonic() + timeout
        failures = 0
        while True:
            try:
                response = await self._client.post(f"{self.url}{path}", json=body, timeout=timeout)
            except httpx.TransportError as exc:
                failure = f"does not answer ({type(exc).__name__}: {exc})"
            else:
                if response.status_code != 503:
                    return response
                failure = "is shutting down (503)"
            failures += 1
            delay = REREAD.after(failures)
            if time.monotonic() + delay > deadline:
                raise GatewayUnavailableError(
                    f"gateway {self.url} {failure}, still after {timeout:.0f}s; is `agl-stream up` running?"
                )
            log.info("gateway unavailable, asking again", url=self.url, failure=failure, retry_in_s=delay)
            await asyncio.sleep(delay)  # backoff between tries, not synchronisation
            if self._locate is not None:
                self.url = (self._locate() or self.url).rstrip("/")

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()


def _json_body(response: httpx.Response) -> dict[str, Any]:
    try:
        payload = response.json()
    except ValueError:
        return {}
    return payload if isinstance(payload, dict) else {}


class ClickHouseReadSide:
    """Reads straight from ClickHouse with a read-only client (``readonly`` set by the engine).

    Meant for a ClickHouse server. With the embedded engine it opens the data dir itself, which
    only works while no other process (a gateway) holds it.

    Fences: sink_offsets is polled every ``poll_interval`` seconds until the fence holds or the
    deadline passes; the sinks run in other processes, so there is nothing to be notified by.
    Queries are serialised on the one client (clickhouse-connect sessions take one at a time).
    """

    def __init__(self, settings: Settings, *, poll_interval: float = 0.02) -> None:
        self.settings = settings
        self.db = settings.clickhouse_database
        self.poll_interval = poll_interval
        self._lock = asyncio.Lock()
        self._client: Any = None

    def _connect(self) -> Any:
        if self._client is None:
            from agl_stream.clickhouse.client import get_client  # the engine only where it is used

            self._client = get_client(self.settings, readonly=True)
        return self._client

    async def query(
        self,
        sql: str,
        parameters: Mapping[str, Any] | None = None,
        *,
        fence: Fence | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> QueryResult:
        deadline = time.monotonic() + timeout
        async with self._lock:
            await self._wait(_normalize(fence), deadline, timeout)
            limit = max(1, int(deadline - time.monotonic() + 0.999))
            return await asyncio.to_thread(self._run, sql, dict(parameters or {}), limit)

    def _run(self, sql: str, parameters: dict[str, Any], time_limit: int) -> QueryResult:
        from clickhouse_connect.driver.exceptions import DatabaseError

        client = self._connect()
        settings = None if self.settings.uses_embedded_clickhouse else {"max_execution_time": time_limit}
        try:
            result = client.query(sql, parameters=parameters or None, settings=settings)
        except DatabaseError as exc:
            raise QueryError(str(exc), code=getattr(exc, "code", None), name=getattr(exc, "name", None)) from exc
        return QueryResult(list(result.column_names), [list(row) for row in result.result_rows])

    def applied(self, topics: Iterable[str]) -> dict[str, dict[int, int]]:
        """Per topic and partition, the next offset the sinks have applied."""
        rows = (
            self._connect()
            .query(
                f"SELECT Topic, Partition, max(NextOffset) FROM {self.db}.sink_offsets "
                "WHERE Topic IN {topics:Array(String)} GROUP BY Topic, Partition",
                parameters={"topics": list(topics)},
            )
            .result_rows
        )
        applied: dict[str, dict[int, int]] = {}
        for topic, partition, next_offset in rows:
            applied.setdefault(str(topic), {})[int(partition)] = int(next_offset)
        return applied

    async def _wait(self, fence: dict[str, dict[int, int]], deadline: float, timeout: float) -> None:
        if not fence:
            return
        while True:
            behind = fence_behind(await asyncio.to_thread(self.applied, fence), fence)
            if not behind:
                return
            if time.monotonic() >= deadline:
                raise FenceTimeoutError(
                    f"the sinks did not apply {fence} within {timeout}s; applied next offsets of the "
                    f"partitions still behind: {behind}"
                )
            await asyncio.sleep(self.poll_interval)  # poll interval of a wait with a deadline

    async def aclose(self) -> None:
        if self._client is not None:
            await asyncio.to_thread(self._client.close)
            self._client = None


@dataclass(frozen=True)
class GatewayRecord:
    url: str
    pid: int


def read_gateway_file(run_dir: Path) -> GatewayRecord | None:
    """The gateway ``run_dir/gateway.json`` names, or None when there is none or its process is gone."""
    path = run_dir / GATEWAY_FILE
    try:
        data = json.loads(path.read_text())
        record = GatewayRecord(str(data["url"]), int(data["pid"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record if _alive(record.pid) else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


def read_side_for(settings: Settings) -> ReadSide:
    """AGL_GATEWAY_URL, else AGL_CLICKHOUSE_URL, else the gateway recorded in run_dir."""
    if settings.gateway_url:
        return GatewayReadSide(settings.gateway_url, headers=auth_headers(settings))
    if settings.clickhouse_url:
        return ClickHouseReadSide(settings)
    recorded = read_gateway_file(settings.run_dir)
    if recorded is not None:

        def locate() -> str | None:
            again = read_gateway_file(settings.run_dir)
            return again.url if again is not None else None

        return GatewayReadSide(recorded.url, locate=locate, headers=auth_headers(settings))
    raise GatewayUnavailableError(
        f"no running gateway is recorded in {settings.run_dir / GATEWAY_FILE}: start the local stack "
        "with `agl-stream up` (or `agl-stream gateway`), or set AGL_GATEWAY_URL or AGL_CLICKHOUSE_URL"
    )
