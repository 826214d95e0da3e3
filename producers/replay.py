"""Replay, the shell: read committed history from Kafka, re-derive triplet records, write them.

One pass per partition of ``agl.spans`` (``agl.rollouts`` is co-partitioned with it, by rollout
id): the partition's rollout events, then the span records of the range (ranges and offsets
count records), go into the pure :class:`~agl_stream.domain.replay.PartitionReplay`, which folds
the events (the history of ``agl.rollout-state`` is compacted and tombstoned, the events are
kept forever), collects each attempt's spans as the live builder does and derives its record.
Records are written after all partitions were read, in canonical order (see
:mod:`agl_stream.domain.replay`).

Everything is read by manual assignment, no consumer group, ``read_committed``, up to the end
offsets taken at the start: live traffic after that is never read, and nothing live is
disturbed (no group, no commits, no writes but the replay topic).
"""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import os
import time
from collections.abc import AsyncIterator, Callable, Collection
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from agl_stream.config import Settings
from agl_stream.domain.replay import (
    HEADER_ATTEMPT,
    HEADER_SETTINGS,
    OutRecord,
    PartitionReplay,
    ReplayError,
    ReplaySettings,
    Selection,
    Tally,
    batches_topic_of,
    canonical,
    load_reward,
    output_digest,
    replay_topic,
    resolve_ranges,
)
from agl_stream.errors import AglError, CodecError
from agl_stream.kafka.admin import create_topic_like
from agl_stream.kafka.io import make_consumer, make_producer
from agl_stream.logs import describe, get_logger
from agl_stream.models import ResourcesUpdate
from agl_stream.store.readside import read_side_for
from agl_stream.wire.codec import Codec
from agl_stream.wire.span_records import span_dicts_of

log = get_logger("agl.replay")

_FETCH = 20_000
_FETCH_OPTIONS: dict[str, Any] = {
    "max_partition_fetch_bytes": 32 << 20,
    "fetch_max_bytes": 64 << 20,
    "fetch_max_wait_ms": 100,
}
_PARALLEL_MIN_SPANS = 20_000  # by default, below this starting worker processes costs more than it saves


@dataclass(kw_only=True)
class ReplaySummary(Tally):
    """The whole replay: the partitions' tallies (absorbed) and what it wrote."""

    topic: str
    settings_digest: str
    ranges: dict[int, tuple[int, int]]
    records: int = 0
    written: int = 0
    already_present: int = 0
    digest: str = ""
    read_s: float = 0.0
    elapsed_s: float = 0.0

    @property
    def spans_per_s(self) -> float:
        return self.spans / self.read_s if self.read_s > 0 else 0.0


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
        summary = ReplaySummary(topic=out_topic, settings_digest=replay_settings.digest(), ranges=ranges)
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
    progress: Callable[[int], None],
) -> tuple[list[OutRecord], Tally]:
    """Read one partition's events, then its spans range, into its pure derivation."""
    spans_tp = TopicPartition(settings.topic("spans"), job.partition)
    events_tp = TopicPartition(settings.topic("rollouts"), job.partition)
    derivation = PartitionReplay(
        job.partition, replay_settings, resources, Codec.default(),
        spans_topic=spans_tp.topic, events_topic=events_tp.topic,
    )  # fmt: skip
    async for message in _range(consumer, events_tp, 0, job.events_end):
        if keys is None or message.key in keys:
            derivation.add_event(message.offset, message.value or b"")
    lo, hi = job.bounds
    last_report = lo
    # The folded states live until the end: frozen, the cyclic collector stops walking them
    # on every full collection while the spans go by (~10% of the CPU of this loop).
    gc.freeze()
    try:
        async for message in _range(consumer, spans_tp, lo, hi):
            if keys is None or message.key in keys:  # other rollouts are skipped without decoding
                derivation.add_spans(message.offset, message.value or b"")
            if message.offset - last_report >= 5000:
                last_report = message.offset
                progress(message.offset - lo + 1)
        progress(hi - lo)
        return derivation.finish(), derivation.tally
    finally:
        gc.unfreeze()


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

        part_records, tally = await _one_partition(consumer, settings, job, keys, replay_settings, resources, progress)
        records += part_records
        summary.absorb(tally)
        done += job.bounds[1] - job.bounds[0]
    return records


def _partition_worker(
    settings: Settings,
    job: _Job,
    keys: Collection[bytes] | None,
    replay_settings: ReplaySettings,
    resources: dict[str, ResourcesUpdate],
    counter: Any,
) -> tuple[list[OutRecord], Tally]:
    """One partition in a worker process: its records and its counts."""

    async def run() -> tuple[list[OutRecord], Tally]:
        consumer = make_consumer(settings, group_id=None, **_FETCH_OPTIONS)
        await consumer.start()
        try:

            def progress(n: int) -> None:
                counter.value = n

            return await _one_partition(consumer, settings, job, keys, replay_settings, resources, progress)
        finally:
            await consumer.stop()

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
                log.warning("undecodable resources snapshot skipped", offset=message.offset, error=describe(error))
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
