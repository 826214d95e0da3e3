"""The sink's pure batch rules, and how sinks sharing a consumer get their records (no Kafka)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import pytest
from aiokafka import TopicPartition

from agl_stream.config import Settings
from agl_stream.kafka.io import Fetched
from consumers.clickhouse_sink import TableSink, _SinkSet, newest_per_key
from consumers.sink_specs import RESOURCES, ROLLOUT_STATE, SPANS, WORKERS


def _record(partition: int, offset: int, key: bytes | None) -> Fetched[bytes]:
    return Fetched("t", partition, offset, key, b"", b"", 0)


def test_only_the_newest_record_of_a_key_in_a_batch_makes_a_row() -> None:
    batch = [
        _record(0, 1, b"ro-a"),
        _record(0, 2, b"ro-b"),
        _record(1, 3, b"ro-a"),  # another partition: another key as far as rows go
        _record(0, 4, b"ro-a"),
        _record(0, 5, None),
        _record(0, 6, None),
    ]
    kept = newest_per_key(batch)
    assert [(r.partition, r.offset) for r in kept] == [(0, 2), (1, 3), (0, 4), (0, 5), (0, 6)]


def test_state_topics_keep_the_newest_per_key_and_spans_keep_everything() -> None:
    assert ROLLOUT_STATE.latest_per_key and not SPANS.latest_per_key


def test_the_busy_sinks_linger_the_configured_time_and_the_others_their_own() -> None:
    settings = Settings(sink_linger_ms=1234)
    client = cast(Any, None)  # not used to construct a sink
    for spec in (SPANS, ROLLOUT_STATE, WORKERS):
        assert TableSink(settings, client, spec).flush_ms == 1234
    assert TableSink(settings, client, RESOURCES).flush_ms == RESOURCES.flush_ms == 0
    assert TableSink(settings, client, SPANS, flush_ms=50).flush_ms == 50  # the sink role's --flush-ms
    with pytest.raises(ValueError, match="sink_linger_ms"):
        Settings(sink_linger_ms=-1)


class _Sink:
    """Stands in for a TableSink in the dispatch: records each call's records per partition."""

    def __init__(self, topic: str, batch_size: int, fail: bool = False, turns: int = 1) -> None:
        self.topic, self.batch_size, self.fail, self.turns = topic, batch_size, fail, turns
        self.calls: list[dict[int, list[int]]] = []
        self.buffer_next: dict[TopicPartition, int] = {}
        self.ticks = 0
        self.wanted = None

    async def handle(self, batch: dict[TopicPartition, list[Any]]) -> None:
        for _ in range(self.turns):
            await asyncio.sleep(0)  # another sink's call runs meanwhile
        self.calls.append({tp.partition: [r.offset for r in records] for tp, records in batch.items()})
        if self.fail:
            raise RuntimeError(f"{self.topic} failed")

    async def tick(self) -> None:
        self.ticks += 1


def _fetched(topic: str, partition: int, offsets: range) -> tuple[TopicPartition, list[Any]]:
    return TopicPartition(topic, partition), [SimpleNamespace(offset=o) for o in offsets]


def test_shared_consumer_hands_each_sink_its_topic_and_fetches_at_most_the_smallest_batch() -> None:
    states, training = _Sink("states", batch_size=4), _Sink("training", batch_size=100)
    sinks = _SinkSet(cast(Any, [states, training]))
    # No sink gets more in one call than it inserts at once: a fetch is the smallest batch.
    assert sinks.fetch_limit == 4
    batch = dict(
        [
            _fetched("states", 0, range(0, 2)),
            _fetched("training", 2, range(10, 12)),
            _fetched("states", 1, range(20, 22)),
        ]
    )
    asyncio.run(sinks.handle(batch))
    assert states.calls == [{0: [0, 1], 1: [20, 21]}]
    assert training.calls == [{2: [10, 11]}]


def test_a_failing_sink_fails_the_fetch_only_after_the_others_finished() -> None:
    bad, good = _Sink("bad", batch_size=10, fail=True), _Sink("good", batch_size=10, turns=10)
    sinks = _SinkSet(cast(Any, [bad, good]))
    with pytest.raises(RuntimeError, match="bad failed"):
        asyncio.run(sinks.handle(dict([_fetched("bad", 0, range(2)), _fetched("good", 0, range(3))])))
    assert good.calls == [{0: [0, 1, 2]}]


def test_only_sinks_holding_a_batch_are_ticked() -> None:
    idle, lingering = _Sink("idle", batch_size=10), _Sink("lingering", batch_size=10)
    lingering.buffer_next = {TopicPartition("lingering", 0): 5}
    asyncio.run(_SinkSet(cast(Any, [idle, lingering])).tick())
    assert (idle.ticks, lingering.ticks) == (0, 1)


def test_two_sinks_of_one_topic_cannot_share_a_consumer() -> None:
    with pytest.raises(ValueError, match="one topic"):
        _SinkSet(cast(Any, [_Sink("t", 1), _Sink("t", 2)]))
