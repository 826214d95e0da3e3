"""What ``agl-stream status`` shows of the running roles: consumer lag per group and records/s per
role instance.

The lag comes from Kafka (each group's committed offsets against the log-end offsets: what a
restart would read again); the rates from each process's metrics endpoint (the files
``agl_stream.metrics`` writes under ``<run dir>/metrics/``), scraped twice ``interval_s`` apart.
The arithmetic (parsing an exposition, rates, lag sums) is pure and tested on numbers; the shell
around it reads files, scrapes and asks Kafka, each part with a timeout, so a dead role or an
unreachable broker is a row that says so, never a traceback.

Concurrency model: one asyncio task per call of :func:`observe`; the scrapes of all endpoints
and the Kafka read run concurrently within it, sharing nothing mutable.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from agl_stream.auth import auth_headers
from agl_stream.config import Settings
from agl_stream.kafka import admin
from agl_stream.local.processes import role_alive
from agl_stream.metrics import Endpoint, read_endpoints

__all__ = [
    "Endpoint",
    "GroupLag",
    "Observation",
    "RoleView",
    "group_lags",
    "observe",
    "parse_totals",
    "read_endpoints",
    "role_views",
]

RECORDS_IN = "agl_records_in_total"
RECORDS_OUT = "agl_records_out_total"


@dataclass(frozen=True)
class Scrape:
    """What one scrape found: per metric, the sum over its samples; per metric, the ``group``
    labels seen (which consumer groups the process is a member of)."""

    at: float
    totals: Mapping[str, float]
    groups: frozenset[str]


@dataclass(frozen=True)
class RoleView:
    role: str
    pid: int
    url: str
    state: str  # "up", "not answering", "exited"
    in_per_s: float | None = None
    out_per_s: float | None = None
    records_in: float | None = None
    records_out: float | None = None
    groups: frozenset[str] = frozenset()


@dataclass(frozen=True)
class GroupLag:
    group: str
    topics: tuple[str, ...]
    partitions: int
    lag: int
    by_partition: Mapping[tuple[str, int], int] = field(default_factory=dict)


@dataclass(frozen=True)
class Observation:
    roles: list[RoleView]
    lags: list[GroupLag]
    kafka_error: str | None = None


# -- the functional core ------------------------------------------------------------------------


def parse_totals(text: str) -> tuple[dict[str, float], frozenset[str]]:
    """An exposition's samples summed per name (over every label set), and the ``group`` labels."""
    totals: dict[str, float] = {}
    groups: set[str] = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + float(sample.value)
            group = sample.labels.get("group")
            if group:
                groups.add(group)
    return totals, frozenset(groups)


def _rate(name: str, before: Scrape, after: Scrape) -> float | None:
    seconds = after.at - before.at
    if seconds <= 0:
        return None
    # A counter only moves up in one process; a drop means another process took the pid's file.
    return max(0.0, after.totals.get(name, 0.0) - before.totals.get(name, 0.0)) / seconds


def role_views(
    endpoints: Sequence[Endpoint],
    first: Mapping[Path, Scrape | None],
    second: Mapping[Path, Scrape | None],
    alive: Mapping[Path, bool],
) -> list[RoleView]:
    """One row per endpoint: records/s between its two scrapes, or why there are none."""
    views = []
    for endpoint in sorted(endpoints, key=lambda e: (e.role, e.pid)):
        before, after = first.get(endpoint.path), second.get(endpoint.path)
        if not alive.get(endpoint.path, False):
            views.append(RoleView(endpoint.role, endpoint.pid, endpoint.url, "exited"))
        elif after is None:
            views.append(RoleView(endpoint.role, endpoint.pid, endpoint.url, "not answering"))
        else:
            views.append(
                RoleView(
                    endpoint.role,
                    endpoint.pid,
                    endpoint.url,
                    "up",
                    in_per_s=_rate(RECORDS_IN, before, after) if before else None,
                    out_per_s=_rate(RECORDS_OUT, before, after) if before else None,
                    records_in=after.totals.get(RECORDS_IN, 0.0),
                    records_out=after.totals.get(RECORDS_OUT, 0.0),
                    groups=after.groups,
                )
            )
    return views


def group_lags(
    committed: Mapping[str, Mapping[tuple[str, int], int]], ends: Mapping[tuple[str, int], int]
) -> list[GroupLag]:
    """Per consumer group: records between its commits and the log ends, summed over the
    partitions of the topics it committed on. A partition it never committed on counts from
    zero (all of it waits for the group); a commit past the end (a topic recreated) counts 0."""
    lags = []
    for group, offsets in sorted(committed.items()):
        topics = tuple(sorted({topic for topic, _ in offsets}))
        parts = {tp: end for tp, end in ends.items() if tp[0] in topics}
        by_partition = {tp: max(0, end - min(offsets.get(tp, 0), end)) for tp, end in sorted(parts.items())}
        lags.append(GroupLag(group, topics, len(parts), sum(by_partition.values()), by_partition))
    return lags


# -- the imperative shell -------------------------------------------------------------------------


async def _scrape(client: httpx.AsyncClient, endpoint: Endpoint) -> Scrape | None:
    try:
        response = await client.get(endpoint.url)
        response.raise_for_status()
        totals, groups = parse_totals(response.text)
    except (httpx.HTTPError, ValueError):
        return None
    return Scrape(time.monotonic(), totals, groups)


async def _scrape_all(client: httpx.AsyncClient, endpoints: Iterable[Endpoint]) -> dict[Path, Scrape | None]:
    endpoints = list(endpoints)
    scrapes = await asyncio.gather(*(_scrape(client, e) for e in endpoints))
    return {e.path: s for e, s in zip(endpoints, scrapes, strict=True)}


async def _rates(settings: Settings, interval_s: float) -> list[RoleView]:
    endpoints = read_endpoints(settings)
    here = socket.gethostname()
    # A pid means something on its own host only: one of another host (a container sharing the
    # folder) counts as alive, and its scrape says whether it answers.
    alive = {e.path: role_alive(e.pid) if e.host in ("", here) else True for e in endpoints}
    live = [e for e in endpoints if alive[e.path]]
    async with httpx.AsyncClient(timeout=2.0, headers=auth_headers(settings), trust_env=False) as client:
        first = await _scrape_all(client, live)
        if live:
            await asyncio.sleep(interval_s)  # the measuring interval of a rate, not synchronisation
        second = await _scrape_all(client, live)
    for endpoint in endpoints:  # a process killed before it could remove its file
        if not alive[endpoint.path]:
            endpoint.path.unlink(missing_ok=True)
    return role_views(endpoints, first, second, alive)


def _ours(settings: Settings, group: str) -> bool:
    return group.startswith(f"{settings.topic_prefix}.") or group == settings.otlp_kafka_group


async def _lags(settings: Settings) -> list[GroupLag]:
    committed, ends = await admin.group_positions(settings, lambda group: _ours(settings, group))
    return group_lags(committed, ends)


async def observe(
    settings: Settings, *, interval_s: float = 1.0, lag: bool = True, kafka_timeout_s: float = 5.0
) -> Observation:
    """Rates of every role instance and (``lag``) the lag of every consumer group, read concurrently."""
    rates = asyncio.create_task(_rates(settings, interval_s))
    if not lag:
        return Observation(await rates, [])
    try:
        lags = await asyncio.wait_for(_lags(settings), kafka_timeout_s)
        error = None
    except Exception as exc:  # whatever Kafka says (or does not), status still shows the rest
        lags, error = [], f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return Observation(await rates, lags, error)
