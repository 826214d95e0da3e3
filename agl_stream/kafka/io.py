"""Typed producer and consumer helpers over aiokafka, speaking the Avro codec.

Producers are idempotent (acks=all). Consumers never auto-commit: the caller commits after its
effects are durable. Records that fail to decode go to the DLQ (durably, before the caller can
commit past them) and the consumer keeps going.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import wrapt
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.partitioner import DefaultPartitioner
from aiokafka.structs import RecordMetadata

from agl_stream import metrics
from agl_stream.config import Settings
from agl_stream.errors import CodecError, RecordTypeError
from agl_stream.logs import get_logger
from agl_stream.models import AglModel, DlqRecord
from agl_stream.wire.codec import Codec

log = get_logger(__name__)

BATCHED_FROM = 8
"""Records of one ``Outbox.send_all`` to one partition from which they go as producer batches."""
_PARTITIONER = DefaultPartitioner()  # the producer's default: the same partition for a key


def _count_request(wrapped: Callable[..., Any], _instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    request = args[1] if len(args) > 1 else kwargs.get("request")
    api = type(request).__name__.split("Request", 1)[0] or "unknown"
    metrics.KAFKA_REQUESTS.labels(metrics.role(), api).inc()
    return wrapped(*args, **kwargs)


# Every request an aiokafka client sends (produce, fetch, commits, heartbeats, metadata) goes
# through AIOKafkaClient.send: counted per API, so a benchmark can say what a rollout costs the
# broker, role by role (agl_kafka_requests; benchmarks/compare_seed.py --count).
wrapt.wrap_function_wrapper("aiokafka.client", "AIOKafkaClient.send", _count_request)


def make_producer(settings: Settings, **overrides: Any) -> AIOKafkaProducer:
    """An idempotent producer with the configured batching and compression."""
    options: dict[str, Any] = {
        **settings.kafka_client_options(),
        "enable_idempotence": True,
        "acks": "all",
        "linger_ms": settings.producer_linger_ms,
        "max_batch_size": settings.producer_max_batch_size,
        "max_request_size": settings.producer_max_request_size,
        "compression_type": None if settings.producer_compression == "none" else settings.producer_compression,
    }
    options.update(overrides)
    return AIOKafkaProducer(**options)


IDLE_FETCH_WAIT_MS = 2000
"""How long the broker holds a consumer's fetch that finds no data (a new record ends it)."""
IDLE_WAITS: dict[str, int] = {
    # A fetch the broker holds until data arrives: it answers at once when there is some, so a
    # longer hold only makes an idle consumer ask less often (500 ms by default).
    "fetch_max_wait_ms": IDLE_FETCH_WAIT_MS,
    # How often aiokafka's fetcher task wakes with nothing to do (200 ms by default: five times a
    # second per consumer, each time going over every assigned partition). A fetch answered, a
    # record consumed, a seek, a reset or a rebalance wakes it at once, so this is only its
    # safety net.
    "consumer_timeout_ms": IDLE_FETCH_WAIT_MS,
}
"""The waits of every long-lived consumer: an idle one asks the broker, and wakes, rarely."""


def make_consumer(settings: Settings, *topics: str, group_id: str | None, **overrides: Any) -> AIOKafkaConsumer:
    """A consumer with explicit commits that reads only committed (transactional) data."""
    options: dict[str, Any] = {
        **settings.kafka_client_options(),
        "group_id": group_id,
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "isolation_level": "read_committed",
        "max_partition_fetch_bytes": 8 << 20,
        "fetch_max_bytes": 64 << 20,
        **IDLE_WAITS,
    }
    options.update(overrides)
    return AIOKafkaConsumer(*topics, **options)


def _key_bytes(key: str | None) -> bytes | None:
    return None if key is None else key.encode()


T = TypeVar("T")


@dataclass(frozen=True)
class Fetched(Generic[T]):
    """One consumed record and what ``prepare`` made of it (a decoded dict, an Avro body, ...)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: T
    raw: bytes
    timestamp_ms: int


@dataclass(frozen=True)
class Rejected:
    """A record that must go to the DLQ, with where it came from and why."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    raw: bytes
    error: Exception

    @classmethod
    def of(cls, record: ConsumerRecord[bytes, bytes] | Fetched[Any], error: Exception) -> Rejected:
        raw = record.raw if isinstance(record, Fetched) else (record.value or b"")
        return cls(record.topic, record.partition, record.offset, record.key, raw, error)


def _added(batch: Any, record: Record) -> bool:
    """Whether ``record`` went into the producer batch (False: it is full)."""
    return batch.append(timestamp=None, key=record.key, value=record.value, headers=record.headers or []) is not None


def decode_as(codec: Codec, avro_name: str | None = None) -> Callable[[bytes], dict[str, Any]]:
    """A ``prepare`` function: the codec's fast-path dict, checking the record type if given."""

    def prepare(data: bytes) -> dict[str, Any]:
        name, value = codec.decode_dict(data)
        if avro_name is not None and name != avro_name:
            raise RecordTypeError(f"expected a {avro_name} record, got {name}")
        return value

    return prepare


DLQ_VALUE_HEAD = 64 << 10
"""Bytes of a rejected value a DLQ record keeps: a record too large for its topic must still fit
in agl.dlq, so dead-lettering can never fail for the size of what it dead-letters."""
DLQ_KEY_HEAD = 1 << 10
DLQ_REASON_CHARS = 4000


def dead_letter(item: Rejected, processor: str) -> DlqRecord:
    """The DLQ record of a rejected input: where it came from, why, and a bounded head of its
    bytes with the whole value's size and SHA-256 (enough to find and compare the original)."""
    reason = str(item.error)
    return DlqRecord(
        source_topic=item.topic,
        source_partition=item.partition,
        source_offset=item.offset,
        key=None if item.key is None else bytes(item.key[:DLQ_KEY_HEAD]),
        value=bytes(item.raw[:DLQ_VALUE_HEAD]),
        reason=reason if len(reason) <= DLQ_REASON_CHARS else reason[:DLQ_REASON_CHARS] + "...",
        error_type=type(item.error).__name__,
        processor=processor,
        time=time.time(),
        value_size=len(item.raw),
        value_sha256=hashlib.sha256(item.raw).hexdigest(),
    )


@dataclass(frozen=True)
class Record:
    """One record to produce (``value`` None is a tombstone; ``partition`` None: by key)."""

    topic: str
    key: bytes | None
    value: bytes | None
    partition: int | None = None
    headers: list[tuple[str, bytes]] | None = None


class Outbox:
    """What a role writes: records, typed records and dead letters, through one producer.

    Every call returns once each of its records is acknowledged, and settles every send before
    it raises: a send still in flight when a handler starts over after a failure could land
    after the rebuilt state was read. Dead letters carry ``processor`` as their origin.
    One task uses an outbox at a time (the processor loop, or a client's writer).
    """

    def __init__(
        self, settings: Settings, producer: AIOKafkaProducer, processor: str, codec: Codec | None = None
    ) -> None:
        self.producer = producer
        self.processor = processor
        self.codec = codec or Codec.default()
        self.dlq_topic = settings.topic("dlq")
        self.dead_lettered = 0

    @classmethod
    @contextlib.asynccontextmanager
    async def started(
        cls, settings: Settings, processor: str, codec: Codec | None = None, **producer_options: Any
    ) -> AsyncIterator[Outbox]:
        """An outbox over a producer of its own (``make_producer`` options), stopped at the end."""
        producer = make_producer(settings, **producer_options)
        await producer.start()
        try:
            yield cls(settings, producer, processor, codec)
        finally:
            await producer.stop()

    async def send_all(self, records: Iterable[Record]) -> list[RecordMetadata]:
        """Send the records, in order per partition, then wait for every acknowledgement.

        Records bound for one partition in number (:data:`BATCHED_FROM` or more) go as producer
        batches the outbox fills itself: one future and one metadata check per batch instead of
        per record, and the partitioner once per key either way (a record larger than a batch
        gets one of its own, as ``send`` would give it). The others go through ``send``.
        Callers keep records under the topics' limits (``MAX_RECORD_BYTES``)."""
        records = list(records)
        lanes: dict[tuple[str, int | None], list[int]] = {}
        partitions: dict[str, list[int]] = {}
        for i, r in enumerate(records):
            partition = r.partition
            if partition is None and r.key is not None:  # where the producer would put the key
                if (known := partitions.get(r.topic)) is None:
                    known = partitions[r.topic] = sorted(await self.producer.partitions_for(r.topic))
                partition = int(_PARTITIONER(r.key, known, known))
            lanes.setdefault((r.topic, partition), []).append(i)
        acks: list[tuple[list[int], asyncio.Future[RecordMetadata]]] = []
        for (topic, partition), indices in lanes.items():
            if partition is None or len(indices) < BATCHED_FROM:
                acks += [([i], await self._send_one(records[i], partition)) for i in indices]
            else:
                acks += await self._send_batches(topic, partition, records, indices)
        settled = await asyncio.gather(*(future for _, future in acks), return_exceptions=True)
        for result in settled:
            if isinstance(result, BaseException):
                raise result
        acknowledged: list[RecordMetadata] = [None] * len(records)  # type: ignore[list-item]  # each set below
        for (indices, _), first in zip(acks, settled, strict=True):
            assert isinstance(first, RecordMetadata)
            for n, i in enumerate(indices):  # a batch's records follow its first record's offset
                acknowledged[i] = first if n == 0 else first._replace(offset=first.offset + n)
        for topic, n in Counter(r.topic for r in records).items():
            metrics.count_out(topic, n)
        return acknowledged

    async def _send_one(self, r: Record, partition: int | None) -> asyncio.Future[RecordMetadata]:
        return await self.producer.send(r.topic, r.value, key=r.key, partition=partition, headers=r.headers)

    async def _send_batches(
        self, topic: str, partition: int, records: Sequence[Record], indices: Sequence[int]
    ) -> list[tuple[list[int], asyncio.Future[RecordMetadata]]]:
        """The records at ``indices`` to one partition as full producer batches, in order."""
        sent: list[tuple[list[int], asyncio.Future[RecordMetadata]]] = []
        batch, held = self.producer.create_batch(), list[int]()
        for i in indices:
            if not _added(batch, records[i]):  # full: send it and start the next with this record
                sent.append((held, await self.producer.send_batch(batch, topic, partition=partition)))
                batch, held = self.producer.create_batch(), []
                if not _added(batch, records[i]):
                    raise AssertionError("an empty producer batch refused a record")  # aiokafka takes any
            held.append(i)
        if held:
            sent.append((held, await self.producer.send_batch(batch, topic, partition=partition)))
        return sent

    async def send(
        self, topic: str, record: AglModel, key: str | None, *, partition: int | None = None
    ) -> RecordMetadata:
        """Send one typed record (encoded with the codec) and wait for its acknowledgement."""
        (acknowledged,) = await self.send_all([Record(topic, _key_bytes(key), self.codec.encode(record), partition)])
        return acknowledged

    async def send_many(self, topic: str, records: Iterable[tuple[str | None, AglModel]]) -> list[RecordMetadata]:
        """Send typed records in order, then wait for every acknowledgement."""
        return await self.send_all(Record(topic, _key_bytes(key), self.codec.encode(r)) for key, r in records)

    async def reject(self, rejected: Sequence[Rejected]) -> None:
        """Write each rejected input to the DLQ with its origin and reason, durably."""
        if not rejected:
            return
        await self.send_all(
            Record(self.dlq_topic, item.topic.encode(), self.codec.encode(dead_letter(item, self.processor)))
            for item in rejected
        )
        for item in rejected:
            log.warning(
                "record sent to the DLQ",
                topic=item.topic,
                partition=item.partition,
                offset=item.offset,
                error=type(item.error).__name__,
                reason=str(item.error)[:200],
            )
        self.dead_lettered += len(rejected)
        metrics.count_dlq((item.topic, item.error) for item in rejected)


def prepare_records(
    batch: Mapping[TopicPartition, Sequence[ConsumerRecord[bytes, bytes]]], prepare: Callable[[bytes], T]
) -> tuple[list[Fetched[T]], list[Rejected]]:
    """Each record of a fetch through ``prepare``; those it refuses with :class:`CodecError` are
    returned as rejected (for the DLQ), the others with what ``prepare`` made of them."""
    prepared: list[Fetched[T]] = []
    rejected: list[Rejected] = []
    for messages in batch.values():
        for message in messages:
            raw = message.value or b""
            try:
                value = prepare(raw)
            except CodecError as error:
                rejected.append(Rejected.of(message, error))
                continue
            prepared.append(
                Fetched(message.topic, message.partition, message.offset, message.key, value, raw, message.timestamp)
            )
    return prepared, rejected
