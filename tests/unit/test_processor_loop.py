"""The processor skeleton's start-over (agl_stream/kafka/processor.py ``_Loop``): after a broker
error in ``handle`` or ``tick`` the handler forgets its partitions, rebuilds them, and the
records are read again from the committed offsets. The loop logic is pure bookkeeping over the
consumer's surface; a stand-in for that surface (assignment, commits, seeks) is enough here.
The real broker version of the same path is tests/integration/test_cluster.py."""

from __future__ import annotations

import asyncio
from typing import Any

from aiokafka import ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaConnectionError
from aiokafka.structs import OffsetAndMetadata

from agl_stream.kafka.processor import Batch, _Loop

TP = TopicPartition("agl.events", 0)


class Consumer:
    """The part of AIOKafkaConsumer the loop uses, over one partition with ``records``."""

    def __init__(self, records: list[ConsumerRecord[bytes, bytes]]) -> None:
        self.records = records
        self.at = 0
        self.committed_offset: int | None = None
        self.seeks: list[int] = []

    def assignment(self) -> set[TopicPartition]:
        return {TP}

    async def getmany(self, *, timeout_ms: int, max_records: int) -> Batch:
        fetched = self.records[self.at : self.at + max_records]
        self.at += len(fetched)
        return {TP: fetched} if fetched else {}

    async def commit(self, offsets: dict[TopicPartition, OffsetAndMetadata]) -> None:
        self.committed_offset = offsets[TP].offset

    async def committed(self, tp: TopicPartition) -> int | None:
        return self.committed_offset

    async def beginning_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        return dict.fromkeys(tps, 0)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.seeks.append(offset)
        self.at = offset

    async def position(self, tp: TopicPartition) -> int:
        return self.at

    def highwater(self, tp: TopicPartition) -> int:
        return len(self.records)


class Handler:
    """Counts what it is asked; its tick fails with a broker error ``tick_failures`` times."""

    def __init__(self, tick_failures: int) -> None:
        self.tick_failures = tick_failures
        self.handled: list[int] = []
        self.calls: list[str] = []

    async def assigned(self, partitions: set[TopicPartition]) -> None:
        self.calls.append("assigned")

    def revoked(self, partitions: set[TopicPartition]) -> None:
        self.calls.append("revoked")

    async def handle(self, batch: Batch) -> None:
        self.handled.extend(r.offset for r in batch[TP])

    async def tick(self) -> None:
        if self.tick_failures:
            self.tick_failures -= 1
            raise KafkaConnectionError("the broker went away")

    def poll_timeout(self) -> float:
        return 0.01


def _records(n: int) -> list[ConsumerRecord[bytes, bytes]]:
    return [ConsumerRecord(TP.topic, 0, i, 0, 0, b"k", b"v", None, 1, 1, []) for i in range(n)]


def _loop(consumer: Consumer, handler: Handler, **options: Any) -> _Loop:
    return _Loop(consumer, handler, max_records=2, commit_interval_s=3600.0, **options)  # type: ignore[arg-type]


async def test_a_failed_tick_starts_the_handler_over_and_the_records_are_read_again() -> None:
    consumer, handler = Consumer(_records(4)), Handler(tick_failures=1)
    loop = _loop(consumer, handler)
    stop = asyncio.Event()
    await loop.step(stop)  # records 0-1 handled, then the tick fails: start over
    assert handler.calls == ["revoked", "assigned"]
    # What was handled before the failure was committed first; the fetch resumes from there.
    assert consumer.committed_offset == 2 and consumer.seeks == [2]
    assert loop.failures == 1
    await loop.step(stop)
    await loop.step(stop)
    assert handler.handled == [0, 1, 2, 3]
    assert loop.failures == 0  # a tick that passed resets the backoff


async def test_a_stop_cuts_the_backoff_of_a_failing_start_over_short() -> None:
    consumer, handler = Consumer(_records(2)), Handler(tick_failures=1)
    loop = _loop(consumer, handler)

    rebuilding = asyncio.Event()

    async def assigned_fails(partitions: set[TopicPartition]) -> None:
        rebuilding.set()
        raise KafkaConnectionError("still down")

    handler.assigned = assigned_fails  # type: ignore[method-assign]
    stop = asyncio.Event()
    step = asyncio.create_task(loop.step(stop))
    await asyncio.wait_for(rebuilding.wait(), 60)  # the first rebuild fails too: a longer backoff
    assert loop.failures == 2 and not step.done()
    stop.set()
    await asyncio.wait_for(step, 60)  # returns at once instead of retrying for ever
    assert loop.failures >= 2


async def test_lag_is_the_high_watermark_less_the_next_offset_to_handle() -> None:
    from prometheus_client import REGISTRY

    from agl_stream import metrics

    consumer, handler = Consumer(_records(6)), Handler(tick_failures=0)
    consumer.at = 2  # the committed offset a fetch starts from
    asked: list[TopicPartition] = []
    position = consumer.position

    async def counted_position(tp: TopicPartition) -> int:
        asked.append(tp)
        return await position(tp)

    consumer.position = counted_position  # type: ignore[method-assign]
    loop = _loop(consumer, handler, group="g-lag")
    labels = {"role": metrics.role(), "group": "g-lag", "topic": TP.topic, "partition": "0"}

    def lag() -> float | None:
        return REGISTRY.get_sample_value("agl_consumer_lag_records", labels)

    await loop.report_lag()
    await loop.report_lag()
    assert lag() == 4  # nothing handled yet: from the fetch position, asked once, not per report
    assert asked == [TP]
    await loop.step(asyncio.Event())  # handles offsets 2-3
    await loop.report_lag()
    assert lag() == 2 and asked == [TP]
    loop.forget([TP])  # a revoked partition's gauge goes
    assert lag() is None


class WaitingConsumer(Consumer):
    """A fetch with no records waits its whole timeout, as the broker's long poll does."""

    async def getmany(self, *, timeout_ms: int, max_records: int) -> Batch:
        if self.at >= len(self.records):
            await asyncio.sleep(timeout_ms / 1000)
        return await super().getmany(timeout_ms=timeout_ms, max_records=max_records)


class WokenHandler(Handler):
    """Waits an hour between fetches unless woken; counts its ticks and whether it was woken then."""

    def __init__(self) -> None:
        super().__init__(tick_failures=0)
        self.woken = asyncio.Event()
        self.ticks: list[bool] = []

    async def tick(self) -> None:
        self.ticks.append(self.woken.is_set())

    def poll_timeout(self) -> float:
        return 3600.0


async def test_a_woken_handler_ticks_at_once_instead_of_after_its_poll_timeout() -> None:
    consumer, handler = WaitingConsumer(_records(2)), WokenHandler()
    loop = _loop(consumer, handler)
    stop = asyncio.Event()
    await loop.step(stop)  # records there: no wait
    assert handler.handled == [0, 1] and handler.ticks == [False]
    step = asyncio.create_task(loop.step(stop))  # nothing to fetch: would wait an hour
    await asyncio.sleep(0.05)
    assert not step.done()
    handler.woken.set()
    await asyncio.wait_for(step, 60)
    assert handler.ticks == [False, False]  # cleared before the tick that answers it
    handler.woken.set()  # set while no fetch waits: the next one does not wait at all
    await asyncio.wait_for(loop.step(stop), 60)
    assert len(handler.ticks) == 3
    consumer.records.extend(_records(3)[2:])  # records after a cut-short fetch are still read
    await asyncio.wait_for(loop.step(stop), 60)
    assert handler.handled == [0, 1, 2]
