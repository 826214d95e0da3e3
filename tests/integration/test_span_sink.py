"""The ClickHouse sink against the real broker and the real embedded engine.

Exactly-once across a real `kill -9`, and bad records dead-lettered without stopping the sink.
"""

from __future__ import annotations

import signal

import pytest

from agl_stream.codec import Codec
from agl_stream.config import Settings
from agl_stream.kafka import admin
from agl_stream.kafka.io import make_producer
from agl_stream.kafka.offsets import committed_offsets, wait_for_group
from agl_stream.models import DlqRecord
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
    return f"{settings.topic_prefix}.sink.clickhouse-spans"


async def test_kill_9_halfway_loses_nothing_and_duplicates_nothing(settings: Settings) -> None:
    await admin.apply(settings)
    ends = await produce_spans(settings, TOTAL, rollouts=200)
    assert sum(ends.values()) == TOTAL
    group = _group(settings)

    # Small batches so the sink is still mid-stream when it is killed.
    sink = start_role(settings, "sink", "--batch-size", "200", "--flush-ms", "50", log_name="sink1")
    try:
        await wait_committed_at_least(settings, group, 2_000, timeout=120)
        sink.send_signal(signal.SIGKILL)
        sink.wait(30)
    finally:
        stop_role(sink)
    at_kill = sum((await committed_offsets(settings, group)).values())
    assert at_kill < TOTAL, "the sink finished before it was killed; lower its batch size"

    # Offsets are committed only after the rows are durable: the table holds at least as much.
    with clickhouse(settings) as ch:
        rows_after_kill = ch.command(f"SELECT count() FROM {settings.clickhouse_database}.otel_traces")
    assert int(rows_after_kill) >= at_kill

    sink = start_role(settings, "sink", "--batch-size", "200", "--flush-ms", "50", log_name="sink2")
    try:
        await wait_for_group(settings, group, ends, timeout=120)
    finally:
        assert stop_role(sink) == 0

    with clickhouse(settings) as ch:
        db = settings.clickhouse_database
        assert int(ch.command(f"SELECT count() FROM {db}.otel_traces")) == TOTAL
        assert int(ch.command(f"SELECT uniqExact(KafkaPartition, KafkaOffset) FROM {db}.otel_traces")) == TOTAL
        assert int(ch.command(f"SELECT uniqExact(RolloutId, SequenceId) FROM {db}.otel_traces")) == TOTAL
        applied = dict(
            ch.query(f"SELECT Partition, max(NextOffset) FROM {db}.sink_offsets FINAL GROUP BY Partition").result_rows
        )
    assert {tp.partition: end for tp, end in ends.items()} == applied


async def test_undecodable_record_goes_to_the_dlq_and_the_sink_keeps_going(settings: Settings) -> None:
    await admin.apply(settings)
    codec = Codec.default()
    topic = settings.topic("spans")
    producer = make_producer(settings)
    await producer.start()
    try:
        good = [synthetic_span(i) for i in range(5)]
        for span in good[:2]:
            await producer.send_and_wait(topic, codec.encode_dict("agl.Span", span), key=span["rollout_id"].encode())
        bad = await producer.send_and_wait(topic, b"\xc3\x01garbage!", key=good[0]["rollout_id"].encode())
        for span in good[2:]:
            await producer.send_and_wait(topic, codec.encode_dict("agl.Span", span), key=span["rollout_id"].encode())
    finally:
        await producer.stop()

    sink = start_role(settings, "sink", "--flush-ms", "50", log_name="sink")
    try:
        await wait_committed_at_least(settings, _group(settings), 6, timeout=60)
    finally:
        assert stop_role(sink) == 0

    [dead] = await read_topic(settings, settings.topic("dlq"), 1)
    record = codec.decode(dead.value, DlqRecord)
    assert record.source_topic == topic
    assert (record.source_partition, record.source_offset) == (bad.partition, bad.offset)
    assert record.value == b"\xc3\x01garbage!"
    assert record.error_type and record.reason
    assert dead.key == topic.encode()
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
        await wait_committed_at_least(settings, _group(settings), len(spans), timeout=60)
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
