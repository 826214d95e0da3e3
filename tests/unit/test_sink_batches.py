"""The sink's pure batch rules."""

from __future__ import annotations

from agl_stream.kafka.io import Fetched
from consumers.clickhouse_sink import newest_per_key
from consumers.sink_specs import ROLLOUT_STATE, SPANS


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
