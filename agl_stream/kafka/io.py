"""Typed producer and consumer helpers over aiokafka, speaking the Avro codec.

Producers are idempotent (acks=all). Consumers never auto-commit: the caller commits after its
effects are durable. Records that fail to decode go to the DLQ (durably, before the caller can
commit past them) and the consumer keeps going.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.structs import OffsetAndMetadata, RecordMetadata

from agl_stream.codec import Codec
from agl_stream.config import Settings
from agl_stream.errors import CodecError
from agl_stream.logs import get_logger
from agl_stream.models import AglModel, DlqRecord

log = get_logger(__name__)


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
    }
    options.update(overrides)
    return AIOKafkaConsumer(*topics, **options)


class TypedProducer:
    """Sends pydantic records (encoded with the codec) keyed by a string."""

    def __init__(self, producer: AIOKafkaProducer, codec: Codec | None = None) -> None:
        self.producer = producer
        self.codec = codec or Codec.default()

    async def send(self, topic: str, record: AglModel, key: str | None) -> RecordMetadata:
        """Send one record and wait until the broker acknowledged it."""
        future = await self.producer.send(topic, self.codec.encode(record), key=_key_bytes(key))
        return await future

    async def send_many(self, topic: str, records: Iterable[tuple[str | None, AglModel]]) -> list[RecordMetadata]:
        """Send records in order, then wait for all acknowledgements (batched by the producer)."""
        futures = [
            await self.producer.send(topic, self.codec.encode(record), key=_key_bytes(key)) for key, record in records
        ]
        return [await f for f in futures]


def _key_bytes(key: str | None) -> bytes | None:
    return None if key is None else key.encode()


@dataclass(frozen=True)
class Decoded:
    """One consumed record whose value decoded: ``value`` is the codec's fast-path dict."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    schema: str
    value: dict[str, Any]
    timestamp_ms: int


class DeadLetters:
    """Writes rejected input to the DLQ topic with its origin and reason."""

    def __init__(
        self, settings: Settings, producer: AIOKafkaProducer, processor: str, codec: Codec | None = None
    ) -> None:
        self.topic = settings.topic("dlq")
        self.producer = producer
        self.processor = processor
        self.codec = codec or Codec.default()
        self.count = 0

    async def send_many(self, rejected: list[tuple[ConsumerRecord[bytes, bytes], Exception]]) -> None:
        """Send and wait for every DLQ record, so the caller may then commit past them."""
        futures = []
        for message, error in rejected:
            record = DlqRecord(
                source_topic=message.topic,
                source_partition=message.partition,
                source_offset=message.offset,
                key=message.key,
                value=message.value or b"",
                reason=str(error),
                error_type=type(error).__name__,
                processor=self.processor,
                time=time.time(),
            )
            futures.append(await self.producer.send(self.topic, self.codec.encode(record), key=message.topic.encode()))
            log.warning(
                "record sent to the DLQ",
                topic=message.topic,
                partition=message.partition,
                offset=message.offset,
                error=type(error).__name__,
                reason=str(error)[:200],
            )
        for future in futures:
            await future
        self.count += len(rejected)


class BatchConsumer:
    """Fetches batches, decodes them, dead-letters what does not decode, commits explicitly."""

    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        dead_letters: DeadLetters,
        codec: Codec | None = None,
        expected_schema: str | None = None,
    ) -> None:
        self.consumer = consumer
        self.dead_letters = dead_letters
        self.codec = codec or Codec.default()
        self.expected_schema = expected_schema

    async def next_batch(self, *, max_records: int, timeout_ms: int) -> tuple[list[Decoded], dict[TopicPartition, int]]:
        """Decoded records, and per partition the next offset to commit once they are applied.

        The offsets cover dead-lettered records too: they are durable in the DLQ already.
        """
        fetched = await self.consumer.getmany(timeout_ms=timeout_ms, max_records=max_records)
        decoded: list[Decoded] = []
        rejected: list[tuple[ConsumerRecord[bytes, bytes], Exception]] = []
        next_offsets: dict[TopicPartition, int] = {}
        for tp, messages in fetched.items():
            for message in messages:
                try:
                    schema, value = self.codec.decode_dict(message.value or b"")
                    if self.expected_schema is not None and schema != self.expected_schema:
                        raise CodecError(f"expected a {self.expected_schema} record on {message.topic}, got {schema}")
                except CodecError as error:
                    rejected.append((message, error))
                    continue
                decoded.append(
                    Decoded(
                        message.topic,
                        message.partition,
                        message.offset,
                        message.key,
                        schema,
                        value,
                        message.timestamp,
                    )
                )
            if messages:
                next_offsets[tp] = messages[-1].offset + 1
        if rejected:
            await self.dead_letters.send_many(rejected)
        return decoded, next_offsets

    async def commit(self, next_offsets: Mapping[TopicPartition, int]) -> None:
        if next_offsets:
            await self.consumer.commit({tp: OffsetAndMetadata(o, "") for tp, o in next_offsets.items()})
