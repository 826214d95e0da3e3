"""The ClickHouse sinks: materialize Kafka topics into ClickHouse tables.

ClickHouse decodes the Avro, not Python: each batch is handed over as one Avro container of
(partition, offset, record body) envelopes and loaded by one INSERT into a Null table whose
materialized views (one per target table) write the real tables
(agl_stream/clickhouse/avro_ingest.py). Python only checks headers and concatenates bytes, so a
sink keeps up with what Kafka delivers. A topic may carry a second record type that becomes the
first by bytes alone (SinkSpec.also): agl.spans holds agl.SpanBatch records, exploded into one
row per span by the view (SinkSpec.explode), and single agl.Span records, each handed over as a
one-span batch.

Applying a batch twice must never show twice. Two resume policies (SinkSpec.resume):
- "data" (spans): one INSERT is one part of the one target table, atomic in the engine; every
  row carries its Kafka partition and offset, and on assignment the sink seeks past the highest
  offset already in the table (or the committed offset if further). A crash between INSERT and
  commit never inserts a batch twice.
- "committed" (state topics): the sink resumes from the committed offsets. With several target
  tables one INSERT is not atomic across them, so a crash between INSERT and commit re-applies
  the batch; the tables are ReplacingMergeTrees read with FINAL, so the copies never show.
Either way Kafka offsets are committed only after the INSERT and its sink_offsets record (with
the embedded engine that record is written every few seconds: see OFFSETS_ROW_INTERVAL_S).

Each sink is a handler on the processor skeleton (``agl_stream.kafka.processor``) that holds
records: a fetch joins the batch being filled, the batch is inserted when it is full, its
linger has passed or a reader waits (``wanted``; whoever supplies it wakes the sinks when a
reader starts waiting: ``SinkGroup.wake``), and ``committable`` keeps the commit below
the batch's first record until then. The sinks of a process share a consumer per lane
(``run_sinks``, ``SinkSpec.lane``): an idle gateway makes two heartbeats and two fetches where
eight sinks made eight. Concurrency model: the skeleton's one loop task calls every
method of every sink (rebalances under the loop's lock); the sinks' work on one fetch runs as
concurrent coroutines, each sink's INSERT in a worker thread on its own engine client. In the
gateway that loop is a thread of its own (``SinkThread``), apart from the loop serving HTTP.

Bad input never stops a sink: records with an unknown fingerprint, another record type or an
undecodable body go to agl.dlq. Records written with an older schema version are decoded,
resolved to the current schema and re-encoded. A block ClickHouse rejects is checked record by
record in Python, then, if Python finds nothing, by the engine itself through a probe pipeline
that writes nothing (a NaN start time decodes but is no DateTime64); the bad ones go to the DLQ
and the rest is inserted. A span batch is good or bad as a whole. Tombstones (null values on
compacted topics) are skipped where the spec says so: forgetting a key in Kafka does not delete
history from the read side.

One exception to "the engine decodes": agl.ResourcesUpdate holds a union of two records with
the same shape (LLM, ProxyLLM), which the engine's Avro reader cannot map to a Variant (the
type mapping merges them and the reader then refuses the union). Resources are few and small,
so that sink decodes in Python and inserts rows (SinkSpec.python_rows).

``on_applied(topic, {partition: next_offset})`` is called once a batch is visible in
ClickHouse: the gateway releases its offset fences on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from aiokafka import AIOKafkaConsumer, TopicPartition
from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import DatabaseError

from agl_stream import metrics
from agl_stream.clickhouse import avro_ingest
from agl_stream.clickhouse.client import get_client
from agl_stream.clickhouse.migrations import migrate
from agl_stream.config import Settings
from agl_stream.errors import AglError, CodecError, RecordTypeError
from agl_stream.kafka.io import Fetched, Outbox, Rejected, prepare_records
from agl_stream.kafka.processor import Batch, run_processor
from agl_stream.local.processes import stop_on_signals
from agl_stream.logs import describe, get_logger
from agl_stream.models import MODELS
from agl_stream.retry import RESTART
from agl_stream.wire.codec import HEADER_SIZE, MAGIC, Codec
from consumers.sink_specs import (
    SPANS,
    SPECS,
    AlsoReads,
    Lane,
    SinkSpec,
    ingest_ddl,
    sinks_group_id,
)

log = get_logger("agl.sink")

OnApplied = Callable[[str, Mapping[int, int]], None]
"""``on_applied(topic, {partition: next offset})``: those records are visible in ClickHouse."""
Wanted = Callable[[str], bool]
"""``wanted(topic)``: a reader waits for records of this topic, so a lingering batch flushes now.
Asked on the sinks' loop after a fetch or a wake; the supplier wakes the sinks (``SinkGroup.wake``)
when a reader starts waiting, so a lingering sink need not poll it."""

_IDLE_POLL_MS = 500  # how long an idle sink waits for a first record
# One INSERT must make one part for the "data" resume policy. The engine squashes what a view
# writes into blocks of min_insert_block_size_rows (~1M) or _bytes (256 MB in memory), and
# writes a part per block: exploded span batches pass the byte threshold (measured: 100k spans
# of 1.9 KB made two parts). Rows off, bytes out of reach: the whole INSERT is one block.
_ONE_PART_SETTINGS = {"min_insert_block_size_rows": 0, "min_insert_block_size_bytes": 1 << 40}
# The engine plans every view of an ingest table again for each INSERT, whatever its rows. The
# plan's optimization passes find nothing to improve in a projection over an ARRAY JOIN and
# cost ~15 ms of the ~50 ms it takes to plan the span view (most of a small INSERT's cost).
_INGEST_SETTINGS = {"query_plan_enable_optimizations": 0}


class EngineRefusedError(AglError):
    """A record decodes, but ClickHouse refuses to make rows of it (its message says why)."""


T = TypeVar("T")


def newest_per_key(records: list[Fetched[T]]) -> list[Fetched[T]]:
    """The newest record of every (partition, key), in log order; keyless records all stay."""
    newest = {(r.partition, r.key): r.offset for r in records if r.key is not None}
    return [r for r in records if r.key is None or newest[(r.partition, r.key)] == r.offset]


@dataclass
class SinkStats:
    records: int = 0  # Kafka records inserted (a span batch is one record, many rows)
    batches: int = 0
    dead_lettered: int = 0
    tombstones: int = 0
    superseded: int = 0  # records of a key a newer record of the same batch replaced
    started: float = field(default_factory=time.monotonic)
    first_record_at: float | None = None  # monotonic; after the group join and seek


class EnvelopeBody:
    """``prepare`` for ``prepare_records``: the Avro body of a record in the current schema.

    A record in the current schema costs a slice; a record of an ``also`` type in its current
    schema is turned into a body of ``record`` by its ``to_body`` (bytes only); an older known
    version of either is resolved and re-encoded first; a tombstone is None where tombstones
    are skipped; anything else raises CodecError (-> DLQ). ``prepare_records`` hands over
    ``value or b""``, so an empty value counts as a tombstone too.
    """

    def __init__(
        self, codec: Codec, record: str, *, skip_tombstones: bool = False, also: Sequence[AlsoReads] = ()
    ) -> None:
        self.codec = codec
        self.record = record
        self.skip_tombstones = skip_tombstones
        self.current = codec.fingerprint(record).to_bytes(8, "little")
        self.also = {a.record: a.to_body for a in also}
        self.also_current = {codec.fingerprint(a.record).to_bytes(8, "little"): a.to_body for a in also}
        self.expected = " or ".join((record, *self.also))

    def __call__(self, data: bytes) -> memoryview | None:
        if data[:2] == MAGIC:
            fingerprint = data[2:HEADER_SIZE]
            if fingerprint == self.current:
                return memoryview(data)[HEADER_SIZE:]
            to_body = self.also_current.get(fingerprint)
            if to_body is not None:
                return memoryview(to_body(memoryview(data)[HEADER_SIZE:]))
        if not data and self.skip_tombstones:
            return None
        name, value = self.codec.decode_dict(data)
        if name == self.record:
            return memoryview(self.codec.encode_dict(name, value))[HEADER_SIZE:]
        to_body = self.also.get(name)
        if to_body is None:
            raise RecordTypeError(f"expected a {self.expected} record, got {name}")
        return memoryview(to_body(memoryview(self.codec.encode_dict(name, value))[HEADER_SIZE:]))

    def check(self, data: bytes) -> None:
        """Full decode, for finding the record that made ClickHouse reject a block (a batch
        with one bad item is bad as a whole)."""
        name, _ = self.codec.decode_dict(data)
        if name != self.record and name not in self.also:
            raise RecordTypeError(f"expected a {self.expected} record, got {name}")


OFFSETS_ROW_INTERVAL_S = 5.0
"""With the embedded engine, how often a sink writes its ``sink_offsets`` row (each is an INSERT of
its own, 5-8 ms of engine CPU, next to the ~16 ms of a small batch's). Nothing outside the gateway's
process reads that engine and the gateway's fences follow the sinks' notices in memory, so the row
only tells a restarted gateway where its fences start (the sinks' resume positions follow at once);
it is written at a clean stop too. With a ClickHouse server the row goes with every batch: readers
there wait on it (ClickHouseReadSide)."""


class TableSink:
    def __init__(
        self,
        settings: Settings,
        client: Client,
        spec: SinkSpec = SPANS,
        *,
        batch_size: int | None = None,
        flush_ms: int | None = None,
        codec: Codec | None = None,
        on_applied: OnApplied | None = None,
        wanted: Wanted | None = None,
    ) -> None:
        self.settings = settings
        self.client = client
        self.wanted = wanted
        self.spec = spec
        self.batch_size = batch_size if batch_size is not None else spec.batch_size
        if flush_ms is None:
            flush_ms = settings.sink_linger_ms if spec.lingers else spec.flush_ms
        self.flush_ms = flush_ms
        self.codec = codec or Codec.default()
        self.on_applied = on_applied
        self.topic = settings.topic(spec.topic)
        self.db = settings.clickhouse_database
        self.table = f"{self.db}.{spec.table}"
        self.bodies = EnvelopeBody(self.codec, spec.record, skip_tombstones=spec.skip_tombstones, also=spec.also)
        schema = self.codec.contract.schema(spec.record)
        self.header = avro_ingest.container_header(schema.expanded)
        self.ingest_table = avro_ingest.ingest_table(self.db, spec.ingest, schema.fingerprint_hex)
        self.stats = SinkStats()
        self._stopping = asyncio.Event()
        self.consumer: AIOKafkaConsumer | None = None
        self.outbox: Outbox | None = None
        # The batch being filled: records fetched since the last INSERT, and per partition its
        # first offset (how far the skeleton may commit) and the offset after its last record.
        self.buffer: list[Fetched[memoryview | None]] = []
        self.buffer_bytes = 0
        self.buffer_from: dict[TopicPartition, int] = {}
        self.buffer_next: dict[TopicPartition, int] = {}
        self.deadline: float | None = None  # set by a batch's first record: it lingers until then
        self.lane: _SinkSet | None = None  # the handler it runs in, set by that handler
        # Per partition, the offset up to which rows are known to be in the table. Records
        # below it are never inserted again, however the consumer's position came back to
        # them (a rebalance resets positions to the committed offsets, which can lag).
        self.applied_next: dict[int, int] = {}
        self._probe_ready = False  # the probe pipeline is (re)made the first time it is needed
        # Offsets applied but not yet in a sink_offsets row, and when the next row is due.
        self._offsets_pending: dict[TopicPartition, int] = {}
        self._offsets_every = OFFSETS_ROW_INTERVAL_S if settings.uses_embedded_clickhouse else 0.0
        self._offsets_due = 0.0

    def stop(self) -> None:
        self._stopping.set()
        if self.lane is not None:
            self.lane.woken.set()  # a fetch waiting out the linger returns now, and tick flushes

    # -- set-up ---------------------------------------------------------------------------

    def prepare_tables(self) -> None:
        migrate(self.client, self.db, ttl_days=self.settings.clickhouse_ttl_days)
        self.prepare_ingest()

    def prepare_ingest(self) -> None:
        """The Null table and views of this sink's writer schema (the tables migrated already)."""
        schema = self.codec.contract.schema(self.spec.record)
        for statement in ingest_ddl(self.spec, self.db, schema.fingerprint_hex, schema.expanded):
            self.client.command(statement)

    def applied_offsets(self) -> dict[int, int]:
        """Per partition, the offset after the last row already in the primary table ("data" only)."""
        if self.spec.resume != "data":
            return {}
        partition, offset = self.spec.position_columns
        rows = self.client.query(
            f"SELECT {partition}, max({offset}) + 1 FROM {self.table} GROUP BY {partition}"
        ).result_rows
        return {int(p): int(o) for p, o in rows}

    async def seek_past_applied(self, assigned: list[TopicPartition]) -> None:
        assert self.consumer is not None
        applied = await asyncio.to_thread(self.applied_offsets)
        resumed: dict[TopicPartition, int] = {}
        for tp in assigned:
            committed = await self.consumer.committed(tp) or 0
            target = max(applied.get(tp.partition, 0), committed)
            if target > committed:
                log.info("skipping rows already applied", partition=tp.partition, offset=target, committed=committed)
            if target > 0:
                self.consumer.seek(tp, target)
                resumed[tp] = target
                self.applied_next[tp.partition] = max(self.applied_next.get(tp.partition, 0), target)
        # Everything before these positions is in ClickHouse already: fences on it may pass, and
        # the sink_offsets row says so at once. A partition whose rows were all in before a crash
        # gets no batch after it, so no later row would: its row stayed where the crashed sink
        # last wrote one, and a reader waiting on it there (a ClickHouse server) waited for the
        # next record of that partition. The row keeps the highest offset, so writing one that
        # is already there changes nothing.
        self._notify({tp.partition: offset for tp, offset in resumed.items()})
        if resumed:
            await asyncio.to_thread(self._record_offsets, resumed)

    def _notify(self, positions: Mapping[int, int]) -> None:
        if self.on_applied is not None and positions:
            self.on_applied(self.topic, positions)

    # -- running on the skeleton: assigned, revoked, handle, tick, committable --------------

    async def run(self) -> SinkStats:
        """Run this sink alone, as the member of its own group (``spec.group_id``), until stopped."""
        await asyncio.to_thread(self.prepare_tables)
        await run_sinks(
            self.settings, _SinkSet([self]), group_id=self.spec.group_id(self.settings), stop=self._stopping
        )
        return await self.stopped()

    def bind(self, consumer: AIOKafkaConsumer, outbox: Outbox, group: str) -> None:
        """The consumer it reads through (positions, seeks) and the outbox of its dead letters."""
        self.consumer, self.outbox = consumer, outbox
        log.info("sink started", topic=self.topic, tables=[t.table for t in self.spec.targets], group=group)

    async def stopped(self) -> SinkStats:
        """After its consumer stopped: the sink_offsets row made current, the totals logged."""
        if self.outbox is not None:
            self.stats.dead_lettered = self.outbox.dead_lettered
        await asyncio.to_thread(self._record_offsets, {})  # a clean stop leaves the row current
        log.info(
            "sink stopped",
            sink=self.spec.name,
            records=self.stats.records,
            batches=self.stats.batches,
            dlq=self.stats.dead_lettered,
            tombstones=self.stats.tombstones,
        )
        return self.stats

    async def assigned(self, partitions: set[TopicPartition]) -> None:
        await self.seek_past_applied(sorted(partitions, key=lambda tp: tp.partition))
        log.info("partitions assigned", sink=self.spec.name, partitions=sorted(tp.partition for tp in partitions))

    def revoked(self, partitions: set[TopicPartition]) -> None:
        # The skeleton committed up to the batch being filled: its records are read again by
        # their next owner, so they leave the batch here.
        self.buffer = [r for r in self.buffer if TopicPartition(r.topic, r.partition) not in partitions]
        self.buffer_bytes = sum(len(r.raw) for r in self.buffer)
        for tp in partitions:
            self.buffer_from.pop(tp, None)
            self.buffer_next.pop(tp, None)
        if not self.buffer_next:
            self.deadline = None
        log.info("partitions revoked", sink=self.spec.name, partitions=len(partitions))

    def committable(self, tp: TopicPartition, handled: int) -> int:
        return self.buffer_from.get(tp, handled)

    def poll_timeout(self) -> float:
        if self.deadline is None:
            return _IDLE_POLL_MS / 1000
        return max(0.001, self.deadline - time.monotonic())

    async def handle(self, batch: Batch) -> None:
        assert self.outbox is not None
        prepared, rejected = prepare_records(batch, self.bodies)
        if rejected:  # durable in the DLQ before their offsets can be committed
            await self.outbox.reject(rejected)
        for tp, records in batch.items():
            self.buffer_from.setdefault(tp, records[0].offset)
            self.buffer_next[tp] = records[-1].offset + 1
        self.buffer.extend(prepared)
        self.buffer_bytes += sum(len(r.raw) for r in prepared)
        if self.deadline is None:
            self.deadline = time.monotonic() + self.flush_ms / 1000
            if self.stats.first_record_at is None:
                self.stats.first_record_at = time.monotonic()
        if self._due():
            await self._flush()

    async def tick(self) -> None:
        if self.buffer_next and self._due():
            await self._flush()

    def _due(self) -> bool:
        return (
            len(self.buffer) >= self.batch_size
            or self.buffer_bytes >= self.spec.batch_bytes
            or self._stopping.is_set()
            or (self.deadline is not None and time.monotonic() >= self.deadline)
            or (self.wanted is not None and self.wanted(self.topic))
        )

    async def _flush(self) -> None:
        """One INSERT of the batch (and its sink_offsets row), then the batch is applied."""
        assert self.outbox is not None
        started = time.monotonic()
        fetched, next_offsets = self.buffer, self.buffer_next
        self.buffer, self.buffer_bytes, self.buffer_from, self.buffer_next = [], 0, {}, {}
        self.deadline = None
        records = [r for r in fetched if r.value is not None]
        self.stats.tombstones += len(fetched) - len(records)
        applied = self.applied_next
        records = [r for r in records if r.offset >= applied.get(r.partition, 0)]
        if self.spec.latest_per_key:
            kept = newest_per_key(records)
            self.stats.superseded += len(records) - len(kept)
            records = kept
        if records:
            written = cast(list[Fetched[memoryview]], records)
            inserted = await self._insert_with_retry(written, next_offsets, self.outbox)
            self.stats.records += inserted
            metrics.SINK_RECORDS.labels(metrics.role(), self.spec.name).inc(inserted)
        else:
            await asyncio.to_thread(self._record_offsets, next_offsets)
        # Visible in ClickHouse from here on; the skeleton's commit only moves the restart point.
        for tp, offset in next_offsets.items():
            self.applied_next[tp.partition] = max(self.applied_next.get(tp.partition, 0), offset)
        self._notify({tp.partition: offset for tp, offset in next_offsets.items()})
        self.stats.batches += 1
        metrics.SINK_FLUSH_SECONDS.labels(metrics.role(), self.spec.name).observe(time.monotonic() - started)

    async def _insert_with_retry(
        self, records: list[Fetched[memoryview]], next_offsets: dict[TopicPartition, int], outbox: Outbox
    ) -> int:
        failures = 0
        checked = False  # looked for bad records and found none: a failure now is the engine's
        rows_in = False  # once the rows are in, a retry only records the offsets (no duplicate rows)
        while True:
            try:
                if not rows_in:
                    await asyncio.to_thread(self._insert_rows, records)
                    rows_in = True
                await asyncio.to_thread(self._record_offsets, next_offsets)
                return len(records)
            except Exception as exc:
                if self._stopping.is_set():
                    raise
                if not checked and not rows_in:
                    # Maybe a record ClickHouse cannot read: find it in Python, else ask the
                    # engine record by record (a NaN time decodes but has no DateTime64), and
                    # dead-letter it. A span batch is good or bad as a whole. Looked for again
                    # after every find: Python's and the engine's may be different records.
                    records, bad = self._split_bad(records)
                    probed = True
                    if not bad and self.spec.python_rows is None:
                        try:
                            records, bad = await asyncio.to_thread(self._split_refused, records)
                        except Exception as probe_error:  # the engine is unreachable: look again later
                            probed = False
                            log.warning("probing the rejected block failed", error=str(probe_error)[:300])
                    if bad:
                        log.warning("ClickHouse rejected a block; dead-lettering bad records", bad=len(bad))
                        await outbox.reject(bad)
                        continue
                    checked = probed
                # The engine is down or refusing: keep the batch (offsets stay uncommitted) and retry.
                failures += 1
                delay = RESTART.after(failures)
                log.warning("insert failed, retrying", error=describe(exc)[:300], retry_in_s=round(delay, 2))
                await asyncio.sleep(delay)  # backoff between retries, not synchronisation

    def _split_bad(self, records: list[Fetched[memoryview]]) -> tuple[list[Fetched[memoryview]], list[Rejected]]:
        good, bad = [], []
        for record in records:
            try:
                if self.spec.python_rows is not None:
                    self._python_row(record)
                else:
                    self.bodies.check(record.raw)
            except CodecError as error:
                bad.append(Rejected.of(record, error))
            else:
                good.append(record)
        return good, bad

    def _split_refused(self, records: list[Fetched[memoryview]]) -> tuple[list[Fetched[memoryview]], list[Rejected]]:
        """The records the engine refuses on their own, found by bisection through the probe
        pipeline (which writes nothing). A block the probe accepts whole has no bad record:
        the failure was the engine's, and the caller retries."""
        if not self._probe_ready:
            schema = self.codec.contract.schema(self.spec.record)
            for statement in ingest_ddl(self.spec, self.db, schema.fingerprint_hex, schema.expanded, probe=True):
                self.client.command(statement)
            self._probe_ready = True
        refused: dict[tuple[int, int], Exception] = {}

        def search(chunk: list[Fetched[memoryview]]) -> None:
            try:
                block = avro_ingest.container(self.header, [(r.partition, r.offset, r.value) for r in chunk])
                self.client.raw_insert(f"{self.ingest_table}_probe", insert_block=block, fmt="Avro")
            except DatabaseError as error:  # the engine's verdict, not a lost connection
                if len(chunk) == 1:
                    refused[(chunk[0].partition, chunk[0].offset)] = EngineRefusedError(str(error)[:2000])
                else:
                    search(chunk[: len(chunk) // 2])
                    search(chunk[len(chunk) // 2 :])

        search(records)
        bad = [Rejected.of(r, refused[(r.partition, r.offset)]) for r in records if (r.partition, r.offset) in refused]
        return [r for r in records if (r.partition, r.offset) not in refused], bad

    def _insert(self, records: list[Fetched[memoryview]], next_offsets: dict[TopicPartition, int]) -> None:
        self._insert_rows(records)
        self._record_offsets(next_offsets)

    def _insert_rows(self, records: list[Fetched[memoryview]]) -> None:
        if records and self.spec.python_rows is not None:
            rows = [self._python_row(r) for r in records]
            columns = list(rows[0])
            self.client.insert(self.table, [[row[c] for c in columns] for row in rows], column_names=columns)
        elif records:
            block = avro_ingest.container(self.header, [(r.partition, r.offset, r.value) for r in records])
            settings = _INGEST_SETTINGS | _ONE_PART_SETTINGS if self.spec.resume == "data" else _INGEST_SETTINGS
            self.client.raw_insert(self.ingest_table, insert_block=block, fmt="Avro", settings=settings)

    def _python_row(self, record: Fetched[memoryview]) -> dict[str, Any]:
        assert self.spec.python_rows is not None
        row = self.spec.python_rows(self.codec.decode(record.raw, MODELS[self.spec.record]))
        return {**row, "kafka_partition": record.partition, "kafka_offset": record.offset}

    def _record_offsets(self, next_offsets: dict[TopicPartition, int]) -> None:
        """The sink_offsets row of what is applied: now, or with the embedded engine once
        :data:`OFFSETS_ROW_INTERVAL_S` has passed since the last one (and at a stop)."""
        pending = self._offsets_pending
        for tp, offset in next_offsets.items():
            pending[tp] = max(pending.get(tp, 0), offset)
        now = time.monotonic()
        if not pending or (now < self._offsets_due and not self._stopping.is_set()):
            return
        now_ms = int(time.time() * 1000)
        self.client.insert(
            f"{self.db}.sink_offsets",
            [[self.spec.name, tp.topic, tp.partition, offset, now_ms] for tp, offset in pending.items()],
            column_names=["Sink", "Topic", "Partition", "NextOffset", "AppliedAt"],
        )
        pending.clear()
        self._offsets_due = now + self._offsets_every


class _SinkSet:
    """The skeleton's handler for sinks that share one consumer (one group member for all their
    topics: one heartbeat and one fetch where each sink had its own).

    Each topic's partitions, records and commit point belong to its sink. The sinks' work on
    one fetch (and their timers) runs concurrently, and every one finishes before the skeleton
    goes on, so a sink that fails leaves none of the others mid-batch when the skeleton starts
    over.
    """

    def __init__(self, sinks: Sequence[TableSink]) -> None:
        self.sinks = {sink.topic: sink for sink in sinks}
        if len(self.sinks) != len(sinks):
            raise ValueError("two sinks of one topic cannot share a consumer")
        # Set when a reader starts waiting or a sink stops: the skeleton's fetch returns and
        # tick looks at ``wanted`` and the stop (a lingering batch waits no longer).
        self.woken = asyncio.Event()
        for sink in sinks:
            sink.lane = self

    def _split(self, partitions: Iterable[TopicPartition]) -> dict[TableSink, set[TopicPartition]]:
        split: dict[TableSink, set[TopicPartition]] = {}
        for tp in partitions:
            split.setdefault(self.sinks[tp.topic], set()).add(tp)
        return split

    async def assigned(self, partitions: set[TopicPartition]) -> None:
        for sink, tps in self._split(partitions).items():
            await sink.assigned(tps)

    def revoked(self, partitions: set[TopicPartition]) -> None:
        for sink, tps in self._split(partitions).items():
            sink.revoked(tps)

    @property
    def fetch_limit(self) -> int:
        """Records per fetch: the smallest batch of its sinks, so no sink gets more in one call
        than it inserts at once and every sink's commits follow its batches (as on a consumer
        of its own; `agl-stream sink --batch-size` sets the span sink's)."""
        return min(sink.batch_size for sink in self.sinks.values())

    async def handle(self, batch: Batch) -> None:
        per_sink: dict[TableSink, Batch] = {}
        for tp, records in batch.items():
            per_sink.setdefault(self.sinks[tp.topic], {})[tp] = records
        await _all([sink.handle(part) for sink, part in per_sink.items()])

    async def tick(self) -> None:
        # Only sinks holding a batch have a timer: the loop ticks every few ms while one lingers.
        await _all([sink.tick() for sink in self.sinks.values() if sink.buffer_next])

    def poll_timeout(self) -> float:
        return min(sink.poll_timeout() for sink in self.sinks.values())

    def committable(self, tp: TopicPartition, handled: int) -> int:
        return self.sinks[tp.topic].committable(tp, handled)


async def _all(calls: list[Coroutine[Any, Any, None]]) -> None:
    """Await every call concurrently; once all have ended, raise the first error, if any."""
    if len(calls) == 1:
        await calls[0]  # the common case: no task to make
        return
    for outcome in await asyncio.gather(*calls, return_exceptions=True):
        if isinstance(outcome, BaseException):
            raise outcome


async def run_sinks(settings: Settings, handler: _SinkSet, *, group_id: str, stop: asyncio.Event) -> None:
    """Run ``handler``'s sinks (tables prepared) on one consumer, as one member of ``group_id``, until ``stop``.

    One producer carries every sink's dead letters (each sink keeps an outbox of its own on it,
    named after the sink)."""
    sinks = list(handler.sinks.values())
    async with Outbox.started(settings, "sink") as shared:
        outboxes = [Outbox(settings, shared.producer, f"sink.{sink.spec.name}") for sink in sinks]

        def started(consumer: AIOKafkaConsumer) -> None:
            for sink, outbox in zip(sinks, outboxes, strict=True):
                sink.bind(consumer, outbox, group_id)

        await run_processor(
            settings,
            handler,
            name="sinks",
            group_id=group_id,
            topics=[sink.topic for sink in sinks],
            stop=stop,
            max_records=handler.fetch_limit,
            on_start=started,
        )


class SinkGroup:
    """Several sinks in one process and event loop, on one consumer per lane (group
    :func:`~consumers.sink_specs.sinks_group_id`), each with its own engine client.

    Clients on one chDB path run in parallel, so one sink's INSERT does not wait for another's.
    If one sink fails the consumer stops and the error propagates: the process exits and its
    supervisor restarts it, resuming every sink from what it applied.
    """

    def __init__(
        self,
        settings: Settings,
        specs: Sequence[SinkSpec] = SPECS,
        *,
        on_applied: OnApplied | None = None,
        wanted: Wanted | None = None,
        options: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        self.settings = settings
        self.specs = tuple(specs)
        self.on_applied = on_applied
        self.wanted = wanted
        self.options = options or {}
        self.sinks: list[TableSink] = []
        self._lanes: list[_SinkSet] = []
        self._stop_requested = False
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop_requested = True
        self._stop.set()
        for sink in self.sinks:
            sink.stop()  # each wakes its lane

    def wake(self) -> None:
        """A reader started waiting: every lane's fetch returns and its sinks look at ``wanted``."""
        for lane in self._lanes:
            lane.woken.set()

    async def run(self) -> dict[str, SinkStats]:
        clients = [await asyncio.to_thread(get_client, self.settings) for _ in self.specs]
        try:
            # Migrate once for all the sinks; each then adds only its ingest tables.
            await asyncio.to_thread(
                migrate, clients[0], self.settings.clickhouse_database, ttl_days=self.settings.clickhouse_ttl_days
            )
            self.sinks = [
                TableSink(
                    self.settings,
                    client,
                    spec,
                    on_applied=self.on_applied,
                    wanted=self.wanted,
                    **self.options.get(spec.name, {}),
                )
                for client, spec in zip(clients, self.specs, strict=True)
            ]
            if self._stop_requested:
                return {}
            for sink in self.sinks:
                await asyncio.to_thread(sink.prepare_ingest)
            lanes: dict[Lane, list[TableSink]] = {}
            for sink in self.sinks:
                lanes.setdefault(sink.spec.lane, []).append(sink)
            self._lanes = [_SinkSet(sinks) for sinks in lanes.values()]
            tasks = [
                asyncio.create_task(
                    run_sinks(self.settings, handler, group_id=sinks_group_id(self.settings, lane), stop=self._stop),
                    name=f"sinks:{lane}",
                )
                for lane, handler in zip(lanes, self._lanes, strict=True)
            ]
            try:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            finally:
                self.stop()  # one failed, or we are cancelled: the other lane stops cleanly too
                await asyncio.wait(tasks)
            for task in tasks:
                if task.exception() is not None:
                    raise cast(BaseException, task.exception())
            return {sink.spec.name: await sink.stopped() for sink in self.sinks}
        finally:
            for client in clients:
                client.close()


class SinkThread:
    """``group`` on an event loop of its own, in a thread of its own, for a process
    whose main loop serves requests (the gateway). A slow request there cannot delay the sinks'
    fetches, INSERTs or group heartbeats (a member that misses its session timeout loses its
    partitions and reads them again), and the sinks' work on a batch never holds up a request.

    Concurrency model: every sink method runs on the thread's loop (thread ``agl-sinks``). What
    crosses: :meth:`run` is awaited on the owner's loop and ends (or raises) when the group has
    stopped; ``on_applied`` is called on the owner's loop, in the order the sinks applied;
    :meth:`stop` and :meth:`wake` may be called from any thread; ``wanted`` is called on the
    sinks' thread, so it must be safe there (a read of a counter is).
    """

    def __init__(self, group: SinkGroup) -> None:
        self.group = group
        self._on_applied = group.on_applied
        if group.on_applied is not None:  # its sinks are made when it runs: they get the hand-over
            group.on_applied = self._hand_over
        self._owner: asyncio.AbstractEventLoop | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the sinks' loop while it runs
        self._lock = threading.Lock()  # guards _loop and _stopped between the two threads
        self._stopped = False

    async def run(self) -> dict[str, SinkStats]:
        """Run the sinks in their thread until :meth:`stop`; cancelling this stops them and waits."""
        self._owner = asyncio.get_running_loop()
        ended: asyncio.Future[dict[str, SinkStats]] = self._owner.create_future()
        threading.Thread(target=self._main, args=(ended,), name="agl-sinks", daemon=True).start()
        try:
            return await asyncio.shield(ended)
        except asyncio.CancelledError:
            self.stop()
            with contextlib.suppress(Exception):
                await ended
            raise

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: stopped already
                loop.call_soon_threadsafe(self.group.stop)

    def wake(self) -> None:
        """A reader started waiting (see :meth:`SinkGroup.wake`); from any thread."""
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self.group.wake)

    def _hand_over(self, topic: str, offsets: Mapping[int, int]) -> None:
        assert self._owner is not None and self._on_applied is not None
        with contextlib.suppress(RuntimeError):  # the owner's loop closed: nobody waits any more
            self._owner.call_soon_threadsafe(self._on_applied, topic, dict(offsets))

    def _main(self, ended: asyncio.Future[dict[str, SinkStats]]) -> None:
        try:
            outcome: dict[str, SinkStats] | BaseException = asyncio.run(self._serve())
        except BaseException as error:  # handed to the owner, which raises it
            outcome = error
        assert self._owner is not None
        with contextlib.suppress(RuntimeError):
            self._owner.call_soon_threadsafe(_settle, ended, outcome)

    async def _serve(self) -> dict[str, SinkStats]:
        with self._lock:
            self._loop = asyncio.get_running_loop()
            stopped = self._stopped
        if stopped:  # stopped before the thread started
            self.group.stop()
        try:
            return await self.group.run()
        finally:
            with self._lock:
                self._loop = None


def _settle(future: asyncio.Future[T], outcome: T | BaseException) -> None:
    if future.done():
        return
    if isinstance(outcome, asyncio.CancelledError):
        future.cancel()
    elif isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


async def run_sink(settings: Settings, **options: Any) -> dict[str, SinkStats]:
    """Run every sink until SIGTERM/SIGINT; the embedded engine is opened (and locked) here.

    ``batch_size``/``flush_ms`` tune the spans sink, the high-volume one; the others keep their
    specs' settings (and AGL_SINK_LINGER_MS).
    """
    group = SinkGroup(settings, on_applied=None, options={SPANS.name: options})
    with stop_on_signals(group.stop):
        return await group.run()


def main(settings: Settings, **options: Any) -> dict[str, SinkStats]:
    return asyncio.run(run_sink(settings, **options))
