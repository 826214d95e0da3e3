"""The typed producer and consumer helpers against the real broker."""

from __future__ import annotations

import pytest

from agl_stream.config import Settings
from agl_stream.kafka import admin
from agl_stream.kafka.io import Outbox, Record, decode_as, make_consumer, make_producer, prepare_records
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


async def test_send_all_batches_a_partitions_records_and_answers_each_with_its_own_offset(settings: Settings) -> None:
    """Records bound for one partition in number go as producer batches the outbox fills: each
    still lands where the producer's own partitioner puts its key, in order, and is answered
    with the partition and offset a consumer finds it at; a record larger than a batch gets one
    of its own, and records few to a partition go one by one, in the same call."""
    await admin.apply(settings)
    topic = settings.topic("rollout-state")
    producer = make_producer(settings, max_batch_size=4096)
    await producer.start()
    try:
        outbox = Outbox(settings, producer, "io-test")
        keyed = [Record(topic, f"ro-{i:04d}".encode(), f"v{i}".encode() * 50) for i in range(120)]
        large = Record(topic, b"ro-large", b"x" * 6000)  # over the batch size: a batch of its own
        pinned = [Record(topic, f"p{i}".encode(), f"p{i}".encode(), partition=1) for i in range(3)]  # too few to batch
        records = [*keyed[:60], large, *pinned, *keyed[60:]]
        acks = await outbox.send_all(records)
        by_send = await producer.send_and_wait(topic, b"reference", key=keyed[7].key)
    finally:
        await producer.stop()
    assert len(acks) == len(records)
    assert by_send.partition == acks[7].partition  # the partitioner the producer itself uses
    assert len({a.partition for a in acks}) > 1 and all(a.topic == topic for a in acks)
    assert [a.partition for a in acks[61:64]] == [1, 1, 1]
    read = await read_topic(settings, topic, len(records) + 1)
    found = {(m.partition, m.offset): (m.key, m.value) for m in read}
    assert [found[(a.partition, a.offset)] for a in acks] == [(r.key, r.value) for r in records]
    per_partition: dict[int, list[int]] = {}
    for a in acks:
        per_partition.setdefault(a.partition, []).append(a.offset)
    assert all(offsets == sorted(offsets) for offsets in per_partition.values())  # in order
