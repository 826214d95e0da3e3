"""The typed producer and consumer helpers against the real broker."""

from __future__ import annotations

import pytest

from agl_stream.config import Settings
from agl_stream.kafka import admin
from agl_stream.kafka.io import Outbox, decode_as, make_consumer, make_producer, prepare_records
from agl_stream.models import DlqRecord, Worker
from agl_stream.wire.codec import Codec
from tests.integration.helpers import read_topic

pytestmark = pytest.mark.integration


async def test_typed_records_round_trip_and_other_record_types_are_dead_lettered(settings: Settings) -> None:
    await admin.apply(settings)
    topic = settings.topic("workers")
    producer = make_producer(settings)
    await producer.start()
    consumer = make_consumer(settings, topic, group_id=f"{settings.topic_prefix}.io-test")
    await consumer.start()
    try:
        typed = Outbox(settings, producer, "io-test")
        workers = [Worker(worker_id=f"w-{i}", heartbeat_stats={"i": i}) for i in range(3)]
        sent = await typed.send_many(topic, [(w.worker_id, w) for w in workers])
        stray = DlqRecord(
            source_topic="x",
            source_partition=0,
            source_offset=0,
            value=b"",
            reason="r",
            error_type="E",
            processor="p",
            time=0.0,
        )
        wrong = await typed.send(topic, stray, key="w-0")
        prepare = decode_as(Codec.default(), "agl.Worker")
        got: list[dict[str, object]] = []
        seen = 0
        while seen < len(sent) + 1:
            fetched = await consumer.getmany(timeout_ms=1000, max_records=100)
            prepared, rejected = prepare_records(fetched, prepare)
            await typed.reject(rejected)
            got += [f.value for f in prepared]
            seen += len(prepared) + len(rejected)
    finally:
        await consumer.stop()
        await producer.stop()
    assert sorted(str(g["worker_id"]) for g in got) == ["w-0", "w-1", "w-2"]
    [dead] = await read_topic(settings, settings.topic("dlq"), 1)
    record = Codec.default().decode(dead.value, DlqRecord)
    assert (record.source_partition, record.source_offset) == (wrong.partition, wrong.offset)
    assert record.error_type == "RecordTypeError" and "agl.Worker" in record.reason
