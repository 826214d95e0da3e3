"""The dashboard's pure core: the fixed SQL it runs, its filters, and the span waterfall layout.

No I/O here (consumers/dashboard.py runs what this builds). Every value a visitor types reaches
ClickHouse as a bound query parameter (``{name:Type}``), never pasted into the SQL text; the only
text pasted in is the database name, a setting of the gateway. Filters are pydantic models, so a
bad value is a typed 400 before any SQL is built. Times (DateTime64 columns) are selected as
float seconds since the epoch, which the page's code formats.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from agl_stream.clickhouse import times
from agl_stream.models.base import RolloutStatus
from agl_stream.models.rollouts import WORKER_STOPPED

MAX_PAGE = 500
"""Rows of one rollouts page: a page is read by a person."""

MAX_SPANS = 5000
"""Spans one waterfall draws; an attempt with more is cut (the page says so)."""

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _db(database: str) -> str:
    # The database name is a setting, not input; still, nothing but an identifier is pasted in.
    if not _IDENT.match(database):
        raise ValueError(f"not a database name: {database!r}")
    return database


@dataclass(frozen=True)
class Query:
    """One statement with its bound parameters."""

    sql: str
    parameters: dict[str, Any]


# -- rollouts: filters and paging -------------------------------------------------------------


RolloutSort = Literal["rollout_id", "status", "mode", "policy_version", "group_id", "start_time", "took", "reward"]
"""The rollouts table's sortable columns (a header click): the page's column names."""

SortOrder = Literal["asc", "desc"]

_ROLLOUT_ORDER: dict[str, str] = {
    "rollout_id": "rollout_id",
    "status": "status",
    "mode": "mode",
    "policy_version": "policy_version",
    "group_id": "group_id",
    "start_time": "start_time",
    "took": "end_time - start_time",
    "reward": "reward",
}
"""What each sortable column orders by: expressions over the page query's own columns (the
whitelist: a sort is a name looked up here, never SQL from the visitor). Unknown values (a
rollout still running, one without a reward) sort last either way."""


class RolloutFilter(BaseModel):
    """The rollouts table's filters, sort and page, as the page sends them in its query string."""

    model_config = ConfigDict(extra="forbid")

    status: RolloutStatus | None = None
    mode: str | None = Field(None, min_length=1, max_length=64)
    policy_version: int | None = Field(None, ge=-1, le=2**62)
    group_id: str | None = Field(None, min_length=1, max_length=256)
    since: float | None = Field(None, ge=0, description="Enqueued at or after (Unix seconds).")
    until: float | None = Field(None, ge=0, description="Enqueued before (Unix seconds).")
    limit: int = Field(50, ge=1, le=MAX_PAGE)
    offset: int = Field(0, ge=0, le=10**9)
    sort: RolloutSort = Field("start_time", description="The column the page is ordered by.")
    order: SortOrder = "desc"

    @field_validator("mode", "group_id", "status", mode="before")
    @classmethod
    def _blank_is_none(cls, value: Any) -> Any:
        return None if isinstance(value, str) and not value.strip() else value


_ROLLOUT_CONDITIONS = {
    "status": "status = {status:String}",
    "mode": "mode = {mode:String}",
    "policy_version": "policy_version = {policy_version:Int64}",
    # The group id is the task's metadata (GRPO groups); the rollout id is tried as well so
    # that one box finds a rollout by id.
    "group_id": "(JSONExtractString(ifNull(metadata, ''), 'group_id') = {group_id:String}"
    " OR rollout_id = {group_id:String})",
    "since": "start_time >= {since:Float64}",
    "until": "start_time < {until:Float64}",
}
"""Each filter of :class:`RolloutFilter` (its field name) -> its WHERE condition."""


def rollout_conditions(f: RolloutFilter) -> tuple[list[str], dict[str, Any]]:
    """The WHERE conditions of ``f`` and their parameters (values are bound, never pasted)."""
    params = {name: value for name in _ROLLOUT_CONDITIONS if (value := getattr(f, name)) is not None}
    return [_ROLLOUT_CONDITIONS[name] for name in params], params


def rollouts_page(database: str, f: RolloutFilter) -> tuple[Query, Query]:
    """The page of rollouts ``f`` asks for (newest first unless it sorts by another column), each
    with its reward (its latest attempt's final reward, from that attempt's triplet record), and
    the count of all that match. Ties are broken by rollout id, in the same direction."""
    db = _db(database)
    where, params = rollout_conditions(f)
    clause = f"WHERE {' AND '.join(where)}" if where else ""
    direction = "ASC" if f.order == "asc" else "DESC"
    page = Query(
        f"SELECT r.rollout_id AS rollout_id, r.status AS status, r.mode AS mode, r.policy_version AS policy_version, "
        f"{times.select(('start_time', 'end_time'), 'r')}, r.group_id AS group_id, r.input AS input, "
        "lr.final_reward AS reward "
        "FROM (SELECT rollout_id, status, mode, policy_version, start_time, end_time, "
        "JSONExtractString(ifNull(metadata, ''), 'group_id') AS group_id, substring(input, 1, 160) AS input "
        f"FROM {db}.rollouts FINAL {clause}) AS r "
        f"LEFT JOIN ({latest_attempt_rewards(db)}) AS lr ON lr.rollout_id = r.rollout_id "
        f"ORDER BY {_ROLLOUT_ORDER[f.sort]} {direction}, rollout_id {direction} "
        "LIMIT {limit:UInt32} OFFSET {offset:UInt64}",
        {**params, "limit": f.limit, "offset": f.offset},
    )
    count = Query(f"SELECT count() AS n FROM {db}.rollouts FINAL {clause}", dict(params))
    return page, count


def latest_attempt_rewards(database: str) -> str:
    """SQL of ``(rollout_id, attempt_id, final_reward)``: each rollout's latest attempt (highest
    sequence id) with the final reward of its triplet record, for the rollouts whose latest attempt
    has one (the triplet builder writes one per finished attempt; NULL when it found no reward)."""
    db = _db(database)
    return (
        "SELECT a.rollout_id AS rollout_id, a.attempt_id AS attempt_id, tr.final_reward AS final_reward "
        f"FROM (SELECT rollout_id, argMax(attempt_id, sequence_id) AS attempt_id FROM {db}.attempts FINAL "
        "GROUP BY rollout_id) AS a "
        f"INNER JOIN (SELECT attempt_id, final_reward FROM {db}.triplet_records FINAL) AS tr "
        "ON tr.attempt_id = a.attempt_id"
    )


# -- one rollout -------------------------------------------------------------------------------


def rollout_detail(database: str, rollout_id: str) -> dict[str, Query]:
    """The rollout, its attempts (with their final reward and span counts) and its triplets."""
    db = _db(database)
    p = {"rollout_id": rollout_id}
    return {
        "rollout": Query(
            "SELECT rollout_id, status, mode, policy_version, resources_id, "
            f"{times.select(('start_time', 'end_time'))}, input, config, "
            f"metadata FROM {db}.rollouts FINAL WHERE rollout_id = {{rollout_id:String}}",
            p,
        ),
        "attempts": Query(
            "SELECT a.attempt_id AS attempt_id, a.sequence_id AS sequence_id, a.status AS status, "
            "a.worker_id AS worker_id, a.policy_version AS policy_version, "
            f"{times.select(('start_time', 'end_time'), 'a')}, "
            "tr.final_reward AS final_reward, tr.n_triplets AS n_triplets, "
            "s.spans AS spans, s.errors AS errors "
            f"FROM (SELECT * FROM {db}.attempts FINAL WHERE rollout_id = {{rollout_id:String}}) AS a "
            "LEFT JOIN (SELECT attempt_id, final_reward, n_triplets "
            f"FROM {db}.triplet_records FINAL WHERE rollout_id = {{rollout_id:String}}) AS tr "
            "ON tr.attempt_id = a.attempt_id "
            "LEFT JOIN (SELECT AttemptId, count() AS spans, countIf(IsError = 1) AS errors "
            f"FROM {db}.span_facts FINAL WHERE RolloutId = {{rollout_id:String}} GROUP BY AttemptId) AS s "
            "ON s.AttemptId = a.attempt_id ORDER BY sequence_id",
            p,
        ),
        "triplets": Query(
            "SELECT attempt_id, triplet_index, prompt_tokens, response_tokens, reward, final_reward, mode, "
            f"policy_version FROM {db}.triplets FINAL WHERE rollout_id = {{rollout_id:String}} "
            "ORDER BY attempt_id, triplet_index",
            p,
        ),
    }


def attempt_spans(database: str, rollout_id: str, attempt_id: str) -> Query:
    """An attempt's spans (the table's sort key starts with these two columns: a range read)."""
    db = _db(database)
    return Query(
        "SELECT SpanId, ParentSpanId, SpanName, toUnixTimestamp64Nano(Timestamp) AS start_ns, Duration, "
        "StatusCode, StatusMessage, SpanAttributes, Events.Name AS event_names, "
        "Events.Attributes AS event_attributes "
        f"FROM {db}.otel_traces FINAL "
        "WHERE RolloutId = {rollout_id:String} AND AttemptId = {attempt_id:String} "
        f"ORDER BY Timestamp, SequenceId LIMIT {MAX_SPANS + 1}",
        {"rollout_id": rollout_id, "attempt_id": attempt_id},
    )


@dataclass(frozen=True)
class SpanRow:
    span_id: str
    parent_id: str
    name: str
    start_ns: int
    duration_ns: int
    status: str = ""


def waterfall(spans: Sequence[SpanRow]) -> list[dict[str, Any]]:
    """The spans in tree order (each after its parent, siblings by start time) with their depth
    and bar position: ``left`` and ``width`` as fractions of the attempt's time span.

    A span whose parent is not among ``spans`` (the parent was never sent, or belongs to another
    service) is a root; a parent cycle (bad data) cannot loop: every span is placed once.
    """
    if not spans:
        return []
    ids = {s.span_id for s in spans}
    children: dict[str, list[SpanRow]] = {}
    roots: list[SpanRow] = []
    for span in spans:
        if span.parent_id and span.parent_id in ids and span.parent_id != span.span_id:
            children.setdefault(span.parent_id, []).append(span)
        else:
            roots.append(span)
    start = min(s.start_ns for s in spans)
    end = max(s.start_ns + s.duration_ns for s in spans)
    total = max(end - start, 1)
    placed: list[dict[str, Any]] = []
    seen: set[str] = set()

    def order(rows: Iterable[SpanRow]) -> list[SpanRow]:
        return sorted(rows, key=lambda s: (s.start_ns, s.name, s.span_id))

    stack: list[tuple[SpanRow, int]] = [(s, 0) for s in reversed(order(roots))]
    while stack:
        span, depth = stack.pop()
        if span.span_id in seen:
            continue
        seen.add(span.span_id)
        placed.append(_bar(span, depth, start, total))
        stack.extend((c, depth + 1) for c in reversed(order(children.get(span.span_id, ()))))
    # Spans only reachable through a cycle were never pushed: place them as roots, in time order.
    for span in order(s for s in spans if s.span_id not in seen):
        seen.add(span.span_id)
        placed.append(_bar(span, 0, start, total))
    return placed


def _bar(span: SpanRow, depth: int, start: int, total: int) -> dict[str, Any]:
    return {
        "span_id": span.span_id,
        "parent_id": span.parent_id,
        "name": span.name,
        "depth": depth,
        "start_ms": (span.start_ns - start) / 1e6,
        "duration_ms": span.duration_ns / 1e6,
        "left": (span.start_ns - start) / total,
        "width": span.duration_ns / total,
        "status": span.status,
    }


# -- one policy version: its lineage ---------------------------------------------------------------

MAX_LINEAGE = 2000
"""Rows (one per LLM-call span) the version page lists; a version trained on more is cut."""

TRAINED_BY_VERSION = """\
WITH trained AS (
    SELECT batch_id, sample_index, rollout_id, attempt_id, span_ids
    FROM {db}.batch_samples FINAL
    WHERE batch_id IN (SELECT batch_id FROM {db}.trainer_steps FINAL WHERE policy_version = {version:Int64})
)
SELECT t.batch_id AS batch_id, t.sample_index AS sample_index, t.rollout_id AS rollout_id,
       t.attempt_id AS attempt_id, call_index, t.span_ids[call_index] AS span_id, o.TraceId AS trace_id
FROM trained AS t
ARRAY JOIN arrayEnumerate(t.span_ids) AS call_index
LEFT JOIN (SELECT RolloutId, AttemptId, SpanId, TraceId FROM {db}.otel_traces FINAL
           WHERE (RolloutId, AttemptId) IN (SELECT rollout_id, attempt_id FROM trained)) AS o
    ON o.RolloutId = t.rollout_id AND o.AttemptId = t.attempt_id AND o.SpanId = span_id
ORDER BY batch_id, sample_index, call_index"""
"""Which traces trained policy version ``{version}``: one row per LLM-call span of every sample of
the batches whose trainer step made that version, with its trace id ('' when the span is not in
otel_traces). docs/sql.md's cookbook has this query with ``agl`` and a literal version."""


class VersionParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=0, le=2**62)


def trained_by_version(database: str) -> str:
    """:data:`TRAINED_BY_VERSION` for ``database``, the version left as a bound parameter."""
    return TRAINED_BY_VERSION.replace("{db}", _db(database))


def version_lineage(database: str, version: int) -> dict[str, Query]:
    """What trained policy ``version``: its trainer steps, their batches, the attempts (rollouts)
    whose samples were in them with their span counts, and the spans themselves (cut at
    :data:`MAX_LINEAGE`, one row more to tell)."""
    db = _db(database)
    p = {"version": version}
    in_version = f"batch_id IN (SELECT batch_id FROM {db}.trainer_steps FINAL WHERE policy_version = {{version:Int64}})"
    return {
        "steps": Query(
            f"SELECT batch_id, {times.select(('step_time',))}, "
            "step_seconds, samples, tokens, staleness, min_policy_version, "
            "metrics['loss'] AS loss, metrics['reward_mean'] AS reward "
            f"FROM {db}.trainer_steps FINAL WHERE policy_version = {{version:Int64}} ORDER BY step_time",
            p,
        ),
        "batches": Query(
            f"SELECT batch_id, {times.select(('created_time',))}, "
            "n_records, n_triplets, n_tokens, min_policy_version, max_policy_version, "
            f"mean_final_reward FROM {db}.batches FINAL WHERE {in_version} ORDER BY created_time, batch_id",
            p,
        ),
        "attempts": Query(
            "SELECT rollout_id, attempt_id, any(batch_id) AS batch_id, any(group_id) AS group_id, "
            "any(policy_version) AS served_version, count() AS samples, sum(length(span_ids)) AS spans, "
            "sum(response_tokens) AS response_tokens, any(final_reward) AS final_reward "
            # Filtered in a subquery: outside, batch_id is the aggregate's alias.
            f"FROM (SELECT * FROM {db}.batch_samples FINAL WHERE {in_version}) "
            "GROUP BY rollout_id, attempt_id ORDER BY batch_id, min(sample_index)",
            p,
        ),
        "lineage": Query(f"{trained_by_version(db)} LIMIT {MAX_LINEAGE + 1}", p),
    }


# -- the overview -------------------------------------------------------------------------------


class OverviewParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    window: int = Field(600, ge=60, le=7 * 86400, description="Seconds of history, ending at the newest record.")


POINTS = 60
"""Buckets per throughput chart."""


def bucket_seconds(window: int) -> int:
    return max(1, -(-window // POINTS))


def overview(database: str, window: int) -> dict[str, Query]:
    """Rollouts by status, throughput series, the live policy version, rewards, trainer steps.

    The throughput window ends at each table's newest row, not at the clock: a stack looked at
    after its run still shows what it did.
    """
    db = _db(database)
    step = bucket_seconds(window)
    p = {"window": window, "step": step}
    return {
        "status": Query(f"SELECT status, count() AS n FROM {db}.rollouts FINAL GROUP BY status ORDER BY status", {}),
        "rollouts": Query(
            "SELECT intDiv(toUInt64(start_time), {step:UInt32}) * {step:UInt32} AS t, count() AS n "
            f"FROM {db}.rollouts FINAL "
            f"WHERE start_time >= (SELECT max(start_time) FROM {db}.rollouts) - {{window:UInt32}} "
            "GROUP BY t ORDER BY t",
            p,
        ),
        "spans": Query(
            "SELECT intDiv(toUInt64(toUnixTimestamp(Timestamp)), {step:UInt32}) * {step:UInt32} AS t, count() AS n "
            f"FROM {db}.span_facts FINAL "
            f"WHERE Timestamp >= (SELECT max(Timestamp) FROM {db}.span_facts) - toIntervalSecond({{window:UInt32}}) "
            "GROUP BY t ORDER BY t",
            p,
        ),
        "triplets": Query(
            "SELECT intDiv(toUInt64(finish_time), {step:UInt32}) * {step:UInt32} AS t, count() AS n "
            f"FROM {db}.triplets FINAL "
            f"WHERE finish_time >= (SELECT max(finish_time) FROM {db}.triplets) - {{window:UInt32}} "
            "GROUP BY t ORDER BY t",
            p,
        ),
        "totals": Query(
            f"SELECT (SELECT count() FROM {db}.rollouts FINAL) AS rollouts, "
            f"(SELECT count() FROM {db}.span_facts FINAL) AS spans, "
            f"(SELECT count() FROM {db}.triplets FINAL) AS triplets, "
            # maxOrNull: max() of no rows is 0 for a non-nullable column, a version nobody trained.
            f"(SELECT maxOrNull(policy_version) FROM {db}.trainer_steps FINAL) AS trained_version, "
            f"(SELECT maxOrNull(policy_version) FROM {db}.rollouts FINAL) AS rollout_version",
            {},
        ),
        "rewards": Query(
            "SELECT ifNull(mode, '') AS mode, policy_version, attempts, rewarded, mean_reward "
            f"FROM {db}.reward_by_mode_and_version ORDER BY policy_version, mode",
            {},
        ),
        "steps": Query(
            f"SELECT policy_version, {times.select(('step_time',))}, "
            "step_seconds, idle_seconds, samples, tokens, staleness, "
            "metrics['loss'] AS loss, metrics['reward_mean'] AS reward, "
            "idle_seconds / greatest(step_seconds + idle_seconds, 1e-9) AS idle_fraction "
            f"FROM {db}.trainer_steps FINAL ORDER BY step_time DESC LIMIT 500",
            {},
        ),
    }


def series(rows: Sequence[Sequence[Any]], window: int) -> list[list[float]]:
    """``(bucket start, count)`` rows as ``[[t...], [per second...]]`` for a chart, with empty
    buckets filled with zero (a gap is no traffic, not missing data)."""
    if not rows:
        return [[], []]
    step = bucket_seconds(window)
    counts = {int(t): int(n) for t, n in rows}
    first, last = min(counts), max(counts)
    ts = list(range(first, last + step, step))
    return [[float(t) for t in ts], [counts.get(t, 0) / step for t in ts]]


# -- resources, workers, schema, cookbook ---------------------------------------------------------


def resources(database: str) -> Query:
    db = _db(database)
    return Query(
        f"SELECT resources_id, version, {times.select(('create_time', 'update_time'))}, resources "
        f"FROM {db}.resources FINAL ORDER BY update_time DESC LIMIT 200",
        {},
    )


class WorkersParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    gone_after_s: float = Field(
        30.0, ge=1, le=30 * 86400, description="A worker with no heartbeat for this long is shown as gone."
    )


def workers(database: str, gone_after_s: float = 30.0) -> Query:
    """The workers as they recorded themselves, with whether each is gone: its runner stopped
    cleanly (its last heartbeat says so: the seed's worker statuses have none for a worker that
    left) or its last sign of life (heartbeat, else claim) is older than ``gone_after_s``, by the
    engine's clock. ``silent_s``: seconds since that sign of life."""
    db = _db(database)
    # Qualified: the select list's aliases of the same names are the float seconds.
    seen = times.seconds("coalesce(w.last_heartbeat_time, w.last_dequeue_time)")
    return Query(
        f"SELECT worker_id, status, {times.select(('last_heartbeat_time', 'last_dequeue_time'), 'w')}, "
        "current_rollout_id, current_attempt_id, heartbeat_stats, "
        f"JSONExtractBool(ifNull(heartbeat_stats, ''), '{WORKER_STOPPED}') AS stopped, "
        f"{times.seconds('now64(6)')} - {seen} AS silent_s, "
        "stopped OR ifNull(silent_s > {gone_after_s:Float64}, 0) AS gone "
        f"FROM {db}.workers AS w FINAL ORDER BY worker_id LIMIT 1000",
        {"gone_after_s": gone_after_s},
    )


def schema(database: str) -> Query:
    """The agl database's tables and columns: fixed SQL on ``system.columns``, bound to that
    database only. This is the one statement the dashboard runs that the analytics policy would
    refuse (it reads a system table), so it never carries anything a visitor typed."""
    return Query(
        "SELECT table, name, type FROM system.columns WHERE database = {database:String} "
        "AND table NOT LIKE '.inner%' ORDER BY table, position",
        {"database": _db(database)},
    )


def schema_tables(rows: Iterable[Sequence[Any]]) -> dict[str, list[list[str]]]:
    tables: dict[str, list[list[str]]] = {}
    for table, name, type_ in rows:
        tables.setdefault(str(table), []).append([str(name), str(type_)])
    return tables


_COOKBOOK = re.compile(r"^### (.+?)\n+(.*?)```sql\n(.*?)```", re.S | re.M)


def cookbook(markdown: str) -> list[dict[str, str]]:
    """The cookbook queries of docs/sql.md: ``{"title", "description", "sql"}`` each."""
    start, end = markdown.find("## The cookbook"), markdown.find("## Limits")
    if start < 0:
        return []
    section = markdown[start : end if end > start else len(markdown)]
    return [
        {"title": m.group(1).strip(), "description": " ".join(m.group(2).split()), "sql": m.group(3).strip()}
        for m in _COOKBOOK.finditer(section)
    ]


def records(columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[dict[str, Any]]:
    return [dict(zip(columns, row, strict=True)) for row in rows]


def span_rows(rows: Iterable[Mapping[str, Any]]) -> list[SpanRow]:
    return [
        SpanRow(
            span_id=str(r["SpanId"]),
            parent_id=str(r["ParentSpanId"] or ""),
            name=str(r["SpanName"]),
            start_ns=int(r["start_ns"]),
            duration_ns=int(r["Duration"]),
            # The collector exporter's schema spells it STATUS_CODE_ERROR; the page wants ERROR.
            status=str(r["StatusCode"] or "").removeprefix("STATUS_CODE_"),
        )
        for r in rows
    ]


# -- the pipeline's backlog (Kafka, not SQL) ---------------------------------------------------------


def lag_rows(
    committed: Mapping[str, Mapping[tuple[str, int], int]], ends: Mapping[tuple[str, int], int]
) -> list[dict[str, Any]]:
    """Per consumer (a group, or a sink by what it applied) and topic: records behind the end.

    ``committed``: consumer -> {(topic, partition): next offset it will read}; ``ends``: the
    log-end offset of every partition. A partition a consumer has not committed on counts from
    zero (all of it is queued for it); a committed offset past the end (a topic recreated) is 0.
    """
    rows = []
    for consumer, offsets in sorted(committed.items()):
        for topic in sorted({t for t, _ in offsets}):
            parts = [(tp, end) for tp, end in ends.items() if tp[0] == topic]
            done = sum(min(offsets.get(tp, 0), end) for tp, end in parts)
            end_total = sum(end for _, end in parts)
            rows.append(
                {"consumer": consumer, "topic": topic, "applied": done, "end": end_total, "lag": end_total - done}
            )
    return rows


# -- dead letters ----------------------------------------------------------------------------------


class DeadLetterFilter(BaseModel):
    """The dead letters page's filters: one source topic (full name), how many of the newest."""

    model_config = ConfigDict(extra="forbid")

    source_topic: str | None = Field(None, min_length=1, max_length=256)
    limit: int = Field(50, ge=1, le=MAX_PAGE)

    @field_validator("source_topic", mode="before")
    @classmethod
    def _blank_is_none(cls, value: Any) -> Any:
        return None if isinstance(value, str) and not value.strip() else value


def dead_letters(database: str, f: DeadLetterFilter) -> dict[str, Query]:
    """Dead letters counted by source topic, rejecting role and error type (most first, with the
    newest reason of each), and the newest ones; the bytes stay on agl.dlq (`agl-stream dlq show`)."""
    db = _db(database)
    where, params = "", {}
    if f.source_topic is not None:
        where, params = "WHERE source_topic = {source_topic:String}", {"source_topic": f.source_topic}
    return {
        "counts": Query(
            "SELECT source_topic, processor, error_type, count() AS n, "
            f"{times.seconds('min(time)')} AS first_time, {times.seconds('max(time)')} AS last_time, "
            f"argMax(reason, time) AS newest_reason FROM {db}.dead_letters FINAL {where} "
            "GROUP BY source_topic, processor, error_type ORDER BY n DESC, last_time DESC LIMIT 1000",
            dict(params),
        ),
        "newest": Query(
            "SELECT concat(toString(kafka_partition), ':', toString(kafka_offset)) AS id, "
            f"{times.select(('time',))}, source_topic, "
            "source_partition, source_offset, processor, error_type, reason, key, value_size, value_kept "
            f"FROM {db}.dead_letters FINAL {where} "
            "ORDER BY time DESC, kafka_partition DESC, kafka_offset DESC LIMIT {limit:UInt32}",
            {**params, "limit": f.limit},
        ),
        "total": Query(f"SELECT count() AS n FROM {db}.dead_letters FINAL {where}", dict(params)),
    }
