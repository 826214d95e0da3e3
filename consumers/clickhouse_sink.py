"""The ClickHouse sink: materializes ``agl.spans`` into the ``otel_traces`` table.

Exactly-once into ClickHouse without transactions:
1. each batch is one INSERT, atomic in the engine (see infra/clickhouse/001_otel_traces.sql);
2. every row carries its Kafka (partition, offset); on partition assignment the sink seeks to
   the position after the highest offset already in the table, or the committed offset if that
   is further, so a crash between INSERT and commit never re-inserts a batch;
3. Kafka offsets are committed only after the INSERT (and the sink_offsets record) succeeded.
Records that do not decode go to agl.dlq first; the sink keeps going.
"""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from clickhouse_connect.driver.client import Client

from agl_stream.clickhouse.client import get_client
from agl_stream.clickhouse.migrations import migrate
from agl_stream.clickhouse.rows import SPAN_COLUMNS, span_row
from agl_stream.config import Settings
from agl_stream.kafka.io import BatchConsumer, DeadLetters, Decoded, make_consumer, make_producer
from agl_stream.logs import get_logger

log = get_logger("agl.sink")

SINK_NAME = "clickhouse-spans"


@dataclass
class SinkStats:
    rows: int = 0
    batches: int = 0
    dead_lettered: int = 0
    started: float = field(default_factory=time.monotonic)


class _SeekToApplied(ConsumerRebalanceListener):  # type: ignore[misc]
    """On assignment, skip what the table already holds (the crash-between-insert-and-commit case)."""

    def __init__(self, sink: SpanSink) -> None:
        self.sink = sink

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        pass

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        await self.sink.seek_past_applied(assigned)


class SpanSink:
    def __init__(
        self,
        settings: Settings,
        client: Client,
        *,
        batch_size: int = 10_000,
        flush_ms: int = 200,
        group_id: str | None = None,
    ) -> None:
        self.settings = settings
        self.client = client
        self.batch_size = batch_size
        self.flush_ms = flush_ms
        self.topic = settings.topic("spans")
        self.group_id = group_id or f"{settings.topic_prefix}.sink.{SINK_NAME}"
        self.table = f"{settings.clickhouse_database}.otel_traces"
        self.stats = SinkStats()
        self._stopping = asyncio.Event()
        self.consumer: AIOKafkaConsumer | None = None

    def stop(self) -> None:
        self._stopping.set()

    def applied_offsets(self) -> dict[int, int]:
        """Per partition, the next offset after the last row already in the table."""
        rows = self.client.query(
            f"SELECT KafkaPartition, max(KafkaOffset) + 1 FROM {self.table} GROUP BY KafkaPartition"
        ).result_rows
        return {int(p): int(o) for p, o in rows}

    async def seek_past_applied(self, assigned: list[TopicPartition]) -> None:
        assert self.consumer is not None
        applied = await asyncio.to_thread(self.applied_offsets)
        for tp in assigned:
            committed = await self.consumer.committed(tp)
            target = max(applied.get(tp.partition, 0), committed or 0)
            if target > (committed or 0):
                log.info(
                    "resuming past rows already applied", partition=tp.partition, offset=target, committed=committed
                )
            if target > 0:
                self.consumer.seek(tp, target)

    async def run(self) -> SinkStats:
        await asyncio.to_thread(migrate, self.client, self.settings.clickhouse_database)
        producer = make_producer(self.settings)
        self.consumer = make_consumer(self.settings, group_id=self.group_id, max_poll_records=self.batch_size)
        self.consumer.subscribe([self.topic], listener=_SeekToApplied(self))
        await producer.start()
        await self.consumer.start()
        batches = BatchConsumer(
            self.consumer, DeadLetters(self.settings, producer, processor=SINK_NAME), expected_schema="agl.Span"
        )
        log.info("sink started", topic=self.topic, table=self.table, group=self.group_id)
        try:
            while not self._stopping.is_set():
                await self._one_batch(batches)
        finally:
            await self.consumer.stop()
            await producer.stop()
            self.stats.dead_lettered = batches.dead_letters.count
            log.info("sink stopped", rows=self.stats.rows, batches=self.stats.batches, dlq=self.stats.dead_lettered)
        return self.stats

    async def _one_batch(self, batches: BatchConsumer) -> None:
        records: list[Decoded] = []
        next_offsets: dict[TopicPartition, int] = {}
        deadline = time.monotonic() + self.flush_ms / 1000
        # Fill up to batch_size or until the flush interval passes: fewer, larger INSERTs.
        while len(records) < self.batch_size and not self._stopping.is_set():
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0 and (records or next_offsets):
                break
            decoded, offsets = await batches.next_batch(
                max_records=self.batch_size - len(records), timeout_ms=max(remaining_ms, 1)
            )
            records.extend(decoded)
            next_offsets.update(offsets)
            if remaining_ms <= 0:
                break
        if not next_offsets:
            return
        if records:
            rows = [span_row(r.value, r.partition, r.offset) for r in records]
            await self._insert_with_retry(rows, next_offsets)
        await batches.commit(next_offsets)
        self.stats.rows += len(records)
        self.stats.batches += 1

    async def _insert_with_retry(self, rows: list[list[Any]], next_offsets: dict[TopicPartition, int]) -> None:
        delay = 0.5
        while True:
            try:
                await asyncio.to_thread(self._insert, rows, next_offsets)
                return
            except Exception as exc:  # ClickHouse down or refusing: keep the batch, retry
                if self._stopping.is_set():
                    raise
                log.warning("insert failed, retrying", error=str(exc)[:300], retry_in_s=delay)
                await asyncio.sleep(delay)  # backoff between retries, not synchronisation
                delay = min(delay * 2, 30.0)

    def _insert(self, rows: list[list[Any]], next_offsets: dict[TopicPartition, int]) -> None:
        self.client.insert(self.table, rows, column_names=SPAN_COLUMNS)
        now_ms = int(time.time() * 1000)
        self.client.insert(
            f"{self.settings.clickhouse_database}.sink_offsets",
            [[SINK_NAME, tp.topic, tp.partition, offset, now_ms] for tp, offset in next_offsets.items()],
            column_names=["Sink", "Topic", "Partition", "NextOffset", "AppliedAt"],
        )


async def run_sink(settings: Settings, **options: Any) -> SinkStats:
    """Run until SIGTERM/SIGINT; the embedded engine is opened (and locked) by this process."""
    client = get_client(settings)
    sink = SpanSink(settings, client, **options)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, sink.stop)
    try:
        return await sink.run()
    finally:
        client.close()


def main(settings: Settings, **options: Any) -> SinkStats:
    return asyncio.run(run_sink(settings, **options))
