"""The ClickHouse sink: materializes Kafka topics into ClickHouse tables, exactly once.

ClickHouse decodes the Avro, not Python: each batch is handed over as one Avro container of
(partition, offset, record body) envelopes and loaded by one INSERT into a Null table whose
materialized view writes the real table (agl_stream/clickhouse/avro_ingest.py). Python only
checks headers and concatenates bytes, so the sink keeps up with what Kafka delivers.

Exactly-once into ClickHouse without transactions:
1. one INSERT per batch, one part in the target table (no PARTITION BY): atomic in the engine;
2. every row carries its Kafka partition and offset; on assignment the sink seeks past the
   highest offset already in the table, or the committed offset if further, so a crash between
   INSERT and commit never inserts a batch twice;
3. Kafka offsets are committed only after the INSERT (and the sink_offsets record) succeeded.

Bad input never stops the sink: records with an unknown fingerprint, another record type or an
undecodable body go to agl.dlq. Records written with an older schema version are decoded,
resolved to the current schema and re-encoded. A block ClickHouse rejects is checked record by
record in Python; the bad ones go to the DLQ and the rest is inserted.
"""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from clickhouse_connect.driver.client import Client

from agl_stream.clickhouse import avro_ingest
from agl_stream.clickhouse.client import get_client
from agl_stream.clickhouse.migrations import migrate
from agl_stream.codec import HEADER_SIZE, MAGIC, Codec
from agl_stream.config import Settings
from agl_stream.errors import CodecError, RecordTypeError
from agl_stream.kafka.io import BatchConsumer, DeadLetters, Fetched, Rejected, make_consumer, make_producer
from agl_stream.logs import get_logger
from agl_stream.resources import resource_path

log = get_logger("agl.sink")


@dataclass(frozen=True)
class SinkSpec:
    """One topic -> one table."""

    name: str  # also names the consumer group and the sink_offsets rows
    topic: str  # short name, without the prefix
    record: str  # Avro full name of the topic's values
    table: str
    transform: str  # SELECT file under infra/clickhouse/ingest/

    def group_id(self, settings: Settings) -> str:
        return f"{settings.topic_prefix}.sink.{self.name}"


SPANS = SinkSpec("clickhouse-spans", "spans", "agl.Span", "otel_traces", "otel_traces.sql")


@dataclass
class SinkStats:
    rows: int = 0
    batches: int = 0
    dead_lettered: int = 0
    started: float = field(default_factory=time.monotonic)
    first_record_at: float | None = None  # monotonic; after the group join and seek


class EnvelopeBody:
    """``prepare`` for the BatchConsumer: the Avro body of a record in the current schema.

    A record in the current schema costs a slice; an older known version is resolved and
    re-encoded; anything else raises CodecError (-> DLQ).
    """

    def __init__(self, codec: Codec, record: str) -> None:
        self.codec = codec
        self.record = record
        self.current = codec.fingerprint(record).to_bytes(8, "little")

    def __call__(self, data: bytes) -> memoryview:
        if data[:2] == MAGIC and data[2:HEADER_SIZE] == self.current:
            return memoryview(data)[HEADER_SIZE:]
        name, value = self.codec.decode_dict(data)
        if name != self.record:
            raise RecordTypeError(f"expected a {self.record} record, got {name}")
        return memoryview(self.codec.encode_dict(name, value))[HEADER_SIZE:]

    def check(self, data: bytes) -> None:
        """Full decode, for finding the record that made ClickHouse reject a block."""
        name, _ = self.codec.decode_dict(data)
        if name != self.record:
            raise RecordTypeError(f"expected a {self.record} record, got {name}")


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    """Finish the batch being written before partitions move; start new ones past what is applied."""

    def __init__(self, sink: TableSink) -> None:
        self.sink = sink

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        # An INSERT in flight commits before we let go; records fetched but not yet written are
        # dropped by the batch loop (the generation changes) and read again by their next owner.
        async with self.sink.writing:
            self.sink.generation += 1
        log.info("partitions revoked", partitions=len(revoked))

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        self.sink.generation += 1
        await self.sink.seek_past_applied(assigned)
        log.info("partitions assigned", partitions=sorted(tp.partition for tp in assigned))


class TableSink:
    def __init__(
        self,
        settings: Settings,
        client: Client,
        spec: SinkSpec = SPANS,
        *,
        batch_size: int = 10_000,
        flush_ms: int = 200,
        codec: Codec | None = None,
    ) -> None:
        self.settings = settings
        self.client = client
        self.spec = spec
        self.batch_size = batch_size
        self.flush_ms = flush_ms
        self.codec = codec or Codec.default()
        self.topic = settings.topic(spec.topic)
        self.db = settings.clickhouse_database
        self.table = f"{self.db}.{spec.table}"
        self.bodies = EnvelopeBody(self.codec, spec.record)
        schema = self.codec.contract.schema(spec.record)
        self.header = avro_ingest.container_header(schema.expanded)
        self.ingest_table = avro_ingest.ingest_table(self.db, spec.table, schema.fingerprint_hex)
        self.stats = SinkStats()
        self._stopping = asyncio.Event()
        self.consumer: AIOKafkaConsumer | None = None
        # Rebalance safety: `writing` is held from INSERT to commit; `generation` changes on every
        # revoke/assign, so a batch that straddles one is dropped instead of written twice.
        self.writing = asyncio.Lock()
        self.generation = 0

    def stop(self) -> None:
        self._stopping.set()

    # -- set-up ---------------------------------------------------------------------------

    def prepare_tables(self) -> None:
        migrate(self.client, self.db)
        schema = self.codec.contract.schema(self.spec.record)
        transform = resource_path(f"infra/clickhouse/ingest/{self.spec.transform}").read_text()
        for statement in avro_ingest.ingest_ddl(
            self.db, self.spec.table, schema.fingerprint_hex, schema.expanded, transform
        ):
            self.client.command(statement)

    def applied_offsets(self) -> dict[int, int]:
        """Per partition, the offset after the last row already in the table."""
        rows = self.client.query(
            f"SELECT KafkaPartition, max(KafkaOffset) + 1 FROM {self.table} GROUP BY KafkaPartition"
        ).result_rows
        return {int(p): int(o) for p, o in rows}

    async def seek_past_applied(self, assigned: list[TopicPartition]) -> None:
        assert self.consumer is not None
        applied = await asyncio.to_thread(self.applied_offsets)
        for tp in assigned:
            committed = await self.consumer.committed(tp) or 0
            target = max(applied.get(tp.partition, 0), committed)
            if target > committed:
                log.info("skipping rows already applied", partition=tp.partition, offset=target, committed=committed)
            if target > 0:
                self.consumer.seek(tp, target)

    # -- the loop -------------------------------------------------------------------------

    async def run(self) -> SinkStats:
        await asyncio.to_thread(self.prepare_tables)
        producer = make_producer(self.settings)
        self.consumer = make_consumer(
            self.settings, group_id=self.spec.group_id(self.settings), max_poll_records=self.batch_size
        )
        self.consumer.subscribe([self.topic], listener=_Rebalance(self))
        await producer.start()
        await self.consumer.start()
        batches = BatchConsumer(
            self.consumer, DeadLetters(self.settings, producer, processor=f"sink.{self.spec.name}"), self.bodies
        )
        log.info("sink started", topic=self.topic, table=self.table, group=self.spec.group_id(self.settings))
        try:
            while not self._stopping.is_set():
                await self._one_batch(batches)
        finally:
            await self.consumer.stop()
            await producer.stop()
            self.stats.dead_lettered = batches.dead_letters.count
            log.info("sink stopped", rows=self.stats.rows, batches=self.stats.batches, dlq=self.stats.dead_lettered)
        return self.stats

    async def _one_batch(self, batches: BatchConsumer[memoryview]) -> None:
        records: list[Fetched[memoryview]] = []
        next_offsets: dict[TopicPartition, int] = {}
        generation = self.generation
        deadline = time.monotonic() + self.flush_ms / 1000
        # Fill up to batch_size or until the flush interval passes: fewer, larger INSERTs.
        while len(records) < self.batch_size and not self._stopping.is_set():
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0 and next_offsets:
                break
            fetched, offsets = await batches.next_batch(
                max_records=self.batch_size - len(records), timeout_ms=max(remaining_ms, 1)
            )
            records.extend(fetched)
            next_offsets.update(offsets)
            if fetched and self.stats.first_record_at is None:
                self.stats.first_record_at = time.monotonic()
            if remaining_ms <= 0:
                break
        if not next_offsets:
            return
        async with self.writing:
            if generation != self.generation:
                # Partitions moved while this batch was filling: positions were reset by the
                # assignment, so drop the batch and read again from what is applied.
                assert self.consumer is not None
                await self.seek_past_applied(list(self.consumer.assignment()))
                return
            if records:
                self.stats.rows += await self._insert_with_retry(records, next_offsets, batches.dead_letters)
            else:
                await asyncio.to_thread(self._record_offsets, next_offsets)
            await batches.commit(next_offsets)
            self.stats.batches += 1

    async def _insert_with_retry(
        self, records: list[Fetched[memoryview]], next_offsets: dict[TopicPartition, int], dead_letters: DeadLetters
    ) -> int:
        delay = 0.5
        checked = False
        while True:
            try:
                await asyncio.to_thread(self._insert, records, next_offsets)
                return len(records)
            except Exception as exc:
                if self._stopping.is_set():
                    raise
                if not checked:
                    # Maybe a record ClickHouse cannot read: find it in Python, dead-letter it.
                    checked = True
                    records, bad = self._split_bad(records)
                    if bad:
                        log.warning("ClickHouse rejected a block; dead-lettering bad records", bad=len(bad))
                        await dead_letters.send_many(bad)
                        continue
                # The engine is down or refusing: keep the batch (offsets stay uncommitted) and retry.
                log.warning("insert failed, retrying", error=str(exc)[:300], retry_in_s=delay)
                await asyncio.sleep(delay)  # backoff between retries, not synchronisation
                delay = min(delay * 2, 30.0)

    def _split_bad(self, records: list[Fetched[memoryview]]) -> tuple[list[Fetched[memoryview]], list[Rejected]]:
        good, bad = [], []
        for record in records:
            try:
                self.bodies.check(record.raw)
            except CodecError as error:
                bad.append(Rejected.of(record, error))
            else:
                good.append(record)
        return good, bad

    def _insert(self, records: list[Fetched[memoryview]], next_offsets: dict[TopicPartition, int]) -> None:
        if records:
            block = avro_ingest.container(self.header, [(r.partition, r.offset, r.value) for r in records])
            self.client.raw_insert(self.ingest_table, insert_block=block, fmt="Avro")
        self._record_offsets(next_offsets)

    def _record_offsets(self, next_offsets: dict[TopicPartition, int]) -> None:
        now_ms = int(time.time() * 1000)
        self.client.insert(
            f"{self.db}.sink_offsets",
            [[self.spec.name, tp.topic, tp.partition, offset, now_ms] for tp, offset in next_offsets.items()],
            column_names=["Sink", "Topic", "Partition", "NextOffset", "AppliedAt"],
        )


async def run_sink(settings: Settings, **options: Any) -> SinkStats:
    """Run until SIGTERM/SIGINT; the embedded engine is opened (and locked) by this process."""
    client = get_client(settings)
    sink = TableSink(settings, client, **options)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, sink.stop)
    try:
        return await sink.run()
    finally:
        client.close()


def main(settings: Settings, **options: Any) -> SinkStats:
    return asyncio.run(run_sink(settings, **options))
