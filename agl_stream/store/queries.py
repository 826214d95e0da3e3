"""The store's reads as SQL: pure builders of (SQL, bound parameters), and row -> model mappers.

No I/O here. Every value a caller passes travels as a server-side bound parameter
(clickhouse-connect's ``{name:Type}`` syntax), never as SQL text; identifiers (database, the
sort column) come from a fixed set. Run the queries through a
:class:`agl_stream.store.readside.ReadSide` and map the rows back with the ``*_from_row``
functions.

The filter, sort and paging semantics are the LightningStore contract's (query_rollouts,
query_attempts, query_spans, query_resources, query_workers):

- filters that are None are not applied; the given ones are combined with ``filter_logic``
  ("and"/"or"); an empty ``*_in`` list matches nothing; ``*_contains`` is a case-sensitive
  substring match; no filter at all matches everything;
- ``sort_by`` must name a numeric or string field of the returned model (ValueError
  otherwise); ties, and the default order, fall back to the entity's key, so paging is stable;
  NULLs sort last;
- ``limit=-1`` means no limit; ``offset`` skips rows.

State tables are ReplacingMergeTrees and are always read with FINAL; WHERE applies after FINAL
merges the versions, so a filter never matches an outdated version of a row. Their times are
DateTime64 columns, selected as the float seconds the models hold (agl_stream/clickhouse/times.py).
"""

from __future__ import annotations

import json
import re
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel

from agl_stream.clickhouse import times
from agl_stream.models import Attempt, ResourcesUpdate, Rollout, Span, Worker

FilterLogic = Literal["and", "or"]
SortOrder = Literal["asc", "desc"]

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SCALARS = (int, float, str)

ROLLOUT_COLUMNS = (
    "rollout_id",
    "input",
    "start_time",
    "end_time",
    "mode",
    "resources_id",
    "status",
    "config",
    "metadata",
)
ATTEMPT_COLUMNS = (
    "rollout_id",
    "attempt_id",
    "sequence_id",
    "start_time",
    "end_time",
    "status",
    "worker_id",
    "last_heartbeat_time",
    "metadata",
)
RESOURCES_COLUMNS = ("resources_id", "create_time", "update_time", "version", "resources")
WORKER_COLUMNS = (
    "worker_id",
    "status",
    "heartbeat_stats",
    "last_heartbeat_time",
    "last_dequeue_time",
    "last_busy_time",
    "last_idle_time",
    "current_rollout_id",
    "current_attempt_id",
)
STATISTICS_COLUMNS = ("total_rollouts", "total_attempts", "total_spans", "total_resources", "total_workers")

# Span fields -> otel_traces columns. Times come from SpanJson: Timestamp turns a missing
# start_time into 1970, and there is no end_time column (Duration is 0 for open spans).
_SPAN_SORT_COLUMNS = {
    "rollout_id": "RolloutId",
    "attempt_id": "AttemptId",
    "sequence_id": "SequenceId",
    "trace_id": "TraceId",
    "span_id": "SpanId",
    "parent_id": "ParentSpanId",
    "name": "SpanName",
    "kind": "SpanKind",
    "scope_name": "ScopeName",
    "scope_version": "ScopeVersion",
    "start_time": "JSONExtract(SpanJson, 'start_time', 'Nullable(Float64)')",
    "end_time": "JSONExtract(SpanJson, 'end_time', 'Nullable(Float64)')",
}


@dataclass(frozen=True)
class Query:
    """SQL with ``{name:Type}`` placeholders and the values bound to them."""

    sql: str
    parameters: dict[str, Any] = field(default_factory=dict)


def _is_scalar(annotation: Any) -> bool:
    origin = get_origin(annotation)
    if origin is Annotated:
        return _is_scalar(get_args(annotation)[0])
    if origin is Literal:
        return all(isinstance(arg, _SCALARS) for arg in get_args(annotation))
    if origin is Union or origin is types.UnionType:
        options = [arg for arg in get_args(annotation) if arg is not type(None)]
        return bool(options) and all(_is_scalar(arg) for arg in options)
    return annotation in _SCALARS


def sortable_fields(model: type[BaseModel]) -> frozenset[str]:
    """The fields of ``model`` holding a number or a string (or None): what sort_by accepts."""
    return frozenset(name for name, info in model.model_fields.items() if _is_scalar(info.annotation))


_SORTABLE: dict[type[BaseModel], frozenset[str]] = {
    model: sortable_fields(model) for model in (Rollout, Attempt, Span, ResourcesUpdate, Worker)
}


def _sort_column(model: type[BaseModel], sort_by: str) -> str:
    if sort_by not in _SORTABLE[model]:
        raise ValueError(
            f"cannot sort {model.__name__} by {sort_by!r}: "
            f"choose one of its number or string fields {sorted(_SORTABLE[model])}"
        )
    return sort_by


def _order_by(column: str | None, sort_order: SortOrder, key: Sequence[str]) -> str:
    if sort_order not in ("asc", "desc"):
        raise ValueError(f"sort_order must be 'asc' or 'desc', not {sort_order!r}")
    terms = [] if column is None else [f"{column} {sort_order.upper()} NULLS LAST"]
    terms += [k for k in key if k != column]
    return "ORDER BY " + ", ".join(terms)


def _page(limit: int, offset: int, parameters: dict[str, Any]) -> str:
    if limit < -1:
        raise ValueError(f"limit must be -1 (no limit) or >= 0, not {limit}")
    if offset < 0:
        raise ValueError(f"offset must be >= 0, not {offset}")
    clauses = []
    if limit != -1:
        parameters["limit"] = limit
        clauses.append("LIMIT {limit:UInt64}")
    if offset:
        parameters["offset"] = offset
        clauses.append("OFFSET {offset:UInt64}")
    return " ".join(clauses)


def _combine(filter_logic: FilterLogic, *conditions: str | None) -> str | None:
    """The filters given (not None) combined with ``filter_logic``; None when none is."""
    if filter_logic not in ("and", "or"):
        raise ValueError(f"filter_logic must be 'and' or 'or', not {filter_logic!r}")
    present = [c for c in conditions if c]
    return "(" + f" {filter_logic.upper()} ".join(present) + ")" if present else None


def _where(*conditions: str | None) -> str:
    present = [c for c in conditions if c]
    return "WHERE " + " AND ".join(present) if present else ""


def _in(column: str, name: str, values: Sequence[str] | None, parameters: dict[str, Any]) -> str | None:
    if values is None:
        return None
    if not values:
        return "0"  # an empty whitelist matches nothing
    parameters[name] = list(values)
    return f"{column} IN {{{name}:Array(String)}}"


def _contains(column: str, name: str, value: str | None, parameters: dict[str, Any]) -> str | None:
    if value is None:
        return None
    parameters[name] = value
    return f"position({column}, {{{name}:String}}) > 0"


def _equals(column: str, name: str, value: str | None, parameters: dict[str, Any]) -> str | None:
    if value is None:
        return None
    parameters[name] = value
    return f"{column} = {{{name}:String}}"


def _sql(*parts: str) -> str:
    return "\n".join(p for p in parts if p)


class StoreQueries:
    """Builders for one database's tables (``Settings.clickhouse_database``)."""

    def __init__(self, database: str = "agl") -> None:
        if not _IDENTIFIER.match(database):
            raise ValueError(f"not a database name: {database!r}")
        self.db = database

    def _select(self, columns: Sequence[str], table: str, *clauses: str) -> str:
        """``SELECT columns FROM table FINAL`` (times as float seconds) and the clauses given
        (empty ones left out)."""
        return _sql(f"SELECT {times.select(columns)} FROM {self.db}.{table} FINAL", *clauses)

    # -- rollouts and attempts -----------------------------------------------------------

    def rollouts(
        self,
        *,
        status_in: Sequence[str] | None = None,
        rollout_id_in: Sequence[str] | None = None,
        rollout_id_contains: str | None = None,
        filter_logic: FilterLogic = "and",
        sort_by: str | None = None,
        sort_order: SortOrder = "asc",
        limit: int = -1,
        offset: int = 0,
    ) -> Query:
        """query_rollouts; the deprecated ``status``/``rollout_ids`` are the caller's to map."""
        p: dict[str, Any] = {}
        filters = _combine(
            filter_logic,
            _in("status", "status_in", status_in, p),
            _in("rollout_id", "rollout_id_in", rollout_id_in, p),
            _contains("rollout_id", "rollout_id_contains", rollout_id_contains, p),
        )
        column = None if sort_by is None else _sort_column(Rollout, sort_by)
        # Default: enqueue order, the order the contract's in-memory store returns.
        order = _order_by(column, sort_order, ("rollout_id",) if column else ("start_time", "rollout_id"))
        return Query(self._select(ROLLOUT_COLUMNS, "rollouts", _where(filters), order, _page(limit, offset, p)), p)

    def rollout_by_id(self, rollout_id: str) -> Query:
        where = "WHERE rollout_id = {rollout_id:String}"
        return Query(self._select(ROLLOUT_COLUMNS, "rollouts", where), {"rollout_id": rollout_id})

    def attempts(
        self,
        rollout_id: str,
        *,
        sort_by: str | None = "sequence_id",
        sort_order: SortOrder = "asc",
        limit: int = -1,
        offset: int = 0,
    ) -> Query:
        p: dict[str, Any] = {"rollout_id": rollout_id}
        column = _sort_column(Attempt, sort_by or "sequence_id")
        order = _order_by(column, sort_order, ("sequence_id",))
        where = "WHERE rollout_id = {rollout_id:String}"
        return Query(self._select(ATTEMPT_COLUMNS, "attempts", where, order, _page(limit, offset, p)), p)

    def latest_attempts(self, rollout_ids: Sequence[str]) -> Query:
        """The attempt with the highest sequence_id of each of these rollouts (those that have one)."""
        return Query(
            self._select(
                ATTEMPT_COLUMNS,
                "attempts",
                "WHERE rollout_id IN {rollout_ids:Array(String)}",
                "ORDER BY rollout_id, sequence_id DESC LIMIT 1 BY rollout_id",
            ),
            {"rollout_ids": list(rollout_ids)},
        )

    # -- Agent Lightning 1.0's rollouts (agl_stream/domain/agl_v1.py) -------------------------

    def _v1(self, select: str, *where: str) -> str:
        """1.0 rollouts (store rollouts whose metadata holds ``agentlightning_v1``) with the
        metadata of their attempt "0" (``attempt_metadata``) and their 1.0 state (``v1_state``)."""
        return _sql(
            f"SELECT {select} FROM (",
            f"  SELECT {times.select(ROLLOUT_COLUMNS, 'r')}, r.finished_time AS finished_time,",
            "    a.metadata AS attempt_metadata,",
            "    multiIf(r.status = 'succeeded', 'succeeded', r.status IN ('failed', 'cancelled'), 'failed',",
            "      JSONExtractString(ifNull(a.metadata, ''), 'agentlightning_v1', 'state') = 'running', 'running',",
            "      'queuing') AS v1_state",
            f"  FROM {self.db}.rollouts AS r FINAL",
            f"  LEFT JOIN (SELECT rollout_id, metadata FROM {self.db}.attempts FINAL WHERE attempt_id = '0') AS a",
            "    ON a.rollout_id = r.rollout_id",
            "  WHERE JSONHas(ifNull(r.metadata, ''), 'agentlightning_v1')",
            ")",
            *where,
        )

    def v1_rollouts(
        self, *, rollout_ids: Sequence[str] | None = None, states: Sequence[str] | None = None, limit: int = -1
    ) -> Query:
        """1.0 rollouts by id or by 1.0 state, oldest first."""
        where: list[str] = []
        p: dict[str, Any] = {}
        if rollout_ids is not None:
            where.append("rollout_id IN {rollout_ids:Array(String)}")
            p["rollout_ids"] = list(rollout_ids)
        if states is not None:
            where.append("v1_state IN {states:Array(String)}")
            p["states"] = list(states)
        return Query(
            self._v1(
                f"{', '.join(ROLLOUT_COLUMNS)}, attempt_metadata",
                f"WHERE {' AND '.join(where)}" if where else "",
                "ORDER BY start_time, rollout_id",
                _page(limit, 0, p),
            ),
            p,
        )

    def v1_terminal(self, *, after: int, limit: int) -> Query:
        """1.0 rollouts that finished, in the order they finished, from position ``after``."""
        p: dict[str, Any] = {}
        sql = self._v1(
            "rollout_id, v1_state, mode, input",
            "WHERE v1_state IN ('succeeded', 'failed')",
            "ORDER BY finished_time, rollout_id",
            _page(limit, after, p),
        )
        return Query(sql, p)

    def v1_terminal_total(self) -> Query:
        return Query(self._v1("count() AS total", "WHERE v1_state IN ('succeeded', 'failed')"))

    # -- spans ---------------------------------------------------------------------------

    def spans(
        self,
        rollout_id: str,
        attempt_id: str | None = None,
        *,
        trace_id: str | None = None,
        trace_id_contains: str | None = None,
        span_id: str | None = None,
        span_id_contains: str | None = None,
        parent_id: str | None = None,
        parent_id_contains: str | None = None,
        name: str | None = None,
        name_contains: str | None = None,
        filter_logic: FilterLogic = "and",
        limit: int = -1,
        offset: int = 0,
        sort_by: str | None = "sequence_id",
        sort_order: SortOrder = "asc",
    ) -> Query:
        """query_spans: one column, SpanJson (see :func:`span_from_row`).

        ``attempt_id``: None for every attempt, ``"latest"`` for the one with the highest
        sequence_id in the attempts table, or an id. ``rollout_id`` and the attempt always
        apply (AND); the other filters combine with ``filter_logic``.
        """
        p: dict[str, Any] = {"rollout_id": rollout_id}
        if attempt_id == "latest":
            attempt = (
                "AttemptId = (SELECT argMax(attempt_id, sequence_id) "
                f"FROM {self.db}.attempts FINAL WHERE rollout_id = {{rollout_id:String}})"
            )
        else:
            attempt = _equals("AttemptId", "attempt_id", attempt_id, p) or ""
        filters = _combine(
            filter_logic,
            _equals("TraceId", "trace_id", trace_id, p),
            _contains("TraceId", "trace_id_contains", trace_id_contains, p),
            _equals("SpanId", "span_id", span_id, p),
            _contains("SpanId", "span_id_contains", span_id_contains, p),
            _equals("ParentSpanId", "parent_id", parent_id, p),
            _contains("ParentSpanId", "parent_id_contains", parent_id_contains, p),
            _equals("SpanName", "name", name, p),
            _contains("SpanName", "name_contains", name_contains, p),
        )
        column = _SPAN_SORT_COLUMNS[_sort_column(Span, sort_by or "sequence_id")]
        where = _where("RolloutId = {rollout_id:String}", attempt, filters)
        order = _order_by(column, sort_order, ("AttemptId", "SequenceId", "SpanId"))
        return Query(self._select(("SpanJson",), "otel_traces", where, order, _page(limit, offset, p)), p)

    # -- resources -----------------------------------------------------------------------

    def resources(
        self,
        *,
        resources_id: str | None = None,
        resources_id_contains: str | None = None,
        sort_by: str | None = None,
        sort_order: SortOrder = "asc",
        limit: int = -1,
        offset: int = 0,
    ) -> Query:
        """query_resources: both filters apply (the contract has no filter_logic here)."""
        p: dict[str, Any] = {}
        where = _where(
            _equals("resources_id", "resources_id", resources_id, p),
            _contains("resources_id", "resources_id_contains", resources_id_contains, p),
        )
        column = None if sort_by is None else _sort_column(ResourcesUpdate, sort_by)
        order = _order_by(column, sort_order, ("resources_id",) if column else ("create_time", "resources_id"))
        return Query(self._select(RESOURCES_COLUMNS, "resources", where, order, _page(limit, offset, p)), p)

    def resources_by_id(self, resources_id: str) -> Query:
        where = "WHERE resources_id = {resources_id:String}"
        return Query(self._select(RESOURCES_COLUMNS, "resources", where), {"resources_id": resources_id})

    def latest_resources(self) -> Query:
        """The snapshot written last (add or update): the highest offset of the one partition."""
        return Query(self._select(RESOURCES_COLUMNS, "resources", "ORDER BY kafka_offset DESC LIMIT 1"))

    # -- workers -------------------------------------------------------------------------

    def _workers_derived(self, worker_id: str | None, p: dict[str, Any]) -> str:
        """One row per worker seen in a heartbeat or on an attempt, with status derived.

        A worker with attempts takes status, assignment and activity times from them: its
        latest attempt (by start time, then last activity) succeeded|failed -> idle,
        unresponsive|timeout -> unknown, otherwise busy (and assigned to it);
        last_dequeue_time is its latest attempt start, last_busy_time its latest activity on
        any attempt, last_idle_time the latest end of an attempt that succeeded or failed. A
        claim that found nothing (the client writes an "idle" record with the claim's time as
        last_dequeue_time) makes it idle, unassigned, with that record's dequeue and idle
        times, while that claim is newer than its latest attempt's start, as the seed's stores
        do; it still names the attempt it last ran if that never finished, and its idle time
        is that attempt's end if it succeeded or failed (the record's own time otherwise): the
        record is written without a read, so these come from the attempts here. A worker
        without attempts is what its last heartbeat says (status "unknown" if none).
        heartbeat_stats and last_heartbeat_time always come from the heartbeat.
        """
        hb_where = att_where = ""
        start, end, heartbeat = (times.seconds(c) for c in ("start_time", "end_time", "last_heartbeat_time"))
        if worker_id is not None:
            p["worker_id"] = worker_id
            hb_where = "WHERE worker_id = {worker_id:String}"
            att_where = "AND worker_id = {worker_id:String}"
        return f"""
SELECT
    worker_id,
    attempts = 0 OR (ifNull(hb_status, '') = 'idle' AND ifNull(hb_dequeue_time, 0) > at_dequeue_time) AS as_recorded,
    multiIf(attempts = 0, ifNull(hb_status, 'unknown'),
            as_recorded, 'idle',
            latest.3 IN ('succeeded', 'failed'), 'idle',
            latest.3 IN ('unresponsive', 'timeout'), 'unknown',
            'busy') AS status,
    heartbeat_stats,
    last_heartbeat_time,
    if(as_recorded, hb_dequeue_time, at_dequeue_time) AS last_dequeue_time,
    if(attempts = 0, hb_busy_time, at_busy_time) AS last_busy_time,
    if(as_recorded, if(attempts > 0 AND latest.3 IN ('succeeded', 'failed'), at_idle_time, hb_idle_time),
       at_idle_time) AS last_idle_time,
    attempts > 0 AND latest.3 NOT IN ('succeeded', 'failed', 'unresponsive', 'timeout') AS unfinished,
    if(as_recorded, if(attempts > 0, if(unfinished, latest.1, NULL), hb_rollout_id),
       if(status = 'busy', latest.1, NULL)) AS current_rollout_id,
    if(as_recorded, if(attempts > 0, if(unfinished, latest.2, NULL), hb_attempt_id),
       if(status = 'busy', latest.2, NULL)) AS current_attempt_id
FROM (
    SELECT
        worker_id,
        anyIf(status, is_heartbeat) AS hb_status,
        anyIf(stats, is_heartbeat) AS heartbeat_stats,
        anyIf(heartbeat_time, is_heartbeat) AS last_heartbeat_time,
        anyIf(dequeue_time, is_heartbeat) AS hb_dequeue_time,
        anyIf(busy_time, is_heartbeat) AS hb_busy_time,
        anyIf(idle_time, is_heartbeat) AS hb_idle_time,
        anyIf(rollout_id, is_heartbeat) AS hb_rollout_id,
        anyIf(attempt_id, is_heartbeat) AS hb_attempt_id,
        countIf(NOT is_heartbeat) AS attempts,
        argMaxIf((rollout_id, attempt_id, status), (dequeue_time, busy_time), NOT is_heartbeat) AS latest,
        maxIf(dequeue_time, NOT is_heartbeat) AS at_dequeue_time,
        maxIf(busy_time, NOT is_heartbeat) AS at_busy_time,
        maxIf(idle_time, NOT is_heartbeat AND status IN ('succeeded', 'failed')) AS at_idle_time
    FROM (
        -- heartbeats: the row as the worker wrote it
        SELECT worker_id, 1 AS is_heartbeat, CAST(status, 'Nullable(String)') AS status,
               heartbeat_stats AS stats, {times.seconds("last_heartbeat_time")} AS heartbeat_time,
               {times.seconds("last_dequeue_time")} AS dequeue_time, {times.seconds("last_busy_time")} AS busy_time,
               {times.seconds("last_idle_time")} AS idle_time,
               current_rollout_id AS rollout_id, current_attempt_id AS attempt_id
        FROM {self.db}.workers FINAL
        {hb_where}
        UNION ALL
        -- attempts: dequeue_time = start, busy_time = last activity, idle_time = end
        SELECT assumeNotNull(worker_id), 0, CAST(status, 'Nullable(String)'),
               NULL, NULL,
               {start}, greatest({start}, ifNull({heartbeat}, 0), ifNull({end}, 0)), {end},
               rollout_id, attempt_id
        FROM {self.db}.attempts FINAL
        WHERE ifNull(worker_id, '') != '' {att_where}
    )
    GROUP BY worker_id
)"""

    def workers(
        self,
        *,
        status_in: Sequence[str] | None = None,
        worker_id_contains: str | None = None,
        filter_logic: FilterLogic = "and",
        sort_by: str | None = None,
        sort_order: SortOrder = "asc",
        limit: int = -1,
        offset: int = 0,
    ) -> Query:
        p: dict[str, Any] = {}
        derived = self._workers_derived(None, p)
        filters = _combine(
            filter_logic,
            _in("status", "status_in", status_in, p),
            _contains("worker_id", "worker_id_contains", worker_id_contains, p),
        )
        column = None if sort_by is None else _sort_column(Worker, sort_by)
        order = _order_by(column, sort_order, ("worker_id",))
        select = f"SELECT {', '.join(WORKER_COLUMNS)} FROM ({derived}\n)"
        return Query(_sql(select, _where(filters), order, _page(limit, offset, p)), p)

    def worker_by_id(self, worker_id: str) -> Query:
        p: dict[str, Any] = {}
        derived = self._workers_derived(worker_id, p)
        return Query(f"SELECT {', '.join(WORKER_COLUMNS)} FROM ({derived}\n)", p)

    # -- statistics ----------------------------------------------------------------------

    def statistics(self) -> Query:
        """Counts of the statistics() contract; workers counted as query_workers lists them."""
        db = self.db
        return Query(
            _sql(
                "SELECT",
                f"    (SELECT count() FROM {db}.rollouts FINAL) AS total_rollouts,",
                f"    (SELECT count() FROM {db}.attempts FINAL) AS total_attempts,",
                f"    (SELECT count() FROM {db}.otel_traces FINAL) AS total_spans,",
                f"    (SELECT count() FROM {db}.resources FINAL) AS total_resources,",
                f"    (SELECT uniqExact(worker_id) FROM (SELECT worker_id FROM {db}.workers FINAL UNION ALL",
                f"        SELECT assumeNotNull(worker_id) FROM {db}.attempts FINAL WHERE ifNull(worker_id, '') != ''))",
                "        AS total_workers",
            )
        )


def count_of(query: Query) -> Query:
    """How many rows ``query`` (unpaged) gives: one row with the column ``total``."""
    return Query(f"SELECT count() AS total FROM (\n{query.sql}\n)", query.parameters)


# -- rows -> models ------------------------------------------------------------------------


def _json(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def rollout_from_row(row: Mapping[str, Any]) -> Rollout:
    return Rollout.model_validate(
        {
            **{k: row[k] for k in ("rollout_id", "start_time", "end_time", "mode", "resources_id", "status")},
            "input": json.loads(row["input"]),
            "config": json.loads(row["config"]),
            "metadata": _json(row["metadata"]),
        }
    )


def attempt_from_row(row: Mapping[str, Any]) -> Attempt:
    return Attempt.model_validate({**{k: row[k] for k in ATTEMPT_COLUMNS}, "metadata": _json(row["metadata"])})


def span_from_row(row: Mapping[str, Any]) -> Span:
    return Span.model_validate_json(row["SpanJson"])


def resources_from_row(row: Mapping[str, Any]) -> ResourcesUpdate:
    return ResourcesUpdate.model_validate(
        {**{k: row[k] for k in RESOURCES_COLUMNS}, "resources": json.loads(row["resources"])}
    )


def worker_from_row(row: Mapping[str, Any]) -> Worker:
    return Worker.model_validate(
        {**{k: row[k] for k in WORKER_COLUMNS}, "heartbeat_stats": _json(row["heartbeat_stats"])}
    )


def total_from_row(row: Mapping[str, Any]) -> int:
    return int(row["total"])


def statistics_from_row(row: Mapping[str, Any]) -> dict[str, int]:
    return {name: int(row[name]) for name in STATISTICS_COLUMNS}
