"""The batcher: agl.triplets (one TripletRecord per finished attempt) -> agl.triplet-batches.

The batching rules are the pure :class:`agl_stream.domain.batching.Batcher`, one per source
partition; this process reads and writes, on the processor skeleton
(``agl_stream.kafka.processor``) as a handler that holds records: exactly-once here rests on
committing each partition only up to its lowest *pending* record (a record waiting in an open
group or a lingering batch), which ``committable`` tells the skeleton. (faust commits the
highest contiguous acknowledged offset itself and can step over the first unacknowledged one.)

Concurrency model: the skeleton's one loop task calls every method here, rebalances under the
loop's lock; the journal consumer is used only from ``assigned``.

Exactly-once without transactions:

- Each batch of source partition p goes to partition p (mod the partition count) of
  agl.triplet-batches, acknowledged before anything is committed, and says which source
  offsets it holds or reports dropped and how far the batcher had read.
- Source offsets are committed only up to the lowest pending offset, so a restart (or a new
  owner after a rebalance) reads every pending record again.
- On assignment the batcher reads that output partition backwards from its end until it
  reaches a batch made before the committed offset (:class:`agl_stream.domain.batching.Recovery`):
  the records after the commit point that are already in a batch are skipped, and the
  sequence number and newest policy version continue from the last batch. So a record is
  never in two batches and never lost, whenever the process dies.
- A batch whose acknowledgement is lost is sent again with the same id and content (ids are
  a digest of the members); readers key on batch_id.
- The triplet builder may emit an attempt's record twice (it re-reads from its own commit point
  after a restart). The batcher drops the repeat: from memory while it runs, and after its own
  restart from the attempts of the batches it reads back, which reach ``_REPEAT_LOOKBACK`` source
  offsets before the commit point.

Records behind the newest policy version are kept within ``--max-staleness`` (the trainer
corrects them with importance sampling) and counted per batch (``kept_stale``,
``staleness_counts``); only those beyond it are dropped (the defaults: see the rules' module).

Undecodable input goes to agl.dlq with the reason (acknowledged before its offset is
committed), never stopping the batcher. Records of val and test rollouts are refused by the
batching rules (never trained on) and counted: logged here, reported by the partition's next
batch (``dropped_eval``).
"""

from __future__ import annotations

import asyncio
import time

from aiokafka import AIOKafkaConsumer, TopicPartition

from agl_stream.config import Settings
from agl_stream.domain.batching import Batcher, BatchPolicy, JournalEntry, Recovery
from agl_stream.errors import CodecError, TopicError
from agl_stream.kafka.io import Outbox, Record, Rejected
from agl_stream.kafka.processor import Batch, run_processor
from agl_stream.local.processes import stop_on_signals
from agl_stream.logs import describe, get_logger
from agl_stream.models import TripletBatch, TripletRecord
from agl_stream.topics import load_topic_specs
from agl_stream.wire.codec import Codec

log = get_logger("agl.batcher")

PROCESSOR = "processor.batcher"
_MAX_POLL_S = 0.5  # idle poll, which also bounds how late a linger flush or a stop can be
_JOURNAL_WINDOW = 16  # batches read per step when scanning the output backwards (doubles)
_JOURNAL_WINDOW_MAX = 64  # batches can be MBs each: bound what one step holds in memory
# Source offsets before the commit point whose batched attempts a restart learns, to drop the
# triplet builder's repeats of them (it re-emits what it finished after its own commit point).
_REPEAT_LOOKBACK = 10_000


def group_id(settings: Settings, source: str | None = None) -> str:
    """The live batcher's group; one of its own per other source topic (a replay topic), so a
    replay's batcher never takes partitions or offsets from the live one."""
    base = f"{settings.topic_prefix}.{PROCESSOR}"
    return base if source is None or source == settings.topic("triplets") else f"{base}.{source}"


class BatcherProcessor:
    """The skeleton's handler (``assigned``, ``revoked``, ``handle``, ``tick``, ``committable``)."""

    def __init__(
        self,
        settings: Settings,
        policy: BatchPolicy,
        *,
        codec: Codec | None = None,
        input_topic: str | None = None,
        output_topic: str | None = None,
    ) -> None:
        self.settings = settings
        self.policy = policy
        self.codec = codec or Codec.default()
        self.source = input_topic or settings.topic("triplets")
        self.output = output_topic or settings.topic("triplet-batches")
        self.batchers: dict[int, Batcher] = {}
        self.batches_sent = 0
        self.misrouted = 0
        self._stopping = asyncio.Event()
        self._consumer: AIOKafkaConsumer | None = None
        self._journal: AIOKafkaConsumer | None = None
        self._outbox: Outbox | None = None
        self._output_partitions = 0
        self._max_batch_bytes = next(
            (s.max_message_bytes for s in load_topic_specs() if s.name == "triplet-batches" and s.max_message_bytes),
            16 << 20,
        )

    def stop(self) -> None:
        self._stopping.set()

    # -- running --------------------------------------------------------------------------

    async def run(self) -> None:
        settings = self.settings
        journal = self._journal = AIOKafkaConsumer(
            **settings.kafka_client_options(),
            enable_auto_commit=False,
            isolation_level="read_committed",
            max_partition_fetch_bytes=self._max_batch_bytes + (1 << 20),
            fetch_max_bytes=64 << 20,
        )
        # Batches are large: the request limit is the topic's, not the default 4 MiB.
        async with Outbox.started(
            settings, PROCESSOR, self.codec, max_request_size=self._max_batch_bytes + (64 << 10)
        ) as self._outbox:
            await journal.start()
            try:
                partitions = await self._outbox.producer.partitions_for(self.output)
                if not partitions:
                    raise TopicError(f"topic {self.output} does not exist: run `agl-stream topics apply`")
                self._output_partitions = len(partitions)
                # Assigned once and paused: re-assigning per recovery costs a metadata round trip.
                journal_partitions = [TopicPartition(self.output, p) for p in sorted(partitions)]
                journal.assign(journal_partitions)
                journal.pause(*journal_partitions)
                log.info(
                    "batcher started", source=self.source, output=self.output, group=group_id(settings, self.source)
                )
                await run_processor(
                    settings,
                    self,
                    name=PROCESSOR,
                    group_id=group_id(settings, self.source),
                    topics=[self.source],
                    stop=self._stopping,
                    ready_as="batcher",
                    max_records=500,
                    on_start=self._started,
                )
            finally:
                await journal.stop()
        log.info("batcher stopped", batches=self.batches_sent)

    def _started(self, consumer: AIOKafkaConsumer) -> None:
        self._consumer = consumer

    # -- the skeleton's calls -------------------------------------------------------------

    def poll_timeout(self) -> float:
        deadlines = [d for d in (b.next_deadline() for b in self.batchers.values()) if d is not None]
        return _MAX_POLL_S if not deadlines else min(_MAX_POLL_S, max(0.01, min(deadlines) - time.time()))

    def committable(self, tp: TopicPartition, handled: int) -> int:
        batcher = self.batchers.get(tp.partition)
        return batcher.commit_offset() if batcher is not None else handled

    async def handle(self, batch: Batch) -> None:
        assert self._outbox is not None
        now = time.time()
        rejected: list[Rejected] = []
        out: list[TripletBatch] = []
        refused: dict[int, int] = {}  # partition -> val/test records refused in this call
        for tp, messages in batch.items():
            batcher = self.batchers.get(tp.partition)
            if batcher is None:
                continue
            for message in messages:
                if message.offset < batcher.next_offset:
                    continue  # delivered again (a retried batch): done
                try:
                    record = self.codec.decode(message.value or b"", TripletRecord)
                except CodecError as error:
                    rejected.append(Rejected.of(message, error))
                    batcher.skip(message.offset)
                    continue
                self._check_key(message.key, record, tp.partition)
                before = batcher.stats.dropped["eval"]
                out.extend(batcher.add(record, message.offset, now))
                if batcher.stats.dropped["eval"] > before:
                    refused[tp.partition] = refused.get(tp.partition, 0) + 1
        if refused:
            # Not bad input (no DLQ): a validation rollout's record is good data for the read side.
            # Counted here and in the next batch's dropped_eval (ClickHouse: batches.dropped_eval).
            log.info(
                "val/test records refused: never trained on",
                refused=refused,
                total=sum(b.stats.dropped["eval"] for b in self.batchers.values()),
            )
        await self._outbox.reject(rejected)
        await self._send(out)

    async def tick(self) -> None:
        now = time.time()
        out: list[TripletBatch] = []
        for state in self.batchers.values():
            out.extend(state.tick(now))
        await self._send(out)

    def revoked(self, partitions: set[TopicPartition]) -> None:
        for tp in partitions:
            self.batchers.pop(tp.partition, None)  # committed up to its lowest pending just before
        log.info("partitions revoked", partitions=sorted(tp.partition for tp in partitions))

    async def assigned(self, partitions: set[TopicPartition]) -> None:
        assert self._consumer is not None
        for tp in sorted(partitions, key=lambda t: t.partition):
            committed = await self._consumer.committed(tp)
            if committed is None:
                committed = (await self._consumer.beginning_offsets([tp]))[tp]
            self._consumer.seek(tp, committed)
            recovery = await self.recover(tp.partition, committed)
            self.batchers[tp.partition] = Batcher(
                self.policy, partition=tp.partition, start_offset=committed, recovery=recovery
            )
            log.info(
                "partition recovered",
                partition=tp.partition,
                committed=committed,
                already_batched=len(recovery.decided),
                recent_attempts=len(recovery.recent),
                sequence=recovery.sequence,
                newest_policy_version=recovery.newest_version,
            )

    def _check_key(self, key: bytes | None, record: TripletRecord, partition: int) -> None:
        if self.policy.grouping and key != record.group_id.encode():
            # Not an error (the record is good data), but its group may be split across
            # partitions and then only completes by timing out.
            self.misrouted += 1
            if self.misrouted == 1 or self.misrouted % 1000 == 0:
                log.warning(
                    "triplet record not keyed by its group id; groups may not complete",
                    partition=partition,
                    key=(key or b"").decode(errors="replace")[:80],
                    group_id=record.group_id,
                    count=self.misrouted,
                )

    async def _send(self, batches: list[TripletBatch]) -> None:
        """Write batches in order and wait for every acknowledgement.

        A failed send makes the skeleton start over (the partitions recovered from the journal,
        the records read again): resending is harmless (same ids, same content, and the
        journal reads either copy)."""
        if not batches:
            return
        assert self._outbox is not None
        records = []
        for batch in batches:
            value = self.codec.encode(batch)
            if len(value) > self._max_batch_bytes:
                raise ValueError(
                    f"batch {batch.batch_id} is {len(value)} bytes, over the topic's limit of "
                    f"{self._max_batch_bytes}: lower --max-tokens or --max-rollouts"
                )
            partition = (batch.source_partition or 0) % self._output_partitions
            records.append(Record(self.output, batch.batch_id.encode(), value, partition))
        await self._outbox.send_all(records)
        self.batches_sent += len(batches)
        for batch in batches:
            log.info(
                "batch",
                batch_id=batch.batch_id,
                partition=batch.source_partition,
                sequence=batch.sequence,
                records=len(batch.records),
                tokens=batch.n_tokens,
                kept_stale=batch.kept_stale,
                staleness=batch.staleness_counts,
                dropped=batch.dropped_stale + batch.dropped_incomplete + batch.dropped_duplicate,
                refused_eval=batch.dropped_eval,
            )

    async def recover(self, partition: int, committed: int) -> Recovery:
        """Read the output partition backwards until the batches can no longer hold offsets at or
        after ``committed`` (see :class:`agl_stream.domain.batching.Recovery`)."""
        journal = self._journal
        assert journal is not None
        recovery = Recovery(partition, committed, lookback=_REPEAT_LOOKBACK)
        tp = TopicPartition(self.output, partition % self._output_partitions)
        begin = (await journal.beginning_offsets([tp]))[tp]
        high = (await journal.end_offsets([tp]))[tp]
        window = _JOURNAL_WINDOW
        journal.resume(tp)
        try:
            while high > begin and not recovery.done:
                low = max(begin, high - window)
                entries = await self._read_journal(journal, tp, low, high)
                for entry in reversed(entries):
                    if recovery.offer(entry):
                        break
                high, window = low, min(window * 2, _JOURNAL_WINDOW_MAX)
        finally:
            journal.pause(tp)
        return recovery

    async def _read_journal(
        self, journal: AIOKafkaConsumer, tp: TopicPartition, low: int, high: int
    ) -> list[JournalEntry]:
        journal.seek(tp, low)
        entries: list[JournalEntry] = []
        deadline = time.monotonic() + 120
        while await journal.position(tp) < high:
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not read {tp.topic}[{tp.partition}] {low}..{high} within 120 s")
            fetched = await journal.getmany(tp, timeout_ms=1000)
            for message in fetched.get(tp, []):
                if message.offset >= high:
                    break
                try:
                    name, value = self.codec.decode_dict(message.value or b"")
                except CodecError as error:
                    log.warning(
                        "unreadable record in the batches topic", offset=message.offset, error=describe(error)[:200]
                    )
                    continue
                if name == TripletBatch.avro_name:
                    entries.append(JournalEntry.of_dict(value))
        return entries


async def run_batcher(
    settings: Settings, policy: BatchPolicy, *, input_topic: str | None = None, output_topic: str | None = None
) -> None:
    processor = BatcherProcessor(settings, policy, input_topic=input_topic, output_topic=output_topic)
    with stop_on_signals(processor.stop):
        await processor.run()


def main(
    settings: Settings, policy: BatchPolicy, *, input_topic: str | None = None, output_topic: str | None = None
) -> None:
    """Run the batcher in the foreground until SIGTERM/SIGINT (``agl-stream batcher``)."""
    asyncio.run(run_batcher(settings, policy, input_topic=input_topic, output_topic=output_topic))
