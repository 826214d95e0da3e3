"""agl-stream replay against a real broker and the real engine: history written as the store's
events and spans, replayed twice (byte-identical), rerun (nothing new), a range, SQL selection,
a new reward, malformed input, and the batcher consuming the replay topic."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any
from uuid import uuid4

import pytest

from agl_stream.config import Settings
from agl_stream.domain.replay import ReplaySettings, Selection, batches_topic_of
from agl_stream.kafka.io import make_producer
from agl_stream.kafka.offsets import end_offsets
from agl_stream.local import stack
from agl_stream.local.processes import role_environment
from agl_stream.models import Span, TripletBatch, TripletRecord
from agl_stream.wire.codec import Codec
from producers.replay import replay
from tests.integration.helpers import read_topic, start_role, stop_role
from tests.replay_history import attempt_history, rollout_id_of, write_history

pytestmark = pytest.mark.integration

ROLLOUTS = 24
GROUPS = 6


def constant_reward(spans: list[Span]) -> float:
    return 0.25


def picky_reward(spans: list[Span]) -> float | None:
    if spans[0].rollout_id == rollout_id_of(3):
        raise ValueError("no reward for rollout 3")
    return None if spans[0].rollout_id == rollout_id_of(4) else float(len(spans))


@pytest.fixture(scope="module")
def history(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """A stack of its own (the SQL selection needs the gateway's engine), with the history
    (single spans and span batches) and one undecodable span in it."""
    import asyncio

    settings = Settings(
        kafka_bootstrap=kafka_bootstrap,
        data_dir=tmp_path_factory.mktemp("replay"),
        topic_prefix=f"r{uuid4().hex[:10]}",
        gateway_port=0,
    )
    stack.up(settings)
    try:
        running = stack.local_stack_settings(settings)

        async def write() -> None:
            # Even rollouts as single spans, odd ones as span batches of up to 4 spans (3 records).
            await write_history(running, [attempt_history(i, groups=GROUPS) for i in range(0, ROLLOUTS, 2)])
            await write_history(running, [attempt_history(i, groups=GROUPS) for i in range(1, ROLLOUTS, 2)], batch=4)
            producer = make_producer(running)
            await producer.start()
            try:
                await producer.send_and_wait(running.topic("spans"), b"not a span", key=rollout_id_of(0).encode())
            finally:
                await producer.stop()

        asyncio.run(write())
        yield running
    finally:
        stack.down(settings)


def _shape(messages: list[Any]) -> list[tuple[int, int, bytes, bytes, int, tuple[Any, ...]]]:
    return sorted((m.partition, m.offset, m.key, m.value, m.timestamp, tuple(m.headers or ())) for m in messages)


async def test_replays_are_identical_idempotent_and_report_bad_spans(history: Settings) -> None:
    first = await replay(history, "one", workers=1)
    # The second run reads its partitions in worker processes: the output must not change.
    assert len([lo for lo, hi in first.ranges.values() if hi > lo]) > 1
    second = await replay(history, "two", workers=2)
    assert first.records == second.records == ROLLOUTS
    assert first.digest == second.digest and len(first.digest) == 64
    assert (first.spans, first.attempts) == (second.spans, second.attempts) == (ROLLOUTS * 10, ROLLOUTS)
    for run in (first, second):
        assert run.malformed_spans.count == 1 and "not the Avro single-object marker" in run.malformed_spans.reasons[0]
    one = await read_topic(history, first.topic, ROLLOUTS)
    two = await read_topic(history, second.topic, ROLLOUTS)
    assert _shape(one) == _shape(two)  # byte-identical, same partitions, offsets, timestamps, headers

    codec = Codec.default()
    records = {r.rollout_id: r for r in (codec.decode(m.value, TripletRecord) for m in one)}
    for i in range(ROLLOUTS):
        made = attempt_history(i, groups=GROUPS)
        record = records[rollout_id_of(i)]
        assert len(record.triplets) == 8 and record.final_reward == pytest.approx(made.reward)
        assert record.group_id == f"grp-{i % GROUPS:06d}"
        assert [t.response_token_ids for t in record.triplets] == [
            s["attributes"]["response_token_ids"] for s in made.spans[:8]
        ]

    again = await replay(history, "one")
    assert (again.digest, again.written, again.already_present) == (first.digest, 0, ROLLOUTS)
    ends = await end_offsets(history, first.topic)
    assert sum(ends.values()) == ROLLOUTS  # nothing appended


async def test_an_offset_range_selects_only_its_attempts(history: Settings) -> None:
    spans_ends = await end_offsets(history, history.topic("spans"))
    [p0] = [tp for tp in spans_ends if tp.partition == 0]
    end = spans_ends[p0]
    whole = await replay(history, "p0", selection=Selection(offsets={0: (None, None)}))
    in_p0 = {rollout_id_of(i) for i in range(ROLLOUTS) if _partition_of(history, rollout_id_of(i)) == 0}
    records = await read_topic(history, whole.topic, whole.records)
    assert {Codec.default().decode(m.value, TripletRecord).rollout_id for m in records} == in_p0
    # Cut through the middle of an attempt: its record would be partial, so it is skipped and counted.
    half = await replay(history, "half", selection=Selection(offsets={0: (0, end // 2 + 3)}))
    assert half.incomplete_skipped >= 1 and half.records < whole.records
    # A different range into the same topic appends (only attempts not already there).
    rest = await replay(history, "half", selection=Selection(offsets={0: (end // 2 + 3, None)}))
    assert rest.written == rest.records > 0


def _partition_of(settings: Settings, rollout_id: str) -> int:
    from aiokafka.partitioner import DefaultPartitioner

    return int(DefaultPartitioner()(rollout_id.encode(), [0, 1, 2, 3], [0, 1, 2, 3]))


async def test_a_new_reward_replaces_the_final_reward_and_failures_are_reported(history: Settings) -> None:
    constant = await replay(history, "const", replay_settings=ReplaySettings(reward=f"{__name__}:constant_reward"))
    records = [Codec.default().decode(m.value, TripletRecord) for m in await read_topic(history, constant.topic, 24)]
    assert {r.final_reward for r in records} == {0.25}
    picky = await replay(history, "picky", replay_settings=ReplaySettings(reward=f"{__name__}:picky_reward"))
    assert picky.reward_errors.count == 1 and "no reward for rollout 3" in picky.reward_errors.reasons[0]
    assert picky.records == ROLLOUTS - 1
    by_id = {
        r.rollout_id: r
        for r in (Codec.default().decode(m.value, TripletRecord) for m in await read_topic(history, picky.topic, 23))
    }
    assert by_id[rollout_id_of(4)].final_reward is None
    assert by_id[rollout_id_of(5)].final_reward == 10.0  # its spans: 8 calls, a reward, the agent


async def test_sql_selection_through_the_cli_and_the_batcher_consumes_the_replay(history: Settings) -> None:
    wanted = [rollout_id_of(i) for i in range(0, ROLLOUTS, GROUPS)]  # one group's 4 rollouts
    env = role_environment(history)
    db = history.clickhouse_database
    # otel_traces: the replay fences the spans topic before it queries, so the rows are there.
    query = f"SELECT DISTINCT RolloutId FROM {db}.otel_traces WHERE RolloutId IN ('" + "','".join(wanted) + "')"
    done = subprocess.run(  # noqa: ASYNC221 - the CLI as a user runs it; nothing else runs meanwhile
        [sys.executable, "-m", "agl_stream", "replay", "sel", "--sql", query],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "records        4 (4 written" in done.stdout, done.stdout
    topic = f"{history.topic_prefix}.triplets.replay.sel"
    records = [Codec.default().decode(m.value, TripletRecord) for m in await read_topic(history, topic, 4)]
    assert sorted(r.rollout_id for r in records) == sorted(wanted)

    batcher = start_role(
        history, "batcher", "--input-topic", topic, "--output-topic", batches_topic_of(history.topic_prefix, "sel"),
        "--group-size", "4", "--max-rollouts", "4", "--linger", "1", log_name="replay-batcher",
    )  # fmt: skip
    try:
        [message] = await read_topic(history, batches_topic_of(history.topic_prefix, "sel"), 1, timeout=60)
        batch = Codec.default().decode(message.value, TripletBatch)
        assert sorted(r.rollout_id for r in batch.records) == sorted(wanted)
    finally:
        stop_role(batcher, timeout=30)
