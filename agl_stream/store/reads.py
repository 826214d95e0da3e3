"""The read half of the store client: LightningStore queries over the read side.

Each query carries the client's fence for the topics its tables come from, so a client reads
its own writes: rollouts and attempts wait for the states this client was answered with,
spans for the spans it wrote, and so on. The write half raises the fence (``_note``).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, Literal, TypeVar

from agl_stream.config import Settings
from agl_stream.models import Attempt, ResourcesUpdate, Rollout, Span, Worker
from agl_stream.store.queries import (
    Query,
    StoreQueries,
    attempt_from_row,
    count_of,
    resources_from_row,
    rollout_from_row,
    span_from_row,
    statistics_from_row,
    total_from_row,
    worker_from_row,
)
from agl_stream.store.readside import KeyFences, ReadSide, read_side_for
from agl_stream.store.types import AttemptedRollout, StoreStatistics

T = TypeVar("T")

_KEY_FENCES_MEMORY = 20_000
"""Rollouts whose own read fence a client remembers (older ones are read behind its oldest)."""


class StoreReads:
    """Queries behind this client's fence, which its write half raises (``_note``)."""

    def __init__(self, settings: Settings, read_side: ReadSide | None = None) -> None:
        self.settings = settings
        # topic -> partition -> newest offset written or answered: the fence of our reads.
        self.fence: dict[str, dict[int, int]] = defaultdict(dict)
        # The same per rollout, for reads of one rollout (its spans, its attempts): they wait for
        # this client's writes about that rollout only, not for every write it made since.
        self._key_fences = KeyFences(_KEY_FENCES_MEMORY)
        # The same per worker: its own records (heartbeats, idle marks) and the states of
        # rollouts with an attempt of it, for reads of one worker (its status follows from them).
        self._worker_fences = KeyFences(_KEY_FENCES_MEMORY)
        self.sql = StoreQueries(settings.clickhouse_database)
        self.side: ReadSide | None = None
        self._given_side = read_side  # the process's own read side (the gateway's), used as is
        self.topics = {name: settings.topic(name) for name in ("rollout-state", "spans", "resources", "workers")}
        self.started = time.monotonic()

    async def _start_reads(self) -> None:
        self.side = self._given_side or read_side_for(self.settings)

    async def _close_reads(self) -> None:
        if self.side is not None and self.side is not self._given_side:
            await self.side.aclose()

    async def _settle(self, sources: Sequence[str], key: str | None = None) -> None:
        """Before a read from ``sources`` (of rollout ``key`` only, when given): make sure the
        fence covers every write so far."""

    def _note(
        self, topic: str, partition: int, offset: int, key: str | None = None, workers: Collection[str] = ()
    ) -> None:
        """Raise the fence to a record written or answered; ``key`` (the rollout id of a span
        batch or a state record) also raises that rollout's own fence, and ``workers`` (the
        worker of a worker record, those with an attempt in a state record) theirs. A record
        with neither may be about any rollout or worker: it raises every one's fence."""
        fence = self.fence[topic]
        if offset > fence.get(partition, -1):
            fence[partition] = offset
        self._key_fences.note(topic, key, partition, offset)
        about: Iterable[str | None] = workers or ([None] if key is None else [])
        for worker in about:
            self._worker_fences.note(topic, worker, partition, offset)

    def _fence_for(
        self, sources: Sequence[str], key: str | None, worker: str | None = None
    ) -> dict[str, dict[int, int]]:
        """The fence of a read from ``sources``; ``key``: the read is of that rollout only;
        ``worker``: of that worker only."""
        topics = [self.topics[s] for s in sources]
        if worker is not None:
            return {t: f for t in topics if (f := self._worker_fences.of(t, worker))}
        if key is None:
            return {t: dict(self.fence[t]) for t in topics if self.fence.get(t)}
        return {t: f for t in topics if (f := self._key_fences.of(t, key))}

    async def _rows(
        self, query: Query, *sources: str, key: str | None = None, worker: str | None = None
    ) -> list[dict[str, Any]]:
        assert self.side is not None, "the store is not started"
        await self._settle(sources, key)
        fence = self._fence_for(sources, key, worker)
        result = await self.side.query(query.sql, query.parameters, fence=fence or None)
        return result.dicts()

    async def read(self, query: Query, *sources: str) -> list[dict[str, Any]]:
        """The rows of ``query`` (a :class:`StoreQueries` builder's), fenced like every read here
        on this client's writes to ``sources`` (``rollout-state``, ``spans``, ...)."""
        return await self._rows(query, *sources)

    async def _all(
        self, query: Query, convert: Callable[[Mapping[str, Any]], T], *sources: str, key: str | None = None
    ) -> list[T]:
        return [convert(row) for row in await self._rows(query, *sources, key=key)]

    async def _one(
        self,
        query: Query,
        convert: Callable[[Mapping[str, Any]], T],
        *sources: str,
        key: str | None = None,
        worker: str | None = None,
    ) -> T | None:
        rows = await self._rows(query, *sources, key=key, worker=worker)
        return convert(rows[0]) if rows else None

    async def _count(self, query: Query, *sources: str, key: str | None = None) -> int:
        """How many rows ``query`` gives, counted by the engine (one COUNT query)."""
        return await self._one(count_of(query), total_from_row, *sources, key=key) or 0

    # -- rollouts and attempts -------------------------------------------------------------

    async def query_rollouts(
        self,
        *,
        status_in: Sequence[str] | None = None,
        rollout_id_in: Sequence[str] | None = None,
        rollout_id_contains: str | None = None,
        filter_logic: Literal["and", "or"] = "and",
        sort_by: str | None = None,
        sort_order: Literal["asc", "desc"] = "asc",
        limit: int = -1,
        offset: int = 0,
        status: Sequence[str] | None = None,
        rollout_ids: Sequence[str] | None = None,
    ) -> list[Rollout]:
        """Rollouts matching the filters (statuses, ids, an id substring; combined with
        ``filter_logic``), sorted by ``sort_by`` (a rollout field) and paged by ``limit``
        (-1: all) and ``offset``. ``status`` and ``rollout_ids`` are the seed's older names of
        the first two. Sees every write this client made before the call (its fence)."""
        query = self.sql.rollouts(
            status_in=status_in if status_in is not None else status,
            rollout_id_in=rollout_id_in if rollout_id_in is not None else rollout_ids,
            rollout_id_contains=rollout_id_contains,
            filter_logic=filter_logic,
            sort_by=sort_by,
            sort_order=sort_order,
            limit=limit,
            offset=offset,
        )
        return await self._with_attempts(await self._all(query, rollout_from_row, "rollout-state"))

    async def count_rollouts(
        self,
        *,
        status_in: Sequence[str] | None = None,
        rollout_id_in: Sequence[str] | None = None,
        rollout_id_contains: str | None = None,
        filter_logic: Literal["and", "or"] = "and",
    ) -> int:
        """How many rollouts :meth:`query_rollouts` with these filters gives, unpaged (a page's
        total), counted by the engine without reading them."""
        query = self.sql.rollouts(
            status_in=status_in,
            rollout_id_in=rollout_id_in,
            rollout_id_contains=rollout_id_contains,
            filter_logic=filter_logic,
        )
        return await self._count(query, "rollout-state")

    async def get_rollout_by_id(self, rollout_id: str) -> Rollout | None:
        """The rollout (an :class:`AttemptedRollout` with its latest attempt once it has one), or
        None when no rollout has this id (after this client's own writes)."""
        found = await self._one(self.sql.rollout_by_id(rollout_id), rollout_from_row, "rollout-state", key=rollout_id)
        return None if found is None else (await self._with_attempts([found], rollout_id))[0]

    async def _with_attempts(self, rollouts: list[Rollout], key: str | None = None) -> list[Rollout]:
        """Each rollout that has attempts as an AttemptedRollout with its latest, as the seed's
        stores return them; one more query, only when some rollout left the queue. ``key``: the
        one rollout read (its own fence)."""
        tried = [r.rollout_id for r in rollouts if r.status != "queuing"]
        if not tried:
            return rollouts
        query = self.sql.latest_attempts(tried)
        latest = {a.rollout_id: a for a in await self._all(query, attempt_from_row, "rollout-state", key=key)}
        return [
            AttemptedRollout(**dict(r), attempt=latest[r.rollout_id]) if r.rollout_id in latest else r for r in rollouts
        ]

    async def query_attempts(
        self,
        rollout_id: str,
        *,
        sort_by: str | None = "sequence_id",
        sort_order: Literal["asc", "desc"] = "asc",
        limit: int = -1,
        offset: int = 0,
    ) -> list[Attempt]:
        """The attempts of a rollout, by ``sequence_id`` unless sorted otherwise; paged like
        :meth:`query_rollouts`. Empty for an unknown rollout, as in the seed's stores."""
        query = self.sql.attempts(rollout_id, sort_by=sort_by, sort_order=sort_order, limit=limit, offset=offset)
        return await self._all(query, attempt_from_row, "rollout-state", key=rollout_id)

    async def count_attempts(self, rollout_id: str) -> int:
        """How many attempts the rollout has (0 for an unknown rollout)."""
        return await self._count(self.sql.attempts(rollout_id), "rollout-state", key=rollout_id)

    async def get_latest_attempt(self, rollout_id: str) -> Attempt | None:
        """The rollout's newest attempt; None while it has none or the rollout is unknown."""
        query = self.sql.latest_attempts([rollout_id])
        return await self._one(query, attempt_from_row, "rollout-state", key=rollout_id)

    # -- spans -------------------------------------------------------------------------------

    async def query_spans(self, rollout_id: str, attempt_id: str | None = None, **filters: Any) -> list[Span]:
        """The spans of a rollout (of one attempt, or ``"latest"``), by sequence id; ``filters``
        as the seed's (e.g. ``name``). Sees every span this client added. Empty for an unknown
        rollout or attempt, as in the seed's stores (reads never raise for an id)."""
        query = self.sql.spans(rollout_id, attempt_id, **filters)
        return await self._all(query, span_from_row, *_span_sources(attempt_id), key=rollout_id)

    async def count_spans(self, rollout_id: str, attempt_id: str | None = None, **filters: Any) -> int:
        """How many spans :meth:`query_spans` with these filters gives, unpaged (``limit``,
        ``offset`` and sorting are ignored)."""
        unpaged = {k: v for k, v in filters.items() if k not in ("limit", "offset", "sort_by", "sort_order")}
        query = self.sql.spans(rollout_id, attempt_id, **unpaged)
        return await self._count(query, *_span_sources(attempt_id), key=rollout_id)

    # -- resources -----------------------------------------------------------------------------

    async def query_resources(
        self,
        *,
        resources_id: str | None = None,
        resources_id_contains: str | None = None,
        sort_by: str | None = None,
        sort_order: Literal["asc", "desc"] = "asc",
        limit: int = -1,
        offset: int = 0,
    ) -> list[ResourcesUpdate]:
        """Resources snapshots (the latest version of each id), filtered, sorted and paged like
        :meth:`query_rollouts`. Read from ClickHouse, so LLM API keys come back redacted; use
        :meth:`get_resources_by_id` for a snapshot to run with."""
        query = self.sql.resources(
            resources_id=resources_id,
            resources_id_contains=resources_id_contains,
            sort_by=sort_by,
            sort_order=sort_order,
            limit=limit,
            offset=offset,
        )
        return await self._all(query, resources_from_row, "resources")

    async def count_resources(
        self, *, resources_id: str | None = None, resources_id_contains: str | None = None
    ) -> int:
        """How many snapshots :meth:`query_resources` with these filters gives, unpaged."""
        query = self.sql.resources(resources_id=resources_id, resources_id_contains=resources_id_contains)
        return await self._count(query, "resources")

    async def get_resources_by_id(self, resources_id: str) -> ResourcesUpdate | None:
        """The snapshot with this id, as the read side holds it (API keys redacted)."""
        return await self._one(self.sql.resources_by_id(resources_id), resources_from_row, "resources")

    async def get_latest_resources(self) -> ResourcesUpdate | None:
        """The latest snapshot, as the read side holds it (API keys redacted)."""
        return await self._one(self.sql.latest_resources(), resources_from_row, "resources")

    # -- workers and statistics ------------------------------------------------------------------

    async def query_workers(
        self,
        *,
        status_in: Sequence[str] | None = None,
        worker_id_contains: str | None = None,
        filter_logic: Literal["and", "or"] = "and",
        sort_by: str | None = None,
        sort_order: Literal["asc", "desc"] = "asc",
        limit: int = -1,
        offset: int = 0,
    ) -> list[Worker]:
        """Workers (status and current attempt follow from their attempts), filtered, sorted
        and paged like :meth:`query_rollouts`."""
        query = self.sql.workers(
            status_in=status_in,
            worker_id_contains=worker_id_contains,
            filter_logic=filter_logic,
            sort_by=sort_by,
            sort_order=sort_order,
            limit=limit,
            offset=offset,
        )
        return await self._all(query, worker_from_row, "workers", "rollout-state")

    async def count_workers(
        self,
        *,
        status_in: Sequence[str] | None = None,
        worker_id_contains: str | None = None,
        filter_logic: Literal["and", "or"] = "and",
    ) -> int:
        """How many workers :meth:`query_workers` with these filters gives, unpaged."""
        query = self.sql.workers(status_in=status_in, worker_id_contains=worker_id_contains, filter_logic=filter_logic)
        return await self._count(query, "workers", "rollout-state")

    async def get_worker_by_id(self, worker_id: str) -> Worker | None:
        """The worker, or None when none has this id. Fenced on this client's writes about that
        worker only (its records, the states of rollouts it has an attempt on): a heartbeat's
        read waits for no other rollout's state to reach the tables."""
        query = self.sql.worker_by_id(worker_id)
        return await self._one(query, worker_from_row, "workers", "rollout-state", worker=worker_id)

    async def statistics(self) -> StoreStatistics:
        """The seed's ``statistics``: totals of rollouts, attempts, spans, resources and
        workers, and this client's uptime in seconds (the gateway's, over REST). The seed's
        memory fields (span bytes, eviction thresholds) are its in-memory store's, which evicts
        spans past a memory budget; spans here live in ClickHouse and are never evicted."""
        counts = await self._one(self.sql.statistics(), statistics_from_row, "rollout-state", "spans")
        uptime = time.monotonic() - self.started
        return StoreStatistics(name="AglStore", uptime=uptime, **(counts or {}))  # type: ignore[typeddict-item]


def _span_sources(attempt_id: str | None) -> tuple[str, ...]:
    """What a span read must see: the spans, and for ``"latest"`` the attempts too (the latest
    attempt is looked up in the attempts table, which must hold what this client was told)."""
    return ("spans", "rollout-state") if attempt_id == "latest" else ("spans",)
