"""The ClickHouse sink against the real broker and the real embedded engine.

Exactly-once across a real `kill -9`, and bad records dead-lettered without stopping the sink,
with spans as single agl.Span records and as agl.SpanBatch records (many spans, one offset).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import time
from pathlib import Path
from typing import cast

import pytest

from agl_stream.config import Settings
from agl_stream.kafka import admin
from agl_stream.kafka.io import make_producer
from agl_stream.kafka.offsets import committed_offsets, wait_for_group
from agl_stream.models import DlqRecord
from agl_stream.wire.codec import Codec
from agl_stream.wire.span_records import span_dict_records
from consumers.sink_specs import SPANS, sinks_group_id
from producers.synthetic_spans import produce_spans, synthetic_span
from tests.integration.helpers import (
    clickhouse,
    read_topic,
    start_role,
    stop_role,
    wait_committed_at_least,
)

pytestmark = pytest.mark.integration

TOTAL = 10_000


def _group(settings: Settings) -> str:
    return sinks_group_id(settings, SPANS.lane)  # the `sink` role's consumer of the store's tables


@pytest.mark.parametrize("per_record", [1, 7])
async def test_kill_9_halfway_loses_nothing_and_duplicates_nothing(settings: Settings, per_record: int) -> None:
    await admin.apply(settings)
    ends = await produce_spans(settings, TOTAL, rollouts=200, per_record=per_record)
    records = sum(ends.values())
    assert records == (TOTAL if per_record == 1 else 200 * -(-TOTAL // (200 * per_record)))
    group = _group(settings)

    # Small batches so the sink is still mid-stream when it is killed.
    batch_size = str(200 // per_record)
    sink = start_role(settings, "sink", "--batch-size", batch_size, "--flush-ms", "50", log_name="sink1")
    try:
        await wait_committed_at_least(settings, group, records // 5, timeout=120, topic=settings.topic("spans"))
        sink.send_signal(signal.SIGKILL)
        sink.wait(30)
    finally:
        stop_role(sink)
    spans_topic = settings.topic("spans")
    at_kill = sum(o for tp, o in (await committed_offsets(settings, group)).items() if tp.topic == spans_topic)
    assert at_kill < records, "the sink finished before it was killed; lower its batch size"

    # Offsets are committed only after the rows are durable: the table holds at least as much.
    with clickhouse(settings) as ch:
        query = f"SELECT uniqExact(KafkaPartition, KafkaOffset) FROM {settings.clickhouse_database}.otel_traces"
        records_after_kill = ch.command(query)
    assert int(str(records_after_kill)) >= at_kill

    sink = start_role(settings, "sink", "--batch-size", batch_size, "--flush-ms", "50", log_name="sink2")
    try:
        await wait_for_group(settings, group, ends, timeout=120)
    finally:
        assert stop_role(sink) == 0

    with clickhouse(settings) as ch:
        db = settings.clickhouse_database
        assert int(str(ch.command(f"SELECT count() FROM {db}.otel_traces"))) == TOTAL
        assert int(str(ch.command(f"SELECT uniqExact(KafkaPartition, KafkaOffset) FROM {db}.otel_traces"))) == records
        assert int(str(ch.command(f"SELECT uniqExact(RolloutId, SequenceId) FROM {db}.otel_traces"))) == TOTAL
        rows = ch.query(
            f"SELECT Partition, max(NextOffset) FROM {db}.sink_offsets FINAL GROUP BY Partition"
        ).result_rows
        applied = {partition: offset for partition, offset in rows}
    assert {tp.partition: end for tp, end in ends.items()} == applied


def _has_logged(path: Path, text: str) -> bool:
    return path.exists() and text in path.read_text(errors="replace")


async def _logged(path: Path, text: str, *, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(_has_logged, path, text):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} did not log {text!r} within {timeout}s")
        await asyncio.sleep(0.1)


async def test_a_restart_with_every_row_in_brings_the_offsets_row_to_the_end(settings: Settings) -> None:
    """Killed after all its rows were in and committed, but before its sink_offsets row caught up
    (the embedded engine writes one every few seconds), the sink is started again: it has
    nothing to insert, and the row must still reach the end, or a reader waiting on that row (a
    ClickHouse server's fence) waits for the next record of the partition."""
    await admin.apply(settings)
    ends = await produce_spans(settings, 400, rollouts=40, per_record=1)
    group = _group(settings)
    # Small batches: the first one's offsets row is far from the end, and the later ones come
    # before the next row is due.
    sink = start_role(settings, "sink", "--batch-size", "20", "--flush-ms", "50", log_name="sink1")
    try:
        await wait_for_group(settings, group, ends, timeout=120)
        sink.send_signal(signal.SIGKILL)
        sink.wait(30)
    finally:
        stop_role(sink)
    sink = start_role(settings, "sink", "--batch-size", "20", "--flush-ms", "50", log_name="sink2")
    try:
        await _logged(Path(settings.data_dir) / "sink2.log", "partitions assigned")
    finally:
        assert stop_role(sink) == 0
    with clickhouse(settings) as ch:
        db = settings.clickhouse_database
        rows = ch.query(
            f"SELECT Partition, max(NextOffset) FROM {db}.sink_offsets FINAL GROUP BY Partition"
        ).result_rows
        assert int(str(ch.command(f"SELECT count() FROM {db}.otel_traces"))) == 400
    assert {partition: offset for partition, offset in rows} == {tp.partition: end for tp, end in ends.items()}


async def test_undecodable_record_goes_to_the_dlq_and_the_sink_keeps_going(settings: Settings) -> None:
    await admin.apply(settings)
    codec = Codec.default()
    topic = settings.topic("spans")
    producer = make_producer(settings, max_request_size=8 << 20)
    await producer.start()
    try:
        good = [synthetic_span(i) for i in range(5)]
        for span in good[:2]:
            await producer.send_and_wait(topic, codec.encode_dict("agl.Span", span), key=span["rollout_id"].encode())
        bad = await producer.send_and_wait(topic, b"\xc3\x01garbage!", key=good[0]["rollout_id"].encode())
        # Too large for agl.dlq as it is: its DLQ record keeps a head, the size and a digest.
        huge_value = b"\xc3\x01" + os.urandom(5 << 20)
        huge = await producer.send_and_wait(topic, huge_value, key=good[0]["rollout_id"].encode())
        for span in good[2:]:
            await producer.send_and_wait(topic, codec.encode_dict("agl.Span", span), key=span["rollout_id"].encode())
    finally:
        await producer.stop()

    sink = start_role(settings, "sink", "--flush-ms", "50", log_name="sink")
    try:
        await wait_committed_at_least(settings, _group(settings), 7, timeout=60, topic=settings.topic("spans"))
    finally:
        assert stop_role(sink) == 0

    dead = await read_topic(settings, settings.topic("dlq"), 2)
    records = {(r.source_partition, r.source_offset): r for r in (codec.decode(d.value, DlqRecord) for d in dead)}
    record = records[(bad.partition, bad.offset)]
    assert record.source_topic == topic
    assert record.value == b"\xc3\x01garbage!" and record.value_size == len(record.value)
    assert record.error_type and record.reason
    assert {d.key for d in dead} == {topic.encode()}
    large = records[(huge.partition, huge.offset)]
    assert large.value == huge_value[: len(large.value)] and 0 < len(large.value) <= 64 << 10
    assert large.value_size == len(huge_value) and large.value_sha256 == hashlib.sha256(huge_value).hexdigest()
    with clickhouse(settings) as ch:
        names = {r[0] for r in ch.query(f"SELECT SpanId FROM {settings.clickhouse_database}.otel_traces").result_rows}
    assert names == {s["span_id"] for s in good}


async def test_a_block_clickhouse_rejects_is_split_and_only_the_bad_record_dead_lettered(settings: Settings) -> None:
    """A record with the current fingerprint but a broken body passes the header check; the
    engine rejects the block, the sink finds the record in Python and keeps the rest."""
    await admin.apply(settings)
    codec = Codec.default()
    topic = settings.topic("spans")
    spans = [synthetic_span(i, rollouts=1) for i in range(6)]  # one rollout: one partition, in order
    truncated = codec.encode_dict("agl.Span", spans[3])[:-40]
    producer = make_producer(settings)
    await producer.start()
    try:
        sent = []
        for i, span in enumerate(spans):
            value = truncated if i == 3 else codec.encode_dict("agl.Span", span)
            sent.append(await producer.send_and_wait(topic, value, key=span["rollout_id"].encode()))
    finally:
        await producer.stop()

    sink = start_role(settings, "sink", "--flush-ms", "200", log_name="sink")
    try:
        await wait_committed_at_least(settings, _group(settings), len(spans), timeout=60, topic=settings.topic("spans"))
    finally:
        assert stop_role(sink) == 0

    [dead] = await read_topic(settings, settings.topic("dlq"), 1)
    record = codec.decode(dead.value, DlqRecord)
    assert record.source_offset == sent[3].offset
    assert record.value == truncated
    assert record.error_type == "MalformedRecordError"
    with clickhouse(settings) as ch:
        ids = {r[0] for r in ch.query(f"SELECT SpanId FROM {settings.clickhouse_database}.otel_traces").result_rows}
    assert ids == {s["span_id"] for i, s in enumerate(spans) if i != 3}


async def test_bad_span_batches_are_dead_lettered_whole_beside_good_batches_and_single_spans(
    settings: Settings,
) -> None:
    """Two kinds of bad batch in one sink batch: a truncated body (Python finds it) and a span
    with a NaN start time (valid Avro; the engine refuses it, its probe finds it)."""
    await admin.apply(settings)
    codec = Codec.default()
    topic = settings.topic("spans")
    spans = [synthetic_span(i, rollouts=1) for i in range(10)]  # one rollout: one partition, in order
    [(_, broken)] = span_dict_records(spans[3:6], codec)
    broken = broken[:-40]  # current fingerprint, body cut inside its last span
    [(_, refused)] = span_dict_records([spans[8], {**spans[9], "start_time": float("nan")}], codec)
    values = [
        codec.encode_dict("agl.Span", spans[0]),
        span_dict_records(spans[1:3], codec)[0][1],
        broken,
        refused,
        span_dict_records(spans[6:8], codec)[0][1],
    ]
    producer = make_producer(settings)
    await producer.start()
    try:
        sent = [await producer.send_and_wait(topic, value, key=spans[0]["rollout_id"].encode()) for value in values]
    finally:
        await producer.stop()

    sink = start_role(settings, "sink", "--flush-ms", "200", log_name="sink")
    try:
        await wait_committed_at_least(
            settings, _group(settings), len(values), timeout=60, topic=settings.topic("spans")
        )
    finally:
        assert stop_role(sink) == 0

    dead = [codec.decode(m.value, DlqRecord) for m in await read_topic(settings, settings.topic("dlq"), 2)]
    assert sorted((d.source_offset, d.value, d.error_type) for d in dead) == [
        (sent[2].offset, broken, "MalformedRecordError"),
        (sent[3].offset, refused, "EngineRefusedError"),
    ]
    assert "DateTime64" in next(d.reason for d in dead if d.error_type == "EngineRefusedError")
    with clickhouse(settings) as ch:
        rows = ch.query(f"SELECT SpanId, KafkaOffset FROM {settings.clickhouse_database}.otel_traces").result_rows
    # The driver types result rows as Sequence[Any]; this query's are (SpanId, KafkaOffset) tuples.
    span_offsets = cast("list[tuple[str, int]]", rows)
    kept = [s["span_id"] for i, s in enumerate(spans) if i in (0, 1, 2, 6, 7)]
    offsets = [sent[0].offset, sent[1].offset, sent[1].offset, sent[4].offset, sent[4].offset]
    assert sorted(span_offsets) == sorted(zip(kept, offsets, strict=True))
