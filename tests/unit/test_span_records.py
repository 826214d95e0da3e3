"""agl.spans records: batches per attempt under a byte limit, both forms read back, and the
sink's byte-level turning of a single span into a one-span batch."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agl_stream.errors import CodecError, MalformedRecordError, RecordTypeError
from agl_stream.models import Span, SpanBatch, Worker
from agl_stream.wire.codec import HEADER_SIZE, Codec
from agl_stream.wire.span_avro import WRITTEN_FOR, span_body
from agl_stream.wire.span_records import (
    MAX_RECORD_BYTES,
    SPAN,
    SPAN_BATCH,
    batch_body_of_span,
    span_dict_records,
    span_dicts_of,
    span_records,
    spans_of,
)
from consumers.clickhouse_sink import EnvelopeBody
from consumers.sink_specs import SPANS
from tests.unit.test_codec import span_dict
from tests.unit.test_models import model_strategy

CODEC = Codec.default()


def sp(rollout: int, attempt: int, seq: int, text: str = "") -> dict[str, Any]:
    """A span in the codec's dict form, ``text`` making it as large as wanted."""
    return span_dict(
        rollout_id=f"ro-{rollout:012x}",
        attempt_id=f"at-{attempt:08x}",
        sequence_id=seq,
        span_id=f"{rollout:04x}{attempt:04x}{seq:08x}",
        name=f"s{text}",
    )


def decoded(records: list[tuple[str, bytes]]) -> list[tuple[str, str, str, list[int]]]:
    """(key, rollout, attempt, sequence ids) of each record, decoded by the codec."""
    out = []
    for key, value in records:
        name, batch = CODEC.decode_dict(value)
        assert name == SPAN_BATCH
        out.append((key, batch["rollout_id"], batch["attempt_id"], [s["sequence_id"] for s in batch["spans"]]))
    return out


# -- writing ----------------------------------------------------------------------------------


def test_one_record_per_attempt_keyed_by_rollout_in_first_appearance_order() -> None:
    spans = [sp(1, 1, 1), sp(2, 2, 1), sp(1, 1, 2), sp(1, 3, 1), sp(2, 2, 2), sp(1, 1, 3)]
    assert decoded(span_dict_records(spans, CODEC)) == [
        ("ro-000000000001", "ro-000000000001", "at-00000001", [1, 2, 3]),
        ("ro-000000000002", "ro-000000000002", "at-00000002", [1, 2]),
        ("ro-000000000001", "ro-000000000001", "at-00000003", [1]),
    ]


def test_a_record_is_byte_for_byte_the_encoded_span_batch() -> None:
    spans = [Span.model_validate(sp(1, 1, seq)) for seq in (1, 2, 3)]
    [(key, value)] = span_records(spans, CODEC)
    batch = SpanBatch(rollout_id=spans[0].rollout_id, attempt_id=spans[0].attempt_id, spans=spans)
    assert key == spans[0].rollout_id
    assert value == CODEC.encode(batch)
    assert CODEC.decode(value, SpanBatch) == batch  # every field, types kept


def test_the_given_order_is_kept_within_an_attempt() -> None:
    spans = [sp(1, 1, seq) for seq in (3, 1, 2)]
    assert decoded(span_dict_records(spans, CODEC))[0][3] == [3, 1, 2]


def test_nothing_to_send_is_no_record() -> None:
    assert span_records([], CODEC) == []


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=40),
    attempts=st.lists(st.integers(1, 3), min_size=40, max_size=40),
    limit=st.integers(1500, 12_000),
)
def test_records_stay_under_the_limit_and_split_only_where_the_next_span_would_not_fit(
    sizes: list[int], attempts: list[int], limit: int
) -> None:
    spans = [sp(1, attempts[i], i + 1, "x" * size) for i, size in enumerate(sizes)]
    records = span_dict_records(spans, CODEC, max_bytes=limit)
    alone = {s["sequence_id"]: len(CODEC.encode_dict(SPAN, s)) for s in spans}
    by_attempt: dict[str, list[int]] = {}
    for (_, _, attempt, seqs), (_, value) in zip(decoded(records), records, strict=True):
        assert value == CODEC.encode_dict(SPAN_BATCH, CODEC.decode_dict(value)[1])  # a valid, canonical record
        assert len(value) <= limit or len(seqs) == 1  # only a span too large for any record passes
        by_attempt.setdefault(attempt, []).append(len(seqs))
    for attempt in {s["attempt_id"] for s in spans}:
        mine = [s["sequence_id"] for s in spans if s["attempt_id"] == attempt]
        got = [seq for _, _, a, seqs in decoded(records) if a == attempt for seq in seqs]
        assert got == mine  # every span once, in order, consecutive records
    # Greedy: a record ended because the next span would have pushed it over the limit.
    flat = decoded(records)
    for (current, record), following in zip(zip(flat, records, strict=True), flat[1:], strict=False):
        if current[2] == following[2]:
            assert len(record[1]) + alone[following[3][0]] - HEADER_SIZE > limit - 10


def test_a_span_larger_than_the_limit_is_a_record_of_its_own() -> None:
    big = sp(1, 1, 2, "x" * 5000)
    records = span_dict_records([sp(1, 1, 1), big, sp(1, 1, 3)], CODEC, max_bytes=2000)
    assert [seqs for *_, seqs in decoded(records)] == [[1], [2], [3]]
    assert len(records[1][1]) > 2000


def test_the_default_limit_fits_kafkas_default_message_size() -> None:
    assert MAX_RECORD_BYTES < 1_048_588  # the broker's default max.message.bytes
    spans = [sp(1, 1, seq, "x" * 20_000) for seq in range(1, 201)]  # ~4 MB of spans
    records = span_dict_records(spans, CODEC)
    assert len(records) == 5 and all(len(value) <= MAX_RECORD_BYTES for _, value in records)


# -- reading both forms -----------------------------------------------------------------------


def test_readers_take_single_spans_and_batches_alike() -> None:
    spans = [sp(1, 1, seq) for seq in (1, 2)]
    single = CODEC.encode_dict(SPAN, spans[0])
    [(_, batch)] = span_dict_records(spans, CODEC)
    assert span_dicts_of(CODEC, single) == [CODEC.decode_dict(single)[1]]
    assert [s["sequence_id"] for s in span_dicts_of(CODEC, batch)] == [1, 2]
    assert spans_of(CODEC, batch) == [Span.model_validate(s) for s in spans]
    assert spans_of(CODEC, single) == [Span.model_validate(spans[0])]


def test_other_records_and_garbage_are_codec_errors() -> None:
    with pytest.raises(RecordTypeError, match=r"agl\.Span or an agl\.SpanBatch, got a agl\.Worker"):
        span_dicts_of(CODEC, CODEC.encode(Worker(worker_id="w")))
    with pytest.raises(CodecError):
        spans_of(CODEC, b"not a span")
    [(_, batch)] = span_dict_records([sp(1, 1, 1), sp(1, 1, 2)], CODEC)
    with pytest.raises(MalformedRecordError):
        span_dicts_of(CODEC, batch[:-5])


def test_a_batch_with_one_invalid_span_is_bad_as_a_whole() -> None:
    bad = sp(1, 1, 2)
    bad["trace_id"] = ""  # Avro-valid, refused by the model
    [(_, value)] = span_dict_records([sp(1, 1, 1), bad], CODEC)
    assert len(span_dicts_of(CODEC, value)) == 2
    with pytest.raises(MalformedRecordError, match="does not validate"):
        spans_of(CODEC, value)


# -- the sink's bytes -------------------------------------------------------------------------


def test_the_schemas_allow_a_span_body_to_become_a_batch_body_by_bytes() -> None:
    """batch_body_of_span relies on this layout: both start with the two id strings."""
    span_fields = CODEC.contract.schema(SPAN).expanded["fields"]
    batch_fields = CODEC.contract.schema(SPAN_BATCH).expanded["fields"]
    assert [(f["name"], f["type"]) for f in span_fields[:2]] == [("rollout_id", "string"), ("attempt_id", "string")]
    assert [(f["name"], f["type"]) for f in batch_fields[:2]] == [("rollout_id", "string"), ("attempt_id", "string")]
    assert batch_fields[2]["name"] == "spans" and batch_fields[2]["type"]["items"]["name"] == "Span"
    assert len(batch_fields) == 3


@pytest.mark.parametrize("rollout_id", ["ro-000000000001", "", "r" * 200, "ro-ünïcode"])
def test_a_single_spans_body_becomes_the_body_of_its_one_span_batch(rollout_id: str) -> None:
    span = span_dict(rollout_id=rollout_id)
    body = CODEC.encode_dict(SPAN, span)[HEADER_SIZE:]
    [(_, batch)] = span_dict_records([span], CODEC)
    assert batch_body_of_span(body) == batch[HEADER_SIZE:]
    assert batch_body_of_span(memoryview(body)) == batch[HEADER_SIZE:]


@pytest.mark.parametrize("body", [b"", b"\x80", b"\x10abc", b"\x02a\x7f", b"\x01"])
def test_a_body_too_short_for_the_ids_is_malformed(body: bytes) -> None:
    with pytest.raises(MalformedRecordError):
        batch_body_of_span(body)


def test_the_span_sink_hands_clickhouse_batch_bodies_for_both_forms() -> None:
    bodies = EnvelopeBody(CODEC, SPANS.record, also=SPANS.also)
    [(_, batch)] = span_dict_records([sp(1, 1, 1), sp(1, 1, 2)], CODEC)
    single = CODEC.encode_dict(SPAN, sp(1, 1, 3))
    [(_, one)] = span_dict_records([sp(1, 1, 3)], CODEC)
    batch_body, single_body = bodies(batch), bodies(single)
    assert batch_body is not None and single_body is not None  # None is a skipped tombstone
    assert bytes(batch_body) == batch[HEADER_SIZE:]  # the current schema: a slice
    assert bytes(single_body) == one[HEADER_SIZE:]  # a single span: a one-span batch
    bodies.check(batch)
    bodies.check(single)
    for wrong in (CODEC.encode(Worker(worker_id="w")), b"garbage!!!!", b""):
        with pytest.raises(CodecError):
            bodies(wrong)
        with pytest.raises(CodecError):
            bodies.check(wrong)
    with pytest.raises(RecordTypeError, match=r"agl\.SpanBatch or agl\.Span"):
        bodies(CODEC.encode(Worker(worker_id="w")))


# -- the hand-written Span writer: fastavro's bytes, or fastavro decides ----------------------


def _fastavro_body(span: Span | dict[str, Any]) -> bytes | None:
    """What the codec (fastavro) writes for ``span``; None where it refuses it."""
    datum = span.model_dump() if isinstance(span, Span) else span
    try:
        return CODEC.encode_dict(SPAN, datum)[HEADER_SIZE:]
    except CodecError:
        return None


def test_the_writer_is_for_the_current_span_schema() -> None:
    assert CODEC.fingerprint(SPAN) == WRITTEN_FOR, (
        "agl.Span changed: write its new layout in agl_stream/wire/span_avro.py and set WRITTEN_FOR to "
        f"{CODEC.fingerprint(SPAN):#018x} (until then every span is written by fastavro, slowly)"
    )


@settings(max_examples=300, deadline=None)
@given(span=model_strategy(Span))
def test_the_writer_writes_fastavros_bytes_for_any_valid_span(span: Span) -> None:
    want = _fastavro_body(span)
    assert span_body(span) == want  # None (fastavro's to refuse) only where fastavro refuses it
    assert span_body(span.model_dump()) == want  # the dict form alike
    if want is not None:
        [(_, record)] = span_records([span], CODEC)
        assert record == CODEC.encode(SpanBatch(rollout_id=span.rollout_id, attempt_id=span.attempt_id, spans=[span]))


def test_representative_spans_give_the_old_paths_bytes() -> None:
    """Events, links, trace state, resource, status, parent, every attribute type and lists of
    them: the records are what the old path (model_dump, then fastavro per span) gave."""
    rich = span_dict(
        attributes={
            "text": "héllo ✓",
            "long": "x" * 3000,
            "int": -(2**63),
            "max": 2**63 - 1,
            "neg": -1,
            "float": 0.1,
            "nan": float("nan"),
            "inf": float("-inf"),
            "true": True,
            "none": None,
            "ints": list(range(100, 200)),
            "floats": [0.5, -0.0],
            "strs": ["a", "", "é"],
            "bools": [True, False],
            "mixed": [True, 1, 1.0, "1", None],
            "empty": [],
        },
        events=[
            {"name": "e1", "attributes": {"k": 1, "l": [1.5]}, "timestamp": 1.5},
            {"name": "e2", "attributes": {}, "timestamp": None},
        ],
        parent_id="1" * 16,
        parent={
            "trace_id": "0af7651916cd43dd8448eb211c80319c",
            "span_id": "1" * 16,
            "is_remote": True,
            "trace_state": {},
        },
        status={"status_code": "ERROR", "description": "boom"},
        resource={"attributes": {"service.name": "agent", "n": 2, "ports": [80, 443]}, "schema_url": "https://s"},
    )
    spans = [
        Span.model_validate(rich),
        Span.model_validate(span_dict()),
        Span.model_validate(
            span_dict(sequence_id=2**40, start_time=None, end_time=None, context=None, events=[], links=[])
        ),
    ]
    for span in spans:
        assert span_body(span) is not None
        assert span_body(span) == _fastavro_body(span)
    batch = SpanBatch(rollout_id=spans[0].rollout_id, attempt_id=spans[0].attempt_id, spans=spans)
    [(_, record)] = span_records(spans, CODEC)
    assert record == CODEC.encode(batch)
    decoded_back = CODEC.decode(record, SpanBatch)
    assert [s.model_dump_json() for s in decoded_back.spans] == [s.model_dump_json() for s in spans]


class _Float(float):
    pass


class _Text(str):
    pass


@pytest.mark.filterwarnings("ignore::UserWarning")  # pydantic warns when dumping what no validation saw
@pytest.mark.parametrize(
    "change",
    [
        {"attributes": {"big": 2**64}},  # fastavro writes it as a double
        {"attributes": {"t": (1, 2)}},
        {"attributes": {"f": _Float(1.0)}},
        {"attributes": {"s": _Text("x")}},
        {"attributes": {"l": [1, _Float(2.0)]}},
        {"attributes": {"l": [2**64]}},
        {"attributes": {"d": {"nested": 1}}},
        {"attributes": {"bad": "\ud800"}},  # a lone surrogate
        {"name": _Text("n")},
        {"name": 5},
        {"sequence_id": 2**63},
        {"sequence_id": True},
        {"start_time": 5},
        {"status": {"status_code": "NOPE", "description": None}},
        {"context": {"trace_id": "1" * 32, "span_id": "2" * 16, "is_remote": 1, "trace_state": {}}},
        {"context": {"trace_id": "1" * 32, "span_id": "2" * 16}},  # fastavro fills the defaults
        {"resource": {"attributes": {}}},
    ],
)
def test_what_the_writer_declines_fastavro_writes_or_refuses_as_before(change: dict[str, Any]) -> None:
    """Values a model holds after an assignment (not validated) or a dict may hold."""
    model = Span.model_validate(span_dict())
    for name, value in change.items():
        model.__dict__[name] = value  # as an unvalidated assignment leaves it
    for span in (model, span_dict(**change)):
        assert span_body(span) is None
        want = _fastavro_body(span)
        if want is None:
            with pytest.raises(CodecError):
                _records_of(span)
        else:
            [(_, record)] = _records_of(span)
            assert record[-len(want) - 1 : -1] == want  # the batch's one span, then the array's end


def _records_of(span: Span | dict[str, Any]) -> list[tuple[str, bytes]]:
    return span_records([span], CODEC) if isinstance(span, Span) else span_dict_records([span], CODEC)


def test_dicts_missing_defaulted_fields_are_left_to_fastavro() -> None:
    span = span_dict()
    for name in ("parent_id", "kind", "status", "attributes", "events", "links", "resource", "scope_name"):
        del span[name]
    [(_, record)] = span_dict_records([span], CODEC)
    assert span_body(span) is None
    assert CODEC.decode_dict(record)[1]["spans"][0]["kind"] == "INTERNAL"
