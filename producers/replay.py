"""Replay, the shell: read committed history from Kafka, re-derive triplet records, write them.

One pass per partition of ``agl.spans`` (``agl.rollouts`` is co-partitioned with it, by rollout
id): first the partition's rollout events are folded with the processor's pure fold (the
history of ``agl.rollout-state`` is compacted and tombstoned, the events are kept forever),
and every state goes into the live builder's pure :class:`TraceCollector`; then the spans in
the range go in (a record is one agl.Span or an agl.SpanBatch, decoded in one call; ranges and
offsets count records), and each attempt the collector hands out becomes a record through the live
builder's pure :func:`triplet_record`. Records are written after all partitions were read, in
canonical order (see :mod:`agl_stream.domain.replay`).

Everything is read by manual assignment, no consumer group, ``read_committed``, up to the end
offsets taken at the start: live traffic after that is never read, and nothing live is
disturbed (no group, no commits, no writes but the replay topic).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from collections.abc import AsyncIterator, Callable, Collection
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from agl_stream.codec import Codec
from agl_stream.config import Settings
from agl_stream.domain.fold import fold
from agl_stream.domain.replay import (
    HEADER_ATTEMPT,
    HEADER_SETTINGS,
    OutRecord,
    ReplayError,
    ReplaySettings,
    RewardError,
    RewardFn,
    Selection,
    batches_topic_of,
    canonical,
    load_reward,
    new_reward,
    out_record,
    output_digest,
    replay_topic,
    resolve_ranges,
    span_view,
    validated_span,
    with_reward,
)
from agl_stream.domain.trace_collector import (
    ReadyAttempt,
    TraceCollector,
    resources_id_of,
    spans_by_attempt,
    triplet_record,
)
from agl_stream.errors import AglError, CodecError
from agl_stream.kafka.admin import create_topic_like
from agl_stream.kafka.io import make_consumer, make_producer
from agl_stream.logs import get_logger
from agl_stream.models import ResourcesUpdate, RolloutEvent, RolloutState
from agl_stream.span_records import span_dicts_of
from agl_stream.store.readside import read_side_for

log = get_logger("agl.replay")

_FETCH = 20_000
_FETCH_OPTIONS: dict[str, Any] = {
    "max_partition_fetch_bytes": 32 << 20,
    "fetch_max_bytes": 64 << 20,
    "fetch_max_wait_ms": 100,
}
_PARALLEL_MIN_SPANS = 20_000  # by default, below this starting worker processes costs more than it saves
_STATE_TOKEN = -1
_REASONS_KEPT = 5


@dataclass
class Problems:
    """Bad input met on the way: counted, the first reasons kept (never dropped silently)."""

    count: int = 0
    reasons: list[str] = field(default_factory=list)

    def add(self, reason: str) -> None:
        self.count += 1
        if len(self.reasons) < _REASONS_KEPT:
            self.reasons.append(reason)


@dataclass
class ReplaySummary:
    topic: str
    settings_digest: str
    ranges: dict[int, tuple[int, int]]
    spans: int = 0
    attempts: int = 0
    records: int = 0
    written: int = 0
    already_present: int = 0
    incomplete: int = 0
    incomplete_skipped: int = 0
    unfinished_attempts: int = 0
    malformed_spans: Problems = field(default_factory=Problems)  # records of agl.spans (a batch counts once)
    bad_events: Problems = field(default_factory=Problems)
    reward_errors: Problems = field(default_factory=Problems)
    digest: str = ""
    read_s: float = 0.0
    elapsed_s: float = 0.0

    @property
    def spans_per_s(self) -> float:
        return self.spans / self.read_s if self.read_s > 0 else 0.0

    def absorb(self, part: ReplaySummary) -> None:
        """Add what a worker counted for its partitions."""
        for name in ("spans", "attempts", "incomplete", "incomplete_skipped", "unfinished_attempts"):
            setattr(self, name, getattr(self, name) + getattr(part, name))
        for mine, theirs in (
            (self.malformed_spans, part.malformed_spans),
            (self.bad_events, part.bad_events),
            (self.reward_errors, part.reward_errors),
        ):
            mine.count += theirs.count
            mine.reasons = (mine.reasons + theirs.reasons)[:_REASONS_KEPT]


Progress = Callable[[int, int], None]
"""``(records read so far, records to read)`` over the spans ranges."""


async def replay(
    settings: Settings,
    name: str,
    *,
    selection: Selection | None = None,
    replay_settings: ReplaySettings | None = None,
    on_progress: Progress | None = None,
    workers: int | None = None,
) -> ReplaySummary:
    """Replay the selected history into ``<prefix>.triplets.replay.<name>``; rerunning with the
    same settings writes no record twice.

    ``workers``: processes reading partitions in parallel (None: one per CPU, at most one per
    partition with work; 1: all in this process). The output is the same either way.
    """
    selection = selection or Selection()
    replay_settings = replay_settings or ReplaySettings()
    out_topic = replay_topic(settings.topic_prefix, name)
    if replay_settings.reward:
        load_reward(replay_settings.reward)  # a bad reference fails here, before anything is read
    started = time.perf_counter()
    codec = Codec.default()
    consumer = make_consumer(settings, group_id=None, **_FETCH_OPTIONS)
    await consumer.start()
    try:
        spans_tps = await _partitions(consumer, settings.topic("spans"))
        events_tps = await _partitions(consumer, settings.topic("rollouts"))
        if len(spans_tps) != len(events_tps):
            raise ReplayError("agl.spans and agl.rollouts must be co-partitioned (equal partition counts)")
        # Committed history only: the last stable offsets now, under read_committed.
        span_ends = await consumer.end_offsets(spans_tps)
        event_ends = await consumer.end_offsets(events_tps)
        beginnings = await consumer.beginning_offsets(spans_tps)
        selected, keys = (None, None)
        if selection.sql:
            selected, rollout_ids = await _select_rollouts(settings, selection.sql, span_ends)
            keys = {r.encode() for r in rollout_ids}
        ranges = await _ranges(consumer, selection, beginnings, span_ends, selected)
        summary = ReplaySummary(out_topic, replay_settings.digest(), ranges)
        total = sum(hi - lo for lo, hi in ranges.values())
        resources = await _resources(consumer, settings, codec)
        read_started = time.perf_counter()
        jobs = [
            _Job(partition, bounds, event_ends[TopicPartition(settings.topic("rollouts"), partition)])
            for partition, bounds in ranges.items()
        ]
        busy = [job for job in jobs if job.bounds[1] > job.bounds[0]]
        count = workers if workers is not None else min(os.cpu_count() or 1, len(busy))
        spans = float(total)
        if count > 1 and len(busy) > 1 and workers is None and total < _PARALLEL_MIN_SPANS:
            # A record holds one span or a batch of many: estimate from the first few.
            first = TopicPartition(settings.topic("spans"), busy[0].partition)
            spans *= await _spans_per_record(consumer, first, busy[0].bounds, codec)
        if count > 1 and len(busy) > 1 and (workers is not None or spans >= _PARALLEL_MIN_SPANS):
            records = await _in_processes(settings, jobs, keys, replay_settings, resources, summary, count, on_progress)
        else:
            records = await _in_this_process(
                consumer, settings, jobs, keys, replay_settings, resources, summary, on_progress
            )
        summary.read_s = time.perf_counter() - read_started
        ordered = canonical(records)
        summary.records = len(ordered)
        summary.digest = output_digest(ordered)
    finally:
        await consumer.stop()
    await create_topic_like(settings, "triplets", out_topic)
    # Where `agl-stream batcher --input-topic <out_topic>` writes its batches, co-partitioned.
    await create_topic_like(settings, "triplet-batches", batches_topic_of(settings.topic_prefix, name))
    present = await _present(settings, out_topic, summary.settings_digest)
    await _write(settings, out_topic, [r for r in ordered if r.identity not in present], summary)
    summary.already_present = summary.records - summary.written
    summary.elapsed_s = time.perf_counter() - started
    log.info(
        "replay done",
        topic=out_topic, spans=summary.spans, records=summary.records, written=summary.written,
        malformed=summary.malformed_spans.count, digest=summary.digest,
    )  # fmt: skip
    return summary


@dataclass(frozen=True)
class _Job:
    partition: int
    bounds: tuple[int, int]  # of agl.spans
    events_end: int  # of agl.rollouts, same partition


async def _one_partition(
    consumer: AIOKafkaConsumer,
    settings: Settings,
    job: _Job,
    keys: Collection[bytes] | None,
    replay_settings: ReplaySettings,
    resources: dict[str, ResourcesUpdate],
    summary: ReplaySummary,
    progress: Callable[[int], None],
) -> list[OutRecord]:
    codec = Codec.default()
    reward_fn = load_reward(replay_settings.reward) if replay_settings.reward else None
    collector: TraceCollector[int] = TraceCollector(max_spans=1 << 62, remember=1 << 62)
    events_tp = TopicPartition(settings.topic("rollouts"), job.partition)
    await _fold_events(consumer, events_tp, {events_tp: job.events_end}, keys, collector, summary, codec)
    spans_tp = TopicPartition(settings.topic("spans"), job.partition)
    return await _read_spans(
        consumer, spans_tp, job.bounds, keys, collector, summary, codec, replay_settings, reward_fn, resources,
        progress,
    )  # fmt: skip


async def _in_this_process(
    consumer: AIOKafkaConsumer,
    settings: Settings,
    jobs: list[_Job],
    keys: Collection[bytes] | None,
    replay_settings: ReplaySettings,
    resources: dict[str, ResourcesUpdate],
    summary: ReplaySummary,
    on_progress: Progress | None,
) -> list[OutRecord]:
    total = sum(hi - lo for job in jobs for lo, hi in [job.bounds])
    records: list[OutRecord] = []
    done = 0
    for job in jobs:

        def progress(n: int, before: int = done) -> None:
            if on_progress is not None:
                on_progress(before + n, total)

        records += await _one_partition(consumer, settings, job, keys, replay_settings, resources, summary, progress)
        done += job.bounds[1] - job.bounds[0]
    return records


def _partition_worker(
    settings: Settings,
    job: _Job,
    keys: Collection[bytes] | None,
    replay_settings: ReplaySettings,
    resources: dict[str, ResourcesUpdate],
    counter: Any,
) -> tuple[list[OutRecord], ReplaySummary]:
    """One partition in a worker process: its records and its part of the summary."""

    async def run() -> tuple[list[OutRecord], ReplaySummary]:
        summary = ReplaySummary("", "", {})
        consumer = make_consumer(settings, group_id=None, **_FETCH_OPTIONS)
        await consumer.start()
        try:

            def progress(n: int) -> None:
                counter.value = n

            records = await _one_partition(consumer, settings, job, keys, replay_settings, resources, summary, progress)
        finally:
            await consumer.stop()
        return records, summary

    return asyncio.run(run())


async def _in_processes(
    settings: Settings,
    jobs: list[_Job],
    keys: Collection[bytes] | None,
    replay_settings: ReplaySettings,
    resources: dict[str, ResourcesUpdate],
    summary: ReplaySummary,
    workers: int,
    on_progress: Progress | None,
) -> list[OutRecord]:
    """Partitions in parallel processes (decoding and deriving are CPU-bound, one core each)."""
    total = sum(hi - lo for job in jobs for lo, hi in [job.bounds])
    context = multiprocessing.get_context("spawn")  # no fork of a running event loop
    loop = asyncio.get_running_loop()
    with context.Manager() as manager, ProcessPoolExecutor(workers, mp_context=context) as pool:
        counters = [manager.Value("q", 0) for _ in jobs]
        futures = [
            loop.run_in_executor(pool, _partition_worker, settings, job, keys, replay_settings, resources, counter)
            for job, counter in zip(jobs, counters, strict=True)
        ]
        waiting = asyncio.gather(*futures)
        while not waiting.done():
            await asyncio.wait([waiting], timeout=0.25)  # progress ticks while the workers run
            if on_progress is not None:
                on_progress(sum(c.value for c in counters), total)
        parts = waiting.result()
    records: list[OutRecord] = []
    for part_records, part in parts:
        records += part_records
        summary.absorb(part)
    return records


# -- reading ----------------------------------------------------------------------------------


async def _partitions(consumer: AIOKafkaConsumer, topic: str) -> list[TopicPartition]:
    found = consumer.partitions_for_topic(topic)
    if not found:
        await consumer._client.force_metadata_update()
        found = consumer.partitions_for_topic(topic)
    if not found:
        raise ReplayError(f"topic {topic} does not exist: nothing to replay (run `agl-stream up` first)")
    return [TopicPartition(topic, p) for p in sorted(found)]


async def _ranges(
    consumer: AIOKafkaConsumer,
    selection: Selection,
    beginnings: dict[TopicPartition, int],
    ends: dict[TopicPartition, int],
    selected: dict[int, tuple[int, int]] | None,
) -> dict[int, tuple[int, int]]:
    async def at(moment: float | None) -> dict[int, int | None] | None:
        if moment is None:
            return None
        found = await consumer.offsets_for_times({tp: round(moment * 1000) for tp in ends})
        return {tp.partition: (None if o is None else o.offset) for tp, o in found.items()}

    bounds = dict(selection.offsets or {})
    if selected is not None:  # narrow to where the selected rollouts' spans are
        for partition in list(bounds) or [tp.partition for tp in ends]:
            if partition not in selected:
                bounds[partition] = (0, 0)
        for partition, (lo, hi) in selected.items():
            b_lo, b_hi = bounds.get(partition, (None, None))
            bounds[partition] = (max(lo, b_lo or 0), hi if b_hi is None else min(hi, b_hi))
    return resolve_ranges(
        {tp.partition: o for tp, o in beginnings.items()},
        {tp.partition: o for tp, o in ends.items()},
        bounds or None,
        await at(selection.from_time),
        await at(selection.to_time),
    )


async def _select_rollouts(
    settings: Settings, sql: str, span_ends: dict[TopicPartition, int]
) -> tuple[dict[int, tuple[int, int]], set[str]]:
    """Rollout ids from the user's SQL, and where their spans are: per partition, the offsets
    from ``otel_traces`` (every row records its Kafka position). Behind a fence at the captured
    ends, so the table holds every span up to them."""
    side = read_side_for(settings)
    try:
        fence = {tp.topic: {tp.partition: end - 1} for tp, end in span_ends.items() if end > 0}
        wanted = await side.query(sql, fence=fence or None, timeout=120)
        if not wanted.columns:
            raise ReplayError("--sql returned no columns; it must select rollout ids")
        ids = sorted({str(row[0]) for row in wanted.rows})
        found = await side.query(
            "SELECT KafkaPartition AS p, min(KafkaOffset) AS lo, max(KafkaOffset) AS hi,"
            f" groupUniqArray(RolloutId) AS ids FROM {settings.clickhouse_database}.otel_traces"
            " WHERE RolloutId IN {ids:Array(String)} GROUP BY p ORDER BY p",
            {"ids": ids},
        )
    except AglError as exc:
        if isinstance(exc, ReplayError):
            raise
        raise ReplayError(f"--sql failed: {exc}") from exc
    finally:
        await side.aclose()
    selected: dict[int, tuple[int, int]] = {}
    rollouts: set[str] = set()
    for row in found.dicts():
        selected[int(row["p"])] = (int(row["lo"]), int(row["hi"]) + 1)
        rollouts.update(row["ids"])
    return selected, rollouts


async def _spans_per_record(
    consumer: AIOKafkaConsumer, tp: TopicPartition, bounds: tuple[int, int], codec: Codec, sample: int = 20
) -> float:
    """Mean spans per record over the first ``sample`` records of a range (1 if none decodes)."""
    lo, hi = bounds
    counts = []
    async for message in _range(consumer, tp, lo, min(hi, lo + sample)):
        try:
            counts.append(len(span_dicts_of(codec, message.value or b"")))
        except CodecError:
            continue
    return sum(counts) / len(counts) if counts else 1.0


async def _resources(consumer: AIOKafkaConsumer, settings: Settings, codec: Codec) -> dict[str, ResourcesUpdate]:
    """The resources snapshots written before the replay began (compacted: the latest per id)."""
    topic = settings.topic("resources")
    found = consumer.partitions_for_topic(topic) or set()
    tps = [TopicPartition(topic, p) for p in sorted(found)]
    by_id: dict[str, ResourcesUpdate] = {}
    ends = await consumer.end_offsets(tps) if tps else {}
    for tp in tps:
        async for message in _range(consumer, tp, 0, ends[tp]):
            if message.value is None:
                continue
            try:
                update = codec.decode(message.value, ResourcesUpdate)
            except CodecError as error:
                log.warning("undecodable resources snapshot skipped", offset=message.offset, error=str(error))
                continue
            by_id[update.resources_id] = update
    return by_id


async def _range(consumer: AIOKafkaConsumer, tp: TopicPartition, lo: int, hi: int) -> AsyncIterator[Any]:
    """Every record of ``tp`` in ``[lo, hi)`` (fewer where compaction or transactions left gaps)."""
    if hi <= lo:
        return
    consumer.assign([tp])
    consumer.seek(tp, lo)
    while await consumer.position(tp) < hi:
        batch = await consumer.getmany(tp, timeout_ms=1000, max_records=_FETCH)
        for message in batch.get(tp, []):
            if message.offset >= hi:
                return
            yield message


async def _fold_events(
    consumer: AIOKafkaConsumer,
    tp: TopicPartition,
    ends: dict[TopicPartition, int],
    keys: Collection[bytes] | None,
    collector: TraceCollector[int],
    summary: ReplaySummary,
    codec: Codec,
) -> None:
    """Rebuild the partition's rollout states as the processor did, feeding each to the collector."""
    states: dict[str, RolloutState] = {}
    async for message in _range(consumer, tp, 0, ends[tp]):
        if keys is not None and message.key not in keys:
            continue
        try:
            event = codec.decode(message.value or b"", RolloutEvent)
        except CodecError as error:
            summary.bad_events.add(f"{tp.topic}[{tp.partition}]@{message.offset}: {error}")
            continue
        result = fold(states.get(event.rollout_id), event)
        if result.state is None:  # rejected or ignored: the processor dead-lettered/skipped it too
            continue
        states[event.rollout_id] = result.state
        collector.add_state(result.state, _STATE_TOKEN, 0.0)


async def _read_spans(
    consumer: AIOKafkaConsumer,
    tp: TopicPartition,
    bounds: tuple[int, int],
    keys: Collection[bytes] | None,
    collector: TraceCollector[int],
    summary: ReplaySummary,
    codec: Codec,
    replay_settings: ReplaySettings,
    reward_fn: RewardFn | None,
    resources: dict[str, ResourcesUpdate],
    progress: Callable[[int], None],
) -> list[OutRecord]:
    lo, hi = bounds
    out: list[OutRecord] = []
    make_span = validated_span if reward_fn is not None else span_view
    read = 0
    last_report = 0
    async for message in _range(consumer, tp, lo, hi):
        read = message.offset - lo + 1
        if keys is not None and message.key not in keys:
            continue
        try:  # one agl.Span, or an agl.SpanBatch decoded in one call (good or bad as a whole)
            spans = [make_span(datum) for datum in span_dicts_of(codec, message.value or b"")]
        except CodecError as error:
            summary.malformed_spans.add(f"{tp.topic}[{tp.partition}]@{message.offset}: {error}")
            continue
        summary.spans += len(spans)
        for group in spans_by_attempt(spans):
            ready, _ = collector.add_spans(group, message.offset, 0.0)
            for attempt in ready:
                out += _derived(
                    tp.partition, (0, message.offset), attempt, summary, replay_settings, reward_fn, resources, codec
                )
        if read - last_report >= 5000:
            last_report = read
            progress(read)
    progress(hi - lo)
    # What is left: attempts whose spans did not all arrive in the range (a boundary cut
    # through them, or spans were lost), and attempts never finished in the history read.
    for entry in list(collector.pending.values()):
        if not entry.spans:
            continue  # finished, but none of its spans is in the range: not part of this replay
        if entry.finished is None:
            summary.unfinished_attempts += 1
            continue
        summary.incomplete += 1
        if replay_settings.incomplete == "skip":
            summary.incomplete_skipped += 1
            continue
        spans = sorted(entry.spans.values(), key=lambda s: (s.sequence_id, s.span_id))
        last = max(t for t in entry.tokens if t != _STATE_TOKEN)
        attempt = ReadyAttempt(entry.finished, spans, False, entry.tokens)
        out += _derived(tp.partition, (1, last), attempt, summary, replay_settings, reward_fn, resources, codec)
    return out


def _derived(
    partition: int,
    position: tuple[int, int],
    attempt: ReadyAttempt[int],
    summary: ReplaySummary,
    replay_settings: ReplaySettings,
    reward_fn: RewardFn | None,
    resources: dict[str, ResourcesUpdate],
    codec: Codec,
) -> list[OutRecord]:
    if not attempt.spans:
        return []  # finished with no spans expected: nothing of it is in any range
    summary.attempts += 1
    resources_id = resources_id_of(attempt.finished)
    snapshot = resources.get(resources_id) if resources_id else None
    record, _ = triplet_record(attempt.finished, attempt.spans, replay_settings.adapter, snapshot)
    if reward_fn is not None:
        try:
            reward = new_reward(reward_fn, list(attempt.spans))
        except RewardError as error:
            summary.reward_errors.add(f"{record.rollout_id}/{record.attempt_id}: {error}")
            return []
        record = with_reward(record, reward, to_last=replay_settings.adapter.final_reward_to_last)
    return [out_record((partition, *position), record, codec.encode(record), replay_settings.digest())]


# -- writing ----------------------------------------------------------------------------------


async def _present(settings: Settings, topic: str, settings_digest: str) -> set[tuple[bytes, bytes]]:
    """Identities of the records with these settings the topic already holds (a rerun's)."""
    consumer = make_consumer(settings, group_id=None)
    await consumer.start()
    present: set[tuple[bytes, bytes]] = set()
    wanted = settings_digest.encode()
    try:
        tps = await _partitions(consumer, topic)
        ends = await consumer.end_offsets(tps)
        for tp in tps:
            async for message in _range(consumer, tp, 0, ends[tp]):
                headers = dict(message.headers or ())
                if headers.get(HEADER_SETTINGS) == wanted and HEADER_ATTEMPT in headers:
                    present.add((wanted, headers[HEADER_ATTEMPT]))
    finally:
        await consumer.stop()
    return present


async def _write(settings: Settings, topic: str, records: list[OutRecord], summary: ReplaySummary) -> None:
    """Produce in canonical order (one producer, so each output partition gets them in that order)."""
    if not records:
        return
    producer = make_producer(settings, linger_ms=50)
    await producer.start()
    try:
        futures: list[asyncio.Future[Any]] = []
        for record in records:
            futures.append(
                await producer.send(
                    topic, record.value, key=record.key, timestamp_ms=record.timestamp_ms, headers=list(record.headers)
                )
            )
            if len(futures) >= 5000:
                await asyncio.gather(*futures)
                summary.written += len(futures)
                futures = []
        await asyncio.gather(*futures)
        summary.written += len(futures)
    finally:
        await producer.stop()


__all__ = ["ReplaySummary", "Selection", "replay"]
