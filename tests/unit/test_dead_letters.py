"""The pure side of `agl-stream dlq` (agl_stream/domain/dead_letters.py): names, selection,
counting, decoding and what a resubmission may send."""

from __future__ import annotations

import hashlib
from datetime import datetime, timezone

import pytest

from agl_stream.domain.dead_letters import (
    RESUBMITTED_HEADER,
    DeadLetter,
    DlqInputError,
    NotResubmittableError,
    Selection,
    count,
    decode_original,
    escaped,
    full_topic,
    hexdump,
    newest_first,
    parse_id,
    parse_since,
    plan_resubmission,
    summary,
)
from agl_stream.kafka.io import DLQ_KEY_HEAD, DLQ_VALUE_HEAD, Rejected, dead_letter
from agl_stream.models import TaskRequest, Worker
from agl_stream.wire.codec import Codec

CODEC = Codec.default()
PARTITIONS = {"agl.task-requests": 4, "agl.spans": 4, "agl.dlq": 4}


def _letter(
    value: bytes,
    *,
    topic: str = "agl.task-requests",
    partition: int = 1,
    offset: int = 7,
    key: bytes | None = b"req-1",
    error: Exception | None = None,
    processor: str = "processor.ingress",
    at: tuple[int, int] = (0, 0),
    when: float | None = None,
) -> DeadLetter:
    record = dead_letter(Rejected(topic, partition, offset, key, value, error or ValueError("bad")), processor)
    if when is not None:
        record = record.model_copy(update={"time": when})
    return DeadLetter(at[0], at[1], int(record.time * 1000), record)


def test_names_round_trip_and_bad_ones_say_what_to_give() -> None:
    letter = _letter(b"x", at=(3, 41))
    assert letter.id == "3:41" and parse_id(letter.id) == (3, 41)
    for bad in ("3", "a:1", "1:-2", ":", "1:2:3"):
        with pytest.raises(DlqInputError, match="<partition>:<offset>"):
            parse_id(bad)


def test_since_takes_durations_dates_and_epoch_seconds() -> None:
    now = 1_000_000.0
    assert parse_since("30m", now) == now - 1800
    assert parse_since("2h", now) == now - 7200
    assert parse_since("1.5d", now) == now - 1.5 * 86400
    assert parse_since("123.5", now) == 123.5
    assert parse_since("2025-01-31T12:00", now) == datetime(2025, 1, 31, 12, tzinfo=timezone.utc).timestamp()
    assert parse_since("2025-01-31T12:00+02:00", now) == datetime(2025, 1, 31, 10, tzinfo=timezone.utc).timestamp()
    with pytest.raises(DlqInputError, match="a duration ago"):
        parse_since("yesterday", now)


def test_selection_and_newest_first() -> None:
    a = _letter(b"a", error=ValueError("Names No Snapshot rs-1"), when=100.0, at=(0, 1))
    b = _letter(b"b", topic="agl.spans", processor="sink.clickhouse-spans", when=300.0, at=(2, 0))
    c = _letter(b"c", error=KeyError("other"), when=200.0, at=(0, 2))
    letters = [a, b, c]
    assert newest_first(letters) == [b, c, a] and newest_first(letters, 2) == [b, c]
    assert [d for d in letters if Selection(source_topic="agl.spans").matches(d)] == [b]
    assert [d for d in letters if Selection(reason="names no SNAPSHOT").matches(d)] == [a]
    assert [d for d in letters if Selection(reason="keyerror").matches(d)] == [c]  # the error type too
    assert [d for d in letters if Selection(since=200.0).matches(d)] == [b, c]
    assert [d for d in letters if Selection(processor="processor.ingress", since=150.0).matches(d)] == [c]
    assert full_topic("spans", "agl") == "agl.spans" == full_topic("agl.spans", "agl")
    assert full_topic("other.spans", "agl") == "other.spans"


def test_count_groups_most_first_with_the_newest_of_each() -> None:
    letters = [
        _letter(b"1", error=ValueError("one"), when=10.0, at=(0, 0)),
        _letter(b"2", error=ValueError("two"), when=30.0, at=(0, 1)),
        _letter(b"3", error=KeyError("k"), when=20.0, at=(0, 2)),
        _letter(b"4", topic="agl.spans", error=ValueError("s"), when=5.0, at=(1, 0)),
    ]
    rows = count(letters, ["source_topic", "error_type"])
    assert [(r.group, r.count) for r in rows] == [
        (("agl.task-requests", "ValueError"), 2),
        (("agl.spans", "ValueError"), 1),
        (("agl.task-requests", "KeyError"), 1),
    ]
    first = rows[0]
    assert (first.first_time, first.last_time, first.newest_id, first.newest_reason) == (10.0, 30.0, "0:1", "two")
    with pytest.raises(DlqInputError, match="choose from"):
        count(letters, ["colour"])


def test_decode_the_original_with_its_topics_schema_or_say_why_not() -> None:
    request = TaskRequest(request_id="req-1", input={"q": 1})
    decoded = decode_original(_letter(CODEC.encode(request)), CODEC, ["agl.TaskRequest"])
    assert decoded.record_name == "agl.TaskRequest" and decoded.problem is None
    assert decoded.value["request_id"] == "req-1" and decoded.value["input"] == {"q": 1}
    other = decode_original(_letter(CODEC.encode(Worker(worker_id="w"))), CODEC, ["agl.TaskRequest"])
    assert other.record_name == "agl.Worker" and "carries agl.TaskRequest" in (other.problem or "")
    garbage = decode_original(_letter(b"not avro at all"), CODEC, ["agl.TaskRequest"])
    assert garbage.record_name is None and "single-object marker" in (garbage.problem or "")
    big = CODEC.encode(TaskRequest(request_id="big", input={"blob": "x" * (DLQ_VALUE_HEAD + 10)}))
    cut = decode_original(_letter(big), CODEC)
    assert cut.record_name is None and f"only the first {DLQ_VALUE_HEAD:,} of {len(big):,} bytes" in (cut.problem or "")


def test_bytes_are_shown_as_hex_and_escaped_text() -> None:
    data = b"\x00ab\\\xff" + b"z" * 20
    lines = hexdump(data)
    assert lines[0] == "00000000  00 61 62 5c ff 7a 7a 7a 7a 7a 7a 7a 7a 7a 7a 7a  |.ab\\.zzzzzzzzzzz|"
    assert len(lines) == 2 and lines[1].startswith("00000010  7a")
    assert len(hexdump(data, limit=4)) == 1 and "5c ff" not in hexdump(data, limit=3)[0]
    assert escaped(data, 6) == "\\x00ab\\\\\\xffz..."
    assert escaped(b"ok") == "ok"


def test_summary_has_the_facts_without_the_bytes() -> None:
    letter = _letter(b"abc", when=0.0, at=(1, 2))
    facts = summary(letter)
    assert facts["id"] == "1:2" and facts["time_iso"] == "1970-01-01T00:00:00+00:00"
    assert (facts["value_size"], facts["value_kept"], facts["key"]) == (3, 3, "req-1")
    assert facts["value_sha256"] == hashlib.sha256(b"abc").hexdigest() and "value" not in facts


def test_a_resubmission_sends_the_original_back_where_it_was_read() -> None:
    letter = _letter(b"payload", partition=3, at=(2, 9))
    plan = plan_resubmission(letter, "agl.dlq", PARTITIONS, key_limit=DLQ_KEY_HEAD)
    assert (plan.topic, plan.partition, plan.key, plan.value) == ("agl.task-requests", 3, b"req-1", b"payload")
    assert plan.headers == ((RESUBMITTED_HEADER, b"agl.dlq:2:9"),)
    # The topic has fewer partitions now: by key.
    gone = _letter(b"payload", partition=9)
    assert plan_resubmission(gone, "agl.dlq", PARTITIONS, key_limit=DLQ_KEY_HEAD).partition is None


@pytest.mark.parametrize(
    ("letter", "why"),
    [
        (_letter(b"v", topic="other.task-requests"), "not one of this stack's topics"),
        (_letter(b"v", topic="agl.replies.c1"), "not one of this stack's topics"),
        (_letter(b"v", topic="agl.dlq"), "rejected on agl.dlq itself"),
        (_letter(b""), "holds no value"),
        (_letter(b"x" * (DLQ_VALUE_HEAD + 1)), f"only the first {DLQ_VALUE_HEAD:,} of {DLQ_VALUE_HEAD + 1:,} bytes"),
        (_letter(b"v", key=b"k" * DLQ_KEY_HEAD), "may have been cut"),
    ],
)
def test_what_is_never_resubmitted(letter: DeadLetter, why: str) -> None:
    with pytest.raises(NotResubmittableError, match=why):
        plan_resubmission(letter, "agl.dlq", PARTITIONS, key_limit=DLQ_KEY_HEAD)


def test_bytes_that_do_not_match_their_digest_are_not_sent() -> None:
    letter = _letter(b"payload")
    tampered = DeadLetter(0, 0, 0, letter.record.model_copy(update={"value": b"pAyload"}))
    with pytest.raises(NotResubmittableError, match="do not match the SHA-256"):
        plan_resubmission(tampered, "agl.dlq", PARTITIONS, key_limit=DLQ_KEY_HEAD)


def test_the_dashboards_dead_letter_queries_bind_what_the_visitor_typed() -> None:
    from pydantic import ValidationError

    from consumers import dashboard_sql as dsql

    hostile = "agl.spans' OR 1=1 --"
    queries = dsql.dead_letters("agl", dsql.DeadLetterFilter(source_topic=hostile, limit=5))
    assert set(queries) == {"counts", "newest", "total"}
    for query in queries.values():
        assert hostile not in query.sql and query.parameters["source_topic"] == hostile
        assert "{source_topic:String}" in query.sql and "FROM agl.dead_letters FINAL" in query.sql
    assert queries["newest"].parameters["limit"] == 5
    everything = dsql.dead_letters("agl", dsql.DeadLetterFilter.model_validate({"source_topic": " "}))
    assert all("WHERE" not in q.sql and "source_topic" not in q.parameters for q in everything.values())
    for bad in ({"limit": "0"}, {"limit": "x"}, {"colour": "red"}):
        with pytest.raises(ValidationError):
            dsql.DeadLetterFilter.model_validate(bad)
