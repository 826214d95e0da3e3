"""The batcher: agl.triplets (one TripletRecord per finished attempt) -> agl.triplet-batches.

The batching rules are the pure :class:`agl_stream.batching.Batcher`, one per source
partition; this process reads, writes and commits. It is a plain aiokafka consumer-group
member rather than a faust agent: exactly-once here rests on committing each partition only up
to its lowest *pending* record (a record waiting in an open group or a lingering batch), and
faust commits the highest contiguous acknowledged offset itself (its out-of-order ack handling
can step over the first unacknowledged offset); a faust table would need a changelog topic of
its own. The consumer loop follows the ClickHouse sink's (consumers/clickhouse_sink.py).

Exactly-once without transactions:

- Each batch of source partition p goes to partition p (mod the partition count) of
  agl.triplet-batches, acknowledged before anything is committed, and says which source
  offsets it holds or reports dropped and how far the batcher had read.
- Source offsets are committed only up to the lowest pending offset, so a restart (or a new
  owner after a rebalance) reads every pending record again.
- On assignment the batcher reads that output partition backwards from its end until it
  reaches a batch made before the committed offset (:class:`agl_stream.batching.Recovery`):
  the records after the commit point that are already in a batch are skipped, and the
  sequence number and newest policy version continue from the last batch. So a record is
  never in two batches and never lost, whenever the process dies.
- A batch whose acknowledgement is lost is sent again with the same id and content (ids are
  a digest of the members); readers key on batch_id.

Undecodable input goes to agl.dlq with the reason (acknowledged before its offset is
committed), never stopping the batcher.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Mapping

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import CommitFailedError, KafkaError
from aiokafka.structs import OffsetAndMetadata

from agl_stream.batching import Batcher, BatchPolicy, JournalEntry, Recovery
from agl_stream.codec import Codec
from agl_stream.config import Settings
from agl_stream.errors import CodecError, TopicError
from agl_stream.kafka.io import DeadLetters, Rejected, make_consumer, make_producer
from agl_stream.logs import get_logger
from agl_stream.models import TripletBatch, TripletRecord
from agl_stream.topics import load_topic_specs

log = get_logger("agl.batcher")

PROCESSOR = "processor.batcher"
READY_FILE = "batcher.ready"
_MAX_POLL_S = 0.5  # idle poll, which also bounds how late a linger flush or a stop can be
_JOURNAL_WINDOW = 16  # batches read per step when scanning the output backwards (doubles)
_JOURNAL_WINDOW_MAX = 64  # batches can be MBs each: bound what one step holds in memory


def group_id(settings: Settings, source: str | None = None) -> str:
    """The live batcher's group; one of its own per other source topic (a replay topic), so a
    replay's batcher never takes partitions or offsets from the live one."""
    base = f"{settings.topic_prefix}.{PROCESSOR}"
    return base if source is None or source == settings.topic("triplets") else f"{base}.{source}"


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    """Commit and forget partitions that leave; recover the ones that arrive before reading them."""

    def __init__(self, processor: BatcherProcessor) -> None:
        self.processor = processor

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        await self.processor.revoke(revoked)

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        await self.processor.assign(assigned)


class BatcherProcessor:
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
        self.committed: dict[int, int] = {}
        # `lock` is held from processing a fetch to committing it; `generation` changes on every
        # revoke/assign, so records fetched before a rebalance are dropped (their partitions
        # were reset to the committed offsets) instead of being applied to the new state.
        self.lock = asyncio.Lock()
        self.generation = 0
        self.batches_sent = 0
        self.misrouted = 0
        self._stopping = asyncio.Event()
        self._failure: BaseException | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._journal: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None
        self._output_partitions = 0
        self._max_batch_bytes = next(
            (s.max_message_bytes for s in load_topic_specs() if s.name == "triplet-batches" and s.max_message_bytes),
            16 << 20,
        )

    def stop(self) -> None:
        self._stopping.set()

    # -- the loop -------------------------------------------------------------------------

    async def run(self) -> None:
        settings = self.settings
        # Batches are large: the request limit is the topic's, not the default 4 MiB.
        producer = self._producer = make_producer(
            settings, max_request_size=self._max_batch_bytes + (64 << 10), linger_ms=0
        )
        consumer = self._consumer = make_consumer(
            settings,
            group_id=group_id(settings, self.source),
            max_poll_records=500,
            # A batcher killed with -9 holds its partitions until its session expires.
            session_timeout_ms=6000,
            heartbeat_interval_ms=1500,
        )
        journal = self._journal = AIOKafkaConsumer(
            **settings.kafka_client_options(),
            enable_auto_commit=False,
            isolation_level="read_committed",
            max_partition_fetch_bytes=self._max_batch_bytes + (1 << 20),
            fetch_max_bytes=64 << 20,
        )
        await producer.start()
        try:
            await journal.start()
            partitions = await producer.partitions_for(self.output)
            if not partitions:
                raise TopicError(f"topic {self.output} does not exist: run `agl-stream topics apply`")
            self._output_partitions = len(partitions)
            # Assigned once and paused: re-assigning per recovery costs a metadata round trip.
            journal_partitions = [TopicPartition(self.output, p) for p in sorted(partitions)]
            journal.assign(journal_partitions)
            journal.pause(*journal_partitions)
            dead_letters = DeadLetters(settings, producer, processor=PROCESSOR, codec=self.codec)
            consumer.subscribe([self.source], listener=_Rebalance(self))
            await consumer.start()
            log.info("batcher started", source=self.source, output=self.output, group=group_id(settings, self.source))
            try:
                while not self._stopping.is_set():
                    await self._one_round(consumer, dead_letters)
                async with self.lock:
                    await self._commit()
            finally:
                await consumer.stop()
                await journal.stop()
        finally:
            await producer.stop()
        if self._failure is not None:
            raise self._failure
        log.info("batcher stopped", batches=self.batches_sent)

    def _poll_timeout_ms(self) -> int:
        deadlines = [d for d in (b.next_deadline() for b in self.batchers.values()) if d is not None]
        wait = _MAX_POLL_S if not deadlines else min(_MAX_POLL_S, max(0.01, min(deadlines) - time.time()))
        return max(1, int(wait * 1000))

    async def _one_round(self, consumer: AIOKafkaConsumer, dead_letters: DeadLetters) -> None:
        generation = self.generation
        fetched = await consumer.getmany(timeout_ms=self._poll_timeout_ms())
        async with self.lock:
            if generation != self.generation:
                # Partitions moved while fetching: these records may predate the new state, and
                # the fetch may have moved positions past records the new state still needs.
                for partition, state in self.batchers.items():
                    consumer.seek(TopicPartition(self.source, partition), state.next_offset)
                return
            now = time.time()
            rejected: list[Rejected] = []
            out: list[TripletBatch] = []
            for tp, messages in fetched.items():
                batcher = self.batchers.get(tp.partition)
                if batcher is None:
                    continue
                for message in messages:
                    if message.offset < batcher.next_offset:
                        continue  # delivered again (a seek to where it already was): done
                    try:
                        record = self.codec.decode(message.value or b"", TripletRecord)
                    except CodecError as error:
                        rejected.append(Rejected.of(message, error))
                        batcher.skip(message.offset)
                        continue
                    self._check_key(message.key, record, tp.partition)
                    out.extend(batcher.add(record, message.offset, now))
            for state in self.batchers.values():
                out.extend(state.tick(now))
            if rejected:
                await dead_letters.send_many(rejected)
            await self._send(out)
            await self._commit()

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
        """Write batches in order and wait for every acknowledgement."""
        if not batches:
            return
        assert self._producer is not None
        delay = 0.5
        while True:
            futures = []
            try:
                for batch in batches:
                    value = self.codec.encode(batch)
                    if len(value) > self._max_batch_bytes:
                        raise ValueError(
                            f"batch {batch.batch_id} is {len(value)} bytes, over the topic's limit of "
                            f"{self._max_batch_bytes}: lower --max-tokens or --max-rollouts"
                        )
                    partition = (batch.source_partition or 0) % self._output_partitions
                    futures.append(
                        await self._producer.send(self.output, value, key=batch.batch_id.encode(), partition=partition)
                    )
                for future in futures:
                    await future
                break
            except KafkaError as exc:
                if self._stopping.is_set():
                    raise
                # Resending is harmless: same ids, same content, and the journal reads either copy.
                log.warning("sending batches failed, retrying", error=str(exc)[:300], retry_in_s=delay)
                await asyncio.sleep(delay)  # backoff between retries, not synchronisation
                delay = min(delay * 2, 30.0)
        self.batches_sent += len(batches)
        for batch in batches:
            log.info(
                "batch",
                batch_id=batch.batch_id,
                partition=batch.source_partition,
                sequence=batch.sequence,
                records=len(batch.records),
                tokens=batch.n_tokens,
                dropped=batch.dropped_stale + batch.dropped_incomplete + batch.dropped_duplicate,
            )

    async def _commit(self, partitions: Mapping[int, Batcher] | None = None) -> None:
        """Commit each partition up to its lowest pending offset (only what moved)."""
        assert self._consumer is not None
        offsets: dict[TopicPartition, OffsetAndMetadata] = {}
        for partition, batcher in (partitions if partitions is not None else self.batchers).items():
            offset = batcher.commit_offset()
            if offset > self.committed.get(partition, -1):
                offsets[TopicPartition(self.source, partition)] = OffsetAndMetadata(offset, "")
        if not offsets:
            return
        try:
            await self._consumer.commit(offsets)
        except CommitFailedError as exc:
            # A rebalance is under way: the next owner starts from the last commit and its
            # recovery skips what the batches already hold, so nothing is lost or repeated.
            log.warning("commit failed during a rebalance", error=str(exc)[:200])
            return
        for tp, meta in offsets.items():
            self.committed[tp.partition] = meta.offset

    # -- rebalances -----------------------------------------------------------------------

    async def revoke(self, revoked: list[TopicPartition]) -> None:
        async with self.lock:
            self.generation += 1
            leaving = {tp.partition: self.batchers[tp.partition] for tp in revoked if tp.partition in self.batchers}
            await self._commit(leaving)
            for partition in leaving:
                del self.batchers[partition]
                self.committed.pop(partition, None)
        log.info("partitions revoked", partitions=sorted(tp.partition for tp in revoked))

    async def assign(self, assigned: list[TopicPartition]) -> None:
        try:
            await self._assign(assigned)
        except Exception as exc:
            # aiokafka only logs what a listener raises; a partition without its state would sit
            # unprocessed until the next rebalance. Stop instead: a restart recovers it.
            log.exception("recovering assigned partitions failed; stopping")
            self._failure = exc
            self.stop()

    async def _assign(self, assigned: list[TopicPartition]) -> None:
        assert self._consumer is not None
        async with self.lock:
            self.generation += 1
            for tp in assigned:
                committed = await self._consumer.committed(tp)
                if committed is None:
                    committed = (await self._consumer.beginning_offsets([tp]))[tp]
                self._consumer.seek(tp, committed)
                recovery = await self.recover(tp.partition, committed)
                self.batchers[tp.partition] = Batcher(
                    self.policy, partition=tp.partition, start_offset=committed, recovery=recovery
                )
                self.committed[tp.partition] = committed
                log.info(
                    "partition recovered",
                    partition=tp.partition,
                    committed=committed,
                    already_batched=len(recovery.decided),
                    sequence=recovery.sequence,
                    newest_policy_version=recovery.newest_version,
                )
        self.settings.run_dir.mkdir(parents=True, exist_ok=True)
        (self.settings.run_dir / READY_FILE).write_text(str(os.getpid()))

    async def recover(self, partition: int, committed: int) -> Recovery:
        """Read the output partition backwards until the batches can no longer hold offsets at or
        after ``committed`` (see :class:`agl_stream.batching.Recovery`)."""
        journal = self._journal
        assert journal is not None
        recovery = Recovery(partition, committed)
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
                    log.warning("unreadable record in the batches topic", offset=message.offset, error=str(error)[:200])
                    continue
                if name == TripletBatch.avro_name:
                    entries.append(JournalEntry.of_dict(value))
        return entries


async def run_batcher(
    settings: Settings, policy: BatchPolicy, *, input_topic: str | None = None, output_topic: str | None = None
) -> None:
    processor = BatcherProcessor(settings, policy, input_topic=input_topic, output_topic=output_topic)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, processor.stop)
    await processor.run()


def main(
    settings: Settings, policy: BatchPolicy, *, input_topic: str | None = None, output_topic: str | None = None
) -> None:
    """Run the batcher in the foreground until SIGTERM/SIGINT (``agl-stream batcher``)."""
    asyncio.run(run_batcher(settings, policy, input_topic=input_topic, output_topic=output_topic))
