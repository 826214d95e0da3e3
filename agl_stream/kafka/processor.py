"""One skeleton for a stream processor: a consumer-group member that handles what one fetch returns.

Concurrency model: one asyncio task runs the loop (fetch, handle, commit); aiokafka calls the
rebalance callbacks from its coordinator task, and they take the same lock the loop holds while
it handles a batch, so a partition never moves in the middle of a batch. Nothing else touches
the handler.

The loop, per fetch: records of partitions still assigned go to ``handler.handle`` as one batch;
the handler sends its effects and waits for their acknowledgements before it returns (through
an :class:`agl_stream.kafka.io.Outbox`, which settles every send); then the batch's offsets
become committable. A handler that holds
records across batches (spans until their attempt finishes, triplets until a batch is full)
also has ``committable(tp, handled)``: the offset up to which a partition may be committed,
its lowest pending offset (the lowest-pending-offset commit). A handler whose timers may
become due before its poll timeout for a reason other than records (a reader waiting on a
batch the handler lingers on) also has ``woken``, an event set in the loop's thread: a fetch in
progress then returns at once, and ``tick`` runs. A broker error in ``handle`` or
``tick`` makes the handler start over as after a rebalance (its partitions rebuilt from what is
durable, the records read again from the committed offsets), with backoff (retry.RESTART). Commits are coalesced
(every ``commit_interval_s``, on revocation and at stop): a crash re-delivers at most that much,
and handlers are idempotent (at-least-once). ``handler.tick`` runs after every fetch, also an
empty one, for timers; ``handler.poll_timeout`` says how long a fetch may wait for records.

Every member reports the same metrics (agl_stream/metrics.py), labelled with its group: records
handled per topic and handler time (once per batch), commits, assignments, and its lag per
partition (high watermark minus what it handled; at most once a second, and dropped for a
partition it no longer owns).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, ConsumerRecord, TopicPartition
from aiokafka.coordinator.assignors.range import RangePartitionAssignor
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError
from aiokafka.structs import OffsetAndMetadata

from agl_stream import metrics
from agl_stream.config import Settings
from agl_stream.kafka.io import make_consumer
from agl_stream.logs import describe, get_logger
from agl_stream.retry import RESTART

__all__ = ["Batch", "Handler", "HoldsRecords", "Wakes", "run_processor"]

log = get_logger("agl.kafka.processor")

LAG_REPORT_INTERVAL_S = 1.0
"""How often a member refreshes its lag gauges (a scrape every 15 s needs no more)."""

Batch = dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]


class Handler(Protocol):
    """What a processor supplies to the skeleton."""

    async def assigned(self, partitions: set[TopicPartition]) -> None:
        """Partitions were assigned: rebuild what the handler keeps for them."""

    def revoked(self, partitions: set[TopicPartition]) -> None:
        """Partitions were taken away: forget what the handler keeps for them."""

    async def handle(self, batch: Batch) -> None:
        """Handle one fetch; return once every effect is durable (acknowledged)."""

    async def tick(self) -> None:
        """Timers; called after every fetch."""

    def poll_timeout(self) -> float:
        """Seconds the next fetch may wait for records."""


class HoldsRecords(Protocol):
    """A handler that keeps records pending across batches (optional, beside :class:`Handler`)."""

    def committable(self, tp: TopicPartition, handled: int) -> int:
        """How far ``tp`` may be committed, given that records before ``handled`` were handled:
        ``handled``, or the lowest offset still pending."""


class Wakes(Protocol):
    """A handler whose fetch waits can be cut short (optional, beside :class:`Handler`)."""

    woken: asyncio.Event
    """Set in the loop's thread when ``tick`` should run now rather than after the poll timeout;
    the skeleton clears it before that ``tick``."""


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, loop: _Loop) -> None:
        self.loop = loop

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        async with self.loop.lock:
            self.loop.generation += 1
            await self.loop.commit()
            self.loop.handler.revoked(set(revoked))
            self.loop.forget(revoked)

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        async with self.loop.lock:
            self.loop.generation += 1
            self.loop.rebalances.inc()
            try:
                await self.loop.handler.assigned(set(assigned))
            except Exception as error:
                # aiokafka only logs what a listener raises, and a partition the handler could
                # not set up would sit unprocessed: the loop stops with this error instead.
                log.exception("setting up assigned partitions failed; stopping")
                self.loop.failure = error
        self.loop.assigned_once.set()


class _Loop:
    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        handler: Handler,
        *,
        max_records: int,
        commit_interval_s: float,
        retry_on: tuple[type[BaseException], ...] = (KafkaError, TimeoutError),
        group: str = "",
    ) -> None:
        self.consumer = consumer
        self.retry_on = retry_on
        self.generation = 0  # moved by every rebalance callback
        self.failure: BaseException | None = None
        self.handler = handler
        self.max_records = max_records
        self.commit_interval_s = commit_interval_s
        self.lock = asyncio.Lock()
        self.assigned_once = asyncio.Event()
        self.positions: dict[TopicPartition, int] = {}  # next offset after the handled records
        self.committed: dict[TopicPartition, int] = {}
        self._holds = getattr(handler, "committable", None)
        self._woken: asyncio.Event | None = getattr(handler, "woken", None)
        self._last_commit = time.monotonic()
        self.failures = 0  # failed start-overs in a row: the next waits RESTART.after(this + 1)
        # Metric children, looked up once: the loop touches them once per batch.
        self.group = group
        self.role = metrics.role()
        self.records_in: dict[str, Any] = {}
        self.handle_seconds = metrics.HANDLE_SECONDS.labels(self.role, group)
        self.commits_ok = metrics.COMMITS.labels(self.role, group, "ok")
        self.commits_failed = metrics.COMMITS.labels(self.role, group, "failed")
        self.rebalances = metrics.REBALANCES.labels(self.role, group)
        self._lag_reported = 0.0
        # Per owned partition: the fetch position at assignment, while nothing is handled yet
        # (asked once, not at every report), and the lag gauge's child with the value last set.
        self._fetch_start: dict[TopicPartition, int] = {}
        self._lag: dict[TopicPartition, tuple[Any, int]] = {}

    def forget(self, partitions: Iterable[TopicPartition]) -> None:
        for tp in partitions:
            self.positions.pop(tp, None)
            self.committed.pop(tp, None)
            self._fetch_start.pop(tp, None)
            self._lag.pop(tp, None)
            with contextlib.suppress(KeyError):  # never reported: nothing to drop
                metrics.CONSUMER_LAG.remove(self.role, self.group, tp.topic, str(tp.partition))

    def count(self, batch: Batch, started: float) -> None:
        """The metrics of one handled batch: records per topic, handler time."""
        self.handle_seconds.observe(time.monotonic() - started)
        per_topic: dict[str, int] = {}
        for tp, records in batch.items():
            per_topic[tp.topic] = per_topic.get(tp.topic, 0) + len(records)
        for topic, n in per_topic.items():
            child = self.records_in.get(topic)
            if child is None:
                child = self.records_in[topic] = metrics.RECORDS_IN.labels(self.role, self.group, topic)
            child.inc(n)

    async def report_lag(self) -> None:
        """Each owned partition's lag: its high watermark (from the last fetch response) minus
        the next offset to handle. A partition with no fetch response yet is not reported. An
        idle stack reports every second, so a report that changes nothing costs a few lookups."""
        self._lag_reported = time.monotonic()
        for tp in self.consumer.assignment():
            try:
                high = self.consumer.highwater(tp)
                if high is None:
                    continue
                handled = self.positions.get(tp, self._fetch_start.get(tp))
                if handled is None:
                    # Nothing handled since assignment: the fetch position (valid once a fetch
                    # answered; the short wait only guards against a reset in flight).
                    handled = self._fetch_start[tp] = await asyncio.wait_for(self.consumer.position(tp), 0.1)
            except (AssertionError, IllegalStateError, TimeoutError):  # moved away meanwhile
                continue
            lag = max(0, high - handled)
            gauge, reported = self._lag.get(tp, (None, -1))
            if lag != reported:
                if gauge is None:
                    gauge = metrics.CONSUMER_LAG.labels(self.role, self.group, tp.topic, str(tp.partition))
                gauge.set(lag)
                self._lag[tp] = (gauge, lag)

    async def commit(self) -> None:
        self._last_commit = time.monotonic()
        if not self.positions:
            return
        owned = self.consumer.assignment()
        offsets = {}
        for tp, handled in self.positions.items():
            if tp not in owned:
                continue
            target = handled if self._holds is None else self._holds(tp, handled)
            if target > self.committed.get(tp, -1):  # forward only
                offsets[tp] = OffsetAndMetadata(target, "")
        if not offsets:
            return
        try:
            await self.consumer.commit(offsets)
            self.committed.update({tp: o.offset for tp, o in offsets.items()})
            self.commits_ok.inc()
        except (CommitFailedError, KafkaError) as error:  # a rebalance: the next owner re-reads (idempotent)
            self.commits_failed.inc()
            log.warning("commit failed; handled records will be read again", error=describe(error))

    async def step(self, stop: asyncio.Event) -> None:
        if self.failure is not None:
            raise self.failure
        timeout_ms = max(1, int(self.handler.poll_timeout() * 1000))
        generation = self.generation
        fetched = await self._fetch(timeout_ms)
        async with self.lock:
            if generation != self.generation:
                # Partitions moved between the fetch and now: these records may predate what the
                # handler rebuilt, so they are dropped and read again from the committed offsets.
                await self._rewind()
                return
            owned = self.consumer.assignment()
            batch = {tp: records for tp, records in fetched.items() if records and tp in owned}
            started = time.monotonic()
            if batch and await self._attempt(lambda: self.handler.handle(batch), stop):
                for tp, records in batch.items():
                    self.positions[tp] = records[-1].offset + 1
                self.count(batch, started)
            if self._woken is not None:
                self._woken.clear()  # this tick answers whatever set it; a later set wakes the next fetch
            await self._attempt(self.handler.tick, stop)
            if time.monotonic() - self._lag_reported >= LAG_REPORT_INTERVAL_S:
                await self.report_lag()
            if time.monotonic() - self._last_commit >= self.commit_interval_s:
                await self.commit()

    async def _fetch(self, timeout_ms: int) -> Batch:
        """The records fetched within ``timeout_ms``, or those already here once ``woken`` is set.

        aiokafka's ``getmany`` may be cancelled while it waits: records are taken from the
        fetcher only when it returns, so none are lost."""
        woken = self._woken
        if woken is None or woken.is_set():
            wait_ms = timeout_ms if woken is None else 0
            return await self.consumer.getmany(timeout_ms=wait_ms, max_records=self.max_records)
        fetch = asyncio.ensure_future(self.consumer.getmany(timeout_ms=timeout_ms, max_records=self.max_records))
        wake = asyncio.ensure_future(woken.wait())
        try:
            await asyncio.wait((fetch, wake), return_when=asyncio.FIRST_COMPLETED)
        finally:
            wake.cancel()
            if not fetch.done():
                fetch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await fetch
        if fetch.cancelled():
            return {}
        fetched: Batch = fetch.result()
        return fetched

    async def _rewind(self) -> None:
        self._fetch_start.clear()
        for tp in self.consumer.assignment():
            committed = await self.consumer.committed(tp)
            if committed is None:
                committed = (await self.consumer.beginning_offsets([tp]))[tp]
            self.consumer.seek(tp, committed)

    async def _attempt(self, call: Callable[[], Awaitable[None]], stop: asyncio.Event) -> bool:
        """Handle a batch (or tick); False when it failed (the records are read again) or on a stop.

        A failed batch is never retried on the handler's state as it stands: the handler may
        have changed that state for effects that never became durable (a rollout folded, a
        queued rollout reserved for a claim whose event was never written), and a retry would
        take those as done. So after a broker error the handler starts over as after a
        rebalance: it forgets its partitions, rebuilds them from what is durable, and the
        records are read again from the committed offsets (handlers are idempotent). Backoff
        0.5 s doubling to 30 s while that fails too.
        """
        try:
            await call()
            self.failures = 0
            return True
        except self.retry_on as error:
            log.warning("batch failed; rebuilding the partitions from what is durable", error=_brief(error))
        while not stop.is_set():
            self.failures += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), RESTART.after(self.failures))  # backoff, cut short by a stop
            if stop.is_set():
                break
            try:
                await self._start_over()
                return False
            except self.retry_on as error:
                log.warning("rebuilding after a failed batch failed; retrying", error=_brief(error))
        return False

    async def _start_over(self) -> None:
        owned = set(self.consumer.assignment())
        await self.commit()  # what was handled before the failed batch is durable: not read again
        self.handler.revoked(owned)
        self.forget(owned)
        await self.handler.assigned(owned)
        await self._rewind()


def _brief(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:300]


async def run_processor(
    settings: Settings,
    handler: Handler,
    *,
    name: str,
    topics: Sequence[str],
    stop: asyncio.Event,
    ready_as: str | None = None,
    max_records: int = 5000,
    commit_interval_s: float = 0.2,
    on_start: Callable[[AIOKafkaConsumer], None] | None = None,
    retry_on: tuple[type[BaseException], ...] = (KafkaError, TimeoutError),
    group_id: str | None = None,
    **consumer_options: Any,
) -> None:
    """Run ``handler`` as member of group ``group_id`` (default ``<prefix>.<name>``) on ``topics``
    until ``stop`` is set.

    Partitions are assigned by range, so equal partition numbers of co-partitioned topics go to
    the same member. ``ready_as``: the stack's name of the role, whose ready file
    (:meth:`Settings.ready_file`) is written once the first assignment was handled: what
    ``agl-stream up`` waits for. ``on_start`` gets the consumer (for positions).
    ``retry_on``: the errors of ``handle`` after which the handler starts over on its partitions
    and reads the batch again, with backoff (others end the loop); a handler's ``assigned`` that
    fails in a rebalance ends it too.
    """
    group = group_id or f"{settings.topic_prefix}.{name}"
    consumer = make_consumer(
        settings,
        group_id=group,
        max_poll_records=max_records,
        partition_assignment_strategy=(RangePartitionAssignor,),
        # A member killed with -9 holds its partitions until its session times out.
        session_timeout_ms=6000,
        heartbeat_interval_ms=1500,
        **consumer_options,
    )
    loop = _Loop(
        consumer,
        handler,
        max_records=max_records,
        commit_interval_s=commit_interval_s,
        retry_on=retry_on,
        group=group,
    )
    consumer.subscribe(list(topics), listener=_Rebalance(loop))
    if on_start is not None:
        on_start(consumer)
    await consumer.start()
    ready_task: asyncio.Task[None] | None = None
    if ready_as is not None:
        ready_task = asyncio.create_task(_signal_ready(settings.ready_file(ready_as), loop.assigned_once, name))
    try:
        while not stop.is_set():
            await loop.step(stop)
        async with loop.lock:
            await loop.commit()
        if loop.failure is not None:
            raise loop.failure
    finally:
        if ready_task is not None:
            ready_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ready_task
        await consumer.stop()


async def _signal_ready(path: Path, assigned: asyncio.Event, name: str) -> None:
    await assigned.wait()
    _write_ready(path)
    log.info("processor ready", processor=name)


def _write_ready(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(str(os.getpid()))
