"""The triplet builder against the real stack: records per finished attempt, kill -9, bad input."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer

from agl_stream import connect
from agl_stream.config import Settings
from agl_stream.domain.fold import fold
from agl_stream.kafka import admin
from agl_stream.kafka.io import make_producer
from agl_stream.kafka.offsets import committed_offsets, end_offsets
from agl_stream.local.processes import start_budget
from agl_stream.models import DlqRecord, RolloutState, TripletRecord
from agl_stream.wire.codec import Codec
from agl_stream.wire.span_records import SPAN_BATCH
from processors.triplets import TripletBuilder
from tests.integration.helpers import local_stack, read_topic, start_role, stop_role
from tests.replay_history import AttemptHistory, attempt_history, rollout_id_of, span_values

pytestmark = pytest.mark.integration


@pytest.fixture
def own_stack(kafka_bootstrap: str, tmp_path: Path) -> Iterator[Settings]:
    with local_stack(kafka_bootstrap, tmp_path) as settings:
        yield settings


def _builder(settings: Settings) -> subprocess.Popen[bytes]:
    ready = settings.run_dir / "triplets.ready"
    ready.unlink(missing_ok=True)
    process = start_role(settings, "triplets", "--settle", "2", log_name="triplets")
    deadline = time.monotonic() + start_budget(settings, "triplets")
    while not ready.exists():
        assert process.poll() is None, (settings.data_dir / "triplets.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the triplet builder never got its partitions"
        time.sleep(0.05)  # waiting for another process's ready file
    return process


async def _records(settings: Settings, topic: str, wanted: int, timeout: float = 90.0) -> list[bytes]:
    consumer = AIOKafkaConsumer(topic, **settings.kafka_client_options(), auto_offset_reset="earliest")
    await consumer.start()
    values: list[bytes] = []
    try:
        deadline = time.monotonic() + timeout
        while len(values) < wanted and time.monotonic() < deadline:
            for messages in (await consumer.getmany(timeout_ms=500)).values():
                values += [m.value for m in messages if m.value is not None]
    finally:
        await consumer.stop()
    return values


async def _records_covering(settings: Settings, wanted: set[str], timeout: float) -> list[TripletRecord]:
    """Triplet records from the start of the topic until every wanted rollout has one (or the timeout)."""
    consumer = AIOKafkaConsumer(
        settings.topic("triplets"), **settings.kafka_client_options(), auto_offset_reset="earliest"
    )
    await consumer.start()
    records: list[TripletRecord] = []
    try:
        deadline = time.monotonic() + timeout
        while not wanted <= {r.rollout_id for r in records} and time.monotonic() < deadline:
            for messages in (await consumer.getmany(timeout_ms=500)).values():
                records += [Codec.default().decode(m.value, TripletRecord) for m in messages if m.value]
    finally:
        await consumer.stop()
    return records


async def test_each_finished_attempt_becomes_one_record_with_its_token_ids(own_stack: Settings) -> None:
    builder = _builder(own_stack)
    runner = start_role(own_stack, "runner", "--agent", "tests.integration.agents:llm_like", log_name="runner")
    try:
        async with connect(**own_stack.model_dump(exclude_none=True)) as store:
            made = await store.enqueue_many_rollouts([{"input": {"i": i}, "mode": "train"} for i in range(1, 21)])
            finished = await store.wait_for_rollouts(rollout_ids=[r.rollout_id for r in made], timeout=120)
            assert [r.status for r in finished] == ["succeeded"] * 20
        codec = Codec.default()
        records = [codec.decode(v, TripletRecord) for v in await _records(own_stack, own_stack.topic("triplets"), 20)]
        by_rollout = {r.rollout_id: r for r in records}
        assert len(records) == 20 and set(by_rollout) == {r.rollout_id for r in made}
        for rollout in made:
            i = rollout.input["i"]  # type: ignore[index]
            record = by_rollout[rollout.rollout_id]
            base = i * 10
            assert [(t.prompt_token_ids, t.response_token_ids) for t in record.triplets] == [
                ([base, base + 1], [base + 2]),
                ([base + 1, base + 2], [base + 3]),
            ]
            assert record.final_reward == pytest.approx(i / 10)
            assert record.triplets[-1].reward == pytest.approx(i / 10)
            assert record.group_id.startswith("g-")
        assert len({r.group_id for r in records}) == 20  # different inputs, different groups
    finally:
        assert stop_role(runner, timeout=60) == 0
        stop_role(builder, timeout=30)


async def test_a_killed_builder_loses_no_attempt_and_garbage_goes_to_the_dlq(own_stack: Settings) -> None:
    builder = _builder(own_stack)
    runner = start_role(own_stack, "runner", "--agent", "tests.integration.agents:llm_like", log_name="runner")
    producer = make_producer(own_stack)
    await producer.start()
    try:
        garbage = await producer.send_and_wait(own_stack.topic("spans"), b"not a span", key=b"ro-garbage0000")
        async with connect(**own_stack.model_dump(exclude_none=True)) as store:
            made = await store.enqueue_many_rollouts([{"input": {"i": i}} for i in range(1, 61)])
            wanted = {r.rollout_id for r in made}

            # Kill it while attempts are finishing: some emitted, some collecting, some not started.
            await store.wait_for_rollouts(rollout_ids=[r.rollout_id for r in made[:10]], timeout=60)
            os.kill(builder.pid, signal.SIGKILL)
            builder.wait()
            finished = await store.wait_for_rollouts(rollout_ids=list(wanted), timeout=120)
            assert len(finished) == 60
        builder = _builder(own_stack)
        records = await _records_covering(own_stack, wanted, timeout=120)
        assert {r.rollout_id for r in records} >= wanted  # none lost (a repeat after the crash is allowed)
        assert all(len(r.triplets) == 2 for r in records if r.rollout_id in wanted)
        dlq = [Codec.default().decode(v, DlqRecord) for v in await _records(own_stack, own_stack.topic("dlq"), 1)]
        assert any(d.source_topic == own_stack.topic("spans") and d.source_offset == garbage.offset for d in dlq), (
            "the undecodable span was not dead-lettered"
        )
    finally:
        await producer.stop()
        assert stop_role(runner, timeout=60) == 0
        stop_role(builder, timeout=30)


def _final_state(history: AttemptHistory) -> RolloutState:
    """The state the rollout processor folds the history's events into (pure fold)."""
    state: RolloutState | None = None
    for event in history.events:
        result = fold(state, event)
        assert result.state is not None, result
        state = result.state
    assert state is not None
    return state


async def test_span_batches_and_single_spans_make_the_same_records(settings: Settings) -> None:
    """Attempts written as single spans, as batches (split in several records) and, against
    the contract, two attempts in one batch: every attempt gets its record, and a batch is
    committed past only once every attempt it holds was emitted."""
    await admin.apply(settings)
    codec = Codec.default()
    partition = _partition_of(rollout_id_of(0))
    neighbour = next(i for i in range(1, 64) if _partition_of(rollout_id_of(i)) == partition)
    singles = [attempt_history(1000 + i) for i in range(2)]
    batched = [attempt_history(2000 + i) for i in range(2)]
    mixed_a, mixed_b = attempt_history(0), attempt_history(neighbour)  # one partition
    spans_topic, states_topic = settings.topic("spans"), settings.topic("rollout-state")
    producer = make_producer(settings)
    await producer.start()
    try:
        for history in (*singles, *batched, mixed_a):
            await producer.send_and_wait(
                states_topic, codec.encode(_final_state(history)), key=history.rollout_id.encode()
            )
        sends = [
            *((h.rollout_id, v) for h in singles for v in span_values(h, codec, None)),
            *((h.rollout_id, v) for h in batched for v in span_values(h, codec, 4)),  # 3 records each
            (mixed_a.rollout_id, codec.encode_dict(SPAN_BATCH, {
                "rollout_id": mixed_a.rollout_id, "attempt_id": mixed_a.spans[0]["attempt_id"],
                "spans": mixed_a.spans + mixed_b.spans,
            })),
        ]  # fmt: skip
        sent = {value: await producer.send_and_wait(spans_topic, value, key=key.encode()) for key, value in sends}
        mixed = sent[sends[-1][1]]
    finally:
        await producer.stop()

    async def run_builder_until(records_wanted: int) -> list[TripletRecord]:
        stop = asyncio.Event()
        builder = TripletBuilder(settings, settle_s=60.0)  # complete by count, not by settling
        task = asyncio.create_task(builder.run(stop))
        try:
            got = await read_topic(settings, settings.topic("triplets"), records_wanted, timeout=90)
        finally:
            stop.set()
            await task
        return [codec.decode(m.value, TripletRecord) for m in got]

    first = await run_builder_until(5)
    assert sorted(r.rollout_id for r in first) == sorted(h.rollout_id for h in (*singles, *batched, mixed_a))
    for record in first:
        assert len(record.triplets) == 8
    group = f"{settings.topic_prefix}.processor.triplets"
    committed = {
        tp.partition: o for tp, o in (await committed_offsets(settings, group)).items() if tp.topic == spans_topic
    }
    assert committed[mixed.partition] == mixed.offset  # mixed_b still holds the batch
    ends = await end_offsets(settings, spans_topic)
    assert all(committed.get(tp.partition, 0) == end for tp, end in ends.items() if tp.partition != mixed.partition)

    # mixed_b finishes: a new builder reads the batch again and emits it.
    producer = make_producer(settings)
    await producer.start()
    try:
        await producer.send_and_wait(states_topic, codec.encode(_final_state(mixed_b)), key=mixed_b.rollout_id.encode())
    finally:
        await producer.stop()
    second = await run_builder_until(6)
    [late] = [r for r in second if r.rollout_id == mixed_b.rollout_id]
    assert [t.response_token_ids for t in late.triplets] == [
        s["attributes"]["response_token_ids"] for s in mixed_b.spans[:8]
    ]


def _partition_of(rollout_id: str) -> int:
    from aiokafka.partitioner import DefaultPartitioner

    return int(DefaultPartitioner()(rollout_id.encode(), [0, 1, 2, 3], [0, 1, 2, 3]))
