"""Token ids read from a record keep their varints (TokenIds): the adapter takes them without
checking each id, the triplet encoder writes the varints as they came; and the encoder's JSON
writer. Both must give exactly the codec's bytes."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agl_stream.domain.adapter import AdapterConfig
from agl_stream.domain.adapter.lean import TokenIds, token_ids
from agl_stream.domain.adapter.span_decoder import SpanRecordDecoder
from agl_stream.domain.adapter.triplet_encoder import TripletRecordEncoder
from agl_stream.domain.trace_collector import FinishedAttempt, triplet_record
from agl_stream.errors import CodecError
from agl_stream.models import Attempt, Rollout, Span, TripletRecord
from agl_stream.wire.avro_primitives import zigzag
from agl_stream.wire.codec import Codec, dump_json
from agl_stream.wire.span_records import span_dict_records
from tests.replay_history import attempt_history

CODEC = Codec.default()


def _read_ids(decoder: SpanRecordDecoder, ids: list[Any]) -> list[Any]:
    span = attempt_history(1).spans[0]
    value = CODEC.encode_dict("agl.Span", {**span, "attributes": {**span["attributes"], "prompt_token_ids": ids}})
    [lean] = decoder.decode(value)
    read: list[Any] = lean.attributes["prompt_token_ids"]
    return read


def test_token_ids_is_a_list_of_the_ids_with_their_varints() -> None:
    made = token_ids(iter([3, 200]), b"\x06\x90\x03")
    assert isinstance(made, list) and made == [3, 200] and made.varints == b"\x06\x90\x03"


@pytest.mark.parametrize("width", [64, 8192, 151_936, 1 << 40])
def test_non_negative_ids_read_from_a_record_carry_the_varints_fastavro_writes(width: int) -> None:
    decoder = SpanRecordDecoder(CODEC)
    ids = [(i * 7919 + 1) % width or 1 for i in range(80)]  # no 0: its varint is the separator byte
    kinds = set()
    for _ in range(2):  # the varint memo cold, then warm
        read = _read_ids(decoder, ids)
        assert read == ids and all(type(v) is int for v in read)
        kinds.add(type(read))
        if type(read) is TokenIds:
            assert read.varints == b"".join(map(zigzag, ids))
    assert TokenIds in kinds  # the warm memo reads them on the fast path


@pytest.mark.parametrize("ids", [[5, -1, 7], [-(2**63), 3], [1, None, 2], [1, True, 2], [2.5]])
def test_arrays_with_a_negative_or_a_non_integer_are_plain_lists(ids: list[Any]) -> None:
    decoder = SpanRecordDecoder(CODEC)
    for _ in range(2):
        read = _read_ids(decoder, ids)
        assert type(read) is list and read == ids


@pytest.mark.parametrize("ids", [[0, 4, 0], [0, 300, 0], [63, 64, 2**63 - 1]])
def test_zeros_and_the_widest_ids_read_as_fastavro_writes_them(ids: list[int]) -> None:
    decoder = SpanRecordDecoder(CODEC)
    for _ in range(2):
        read = _read_ids(decoder, ids)
        assert read == ids
        if type(read) is TokenIds:
            assert read.varints == b"".join(map(zigzag, ids))


def _records(vocab: int, config: AdapterConfig) -> tuple[list[TripletRecord], list[TripletRecord]]:
    """The records of some attempts from spans read from bytes, and from validated models."""
    decoder = SpanRecordDecoder(CODEC)
    from_bytes, from_models = [], []
    for index in range(6):
        history = attempt_history(index, vocab=vocab)
        rollout = Rollout(rollout_id=history.rollout_id, input={"task": index}, start_time=1.0, status="succeeded")
        attempt = Attempt(rollout_id=history.rollout_id, attempt_id=f"at-{index}", sequence_id=1, start_time=1.0)
        finished = FinishedAttempt(rollout, attempt, len(history.spans), 2.0)
        values = [value for _, value in span_dict_records(history.spans, CODEC)]
        for value in values:  # a first read teaches the varint memo (wide ids are new at first)
            decoder.decode(value)
        lean = [s for value in values for s in decoder.decode(value)]
        models = [Span.model_validate(d) for d in history.spans]
        from_bytes.append(triplet_record(finished, lean, config, None)[0])
        from_models.append(triplet_record(finished, models, config, None)[0])
    return from_bytes, from_models


@pytest.mark.parametrize("vocab", [64, 151_936])
@pytest.mark.parametrize(
    "config", [AdapterConfig(), AdapterConfig(aggregation="trajectory", final_reward_to_last=True)], ids=str
)
def test_records_of_spans_read_from_bytes_are_written_as_the_codec_writes_them(
    vocab: int, config: AdapterConfig
) -> None:
    encoder = TripletRecordEncoder(CODEC)
    from_bytes, from_models = _records(vocab, config)
    assert from_bytes == from_models
    if config.aggregation == "transition":  # merged samples are new lists
        assert any(type(t.prompt_token_ids) is TokenIds for r in from_bytes for t in r.triplets)
    for record, model_record in zip(from_bytes, from_models, strict=True):
        assert encoder.encode(record) == CODEC.encode(record) == encoder.encode(model_record)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(_JSON)
def test_the_codecs_json_is_the_standard_librarys(value: Any) -> None:
    """dump_json's one prebuilt C encoder writes what json.dumps writes with the same options."""
    try:
        expected: str | type[Exception] = json.dumps(
            value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
    except ValueError as error:  # NaN, infinities
        expected = type(error)
    try:
        got: str | type[Exception] = dump_json(value)
    except ValueError as error:
        got = type(error)
    assert got == expected


def test_a_cycle_in_metadata_is_the_codecs_error() -> None:
    record = _records(64, AdapterConfig())[0][0]
    cyclic: dict[str, Any] = {"a": 1}
    cyclic["self"] = cyclic
    triplet = record.triplets[0].model_copy(update={"metadata": cyclic})
    bad = record.model_copy(update={"triplets": [triplet]})
    with pytest.raises(CodecError, match="nested too deeply or holds itself") as expected:
        CODEC.encode(bad)
    with pytest.raises(CodecError) as got:
        TripletRecordEncoder(CODEC).encode(bad)
    assert str(got.value) == str(expected.value)
