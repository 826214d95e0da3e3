"""The adapter's wire edges: agl.spans bytes -> LeanSpans, TripletRecord -> bytes, both exactly
what the codec path gives (or the codec decides)."""

from __future__ import annotations

import math
import random
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agl_stream.domain.adapter import AdapterConfig, extract_triplets
from agl_stream.domain.adapter.lean import ADAPTER_KEYS, LeanSpan, lean_attributes, lean_span
from agl_stream.domain.adapter.span_decoder import SpanRecordDecoder, lean_of_datum
from agl_stream.domain.adapter.triplet_encoder import TripletRecordEncoder
from agl_stream.errors import CodecError
from agl_stream.models import Span, Triplet, TripletRecord
from agl_stream.wire.codec import Codec
from agl_stream.wire.span_records import span_dict_records, span_dicts_of
from tests.replay_history import attempt_history, span_values

CODEC = Codec.default()


def _reference(data: bytes) -> list[LeanSpan] | tuple[type, str]:
    """What the codec path gives: the LeanSpans of the decoded dicts, or the error."""
    try:
        return [lean_of_datum(datum) for datum in span_dicts_of(CODEC, data)]
    except CodecError as error:
        return type(error), _ADDRESS.sub("", str(error))


def _decoded(decoder: SpanRecordDecoder, data: bytes) -> list[LeanSpan] | tuple[type, str]:
    try:
        return decoder.decode(data)
    except CodecError as error:
        return type(error), _ADDRESS.sub("", str(error))


_ADDRESS = re.compile(r" at 0x[0-9a-f]+")  # fastavro's messages name its buffer object


def test_the_fast_paths_are_on_for_the_current_schemas() -> None:
    """Fails when agl.Span or agl.SpanBatch change: the decoder then reads everything through
    the codec (correct, slow) until span_decoder.py is taught the new fields."""
    assert SpanRecordDecoder(CODEC).fast
    assert TripletRecordEncoder(CODEC).fast


_SCALARS = st.one_of(
    st.text(max_size=12),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False),
    st.booleans(),
    st.none(),
)
_VALUES = st.one_of(
    _SCALARS,
    st.lists(st.integers(0, 200_000), max_size=70),
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=5),
    st.lists(_SCALARS, max_size=5),
)
_KEYS = st.one_of(
    st.sampled_from(sorted(ADAPTER_KEYS)),
    st.sampled_from(["agentlightning.reward.0.value", "agentlightning.reward.0.name", "agentlightning.reward"]),
    st.text(max_size=10),
)
_HEX16 = st.text("0123456789abcdef", min_size=16, max_size=16)


_ATTRIBUTES = st.dictionaries(st.text(max_size=4), _VALUES, max_size=2)
_EVENTS = st.fixed_dictionaries(
    {"name": st.text(max_size=5), "attributes": _ATTRIBUTES, "timestamp": st.none() | st.floats(0, 1e9)}
)


@st.composite
def _spans(draw: st.DrawFn) -> dict[str, Any]:
    span_id = draw(_HEX16)
    context = {"trace_id": "ab" * 16, "span_id": span_id, "is_remote": draw(st.booleans()), "trace_state": {}}
    if draw(st.booleans()):
        context["trace_state"] = draw(st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2))
    status = {
        "status_code": draw(st.sampled_from(["UNSET", "OK", "ERROR"])),
        "description": draw(st.none() | st.text(max_size=5)),
    }
    links = st.lists(st.fixed_dictionaries({"context": st.just(context), "attributes": _ATTRIBUTES}), max_size=1)
    return {
        "rollout_id": "ro-1",
        "attempt_id": draw(st.sampled_from(["at-1", "at-é"])),
        "sequence_id": draw(st.integers(-(2**40), 2**40)),
        "trace_id": "ab" * 16,
        "span_id": span_id,
        "parent_id": draw(st.one_of(st.none(), _HEX16, st.text(max_size=20))),
        "name": draw(st.text(max_size=30)),
        "kind": draw(st.sampled_from(["INTERNAL", "CLIENT"])),
        "status": status,
        "attributes": draw(st.dictionaries(_KEYS, _VALUES, max_size=8)),
        "events": draw(st.lists(_EVENTS, max_size=2)),
        "links": draw(links),
        "start_time": draw(st.none() | st.floats(allow_nan=False)),
        "end_time": draw(st.none() | st.floats(allow_nan=False)),
        "context": draw(st.none() | st.just(context)),
        "parent": draw(st.none() | st.just(context)),
        "resource": {"attributes": draw(st.dictionaries(st.text(max_size=6), _VALUES, max_size=3)), "schema_url": ""},
        "scope_name": draw(st.text(max_size=6)),
        "scope_version": "1",
    }


@settings(max_examples=150, deadline=None)
@given(st.lists(_spans(), min_size=1, max_size=4))
def test_any_span_reads_as_the_codec_reads_it(spans: list[dict[str, Any]]) -> None:
    decoder = SpanRecordDecoder(CODEC)
    values = [CODEC.encode_dict("agl.Span", span) for span in spans]
    values += [value for _, value in span_dict_records(spans, CODEC)]
    for value in values:
        assert decoder.decode(value) == _reference(value)
    assert decoder.codec_records == 0  # all of it on the fast path


def test_token_ids_of_every_width_and_branch() -> None:
    decoder = SpanRecordDecoder(CODEC)
    arrays: list[list[Any]] = [
        [0, 0, 0],
        [0, 5, 0, 63, 64, 8191, 8192, 151_935, 2**21, 2**40, 2**63 - 1],
        [-1, 3, -(2**63)],
        list(range(300)),
        [5, None, 7],
        [1, True, 2],
        [1, 2.5, "x", False, None],
        [],
    ]
    for ids in arrays:
        span = attempt_history(1).spans[0]
        value = CODEC.encode_dict("agl.Span", {**span, "attributes": {**span["attributes"], "prompt_token_ids": ids}})
        for _ in range(2):  # the varint memo cold, then warm
            [lean] = decoder.decode(value)
            assert lean == _reference(value)[0]  # type: ignore[index]
            assert lean.attributes["prompt_token_ids"] == ids
            assert [type(v) for v in lean.attributes["prompt_token_ids"]] == [type(v) for v in ids]


def test_corrupted_records_are_refused_or_read_exactly_as_the_codec_does() -> None:
    rng = random.Random(11)
    decoder = SpanRecordDecoder(CODEC)
    good = [v for i in range(6) for v in span_values(attempt_history(i, vocab=151_936 if i % 2 else 64), CODEC, 5)]
    good.append(CODEC.encode_dict("agl.Span", attempt_history(9).spans[3]))
    for _ in range(3000):
        data = bytearray(rng.choice(good))
        for _ in range(rng.randint(1, 3)):
            action = rng.random()
            at = rng.randrange(10, len(data))
            if action < 0.6:
                data[at] = rng.randrange(256)
            elif action < 0.8:
                del data[at:]
            else:
                data[at:at] = bytes([rng.randrange(256)])
        assert _decoded(decoder, bytes(data)) == _reference(bytes(data))


def test_strings_the_adapter_skips_are_still_checked_as_utf8() -> None:
    span = attempt_history(2).spans[0]
    value = CODEC.encode_dict("agl.Span", {**span, "scope_name": "scope"})
    broken = value.replace(b"\x0ascope", b"\x0asc\xffpe")
    assert _decoded(SpanRecordDecoder(CODEC), broken) == _reference(broken)
    assert isinstance(_reference(broken), tuple)


def test_only_the_adapters_attributes_are_kept() -> None:
    attributes = {
        "gen_ai.prompt.0.content": "long text",
        "prompt_token_ids": [1],
        "agentlightning.reward.0.value": 1.0,
        "agent.name": "a",
        "resource.x": 3,
    }
    kept, rewardish = lean_attributes(attributes)
    assert kept == {"prompt_token_ids": [1], "agentlightning.reward.0.value": 1.0, "agent.name": "a"}
    assert rewardish
    assert lean_attributes({"reward": None}) == ({"reward": None}, True)
    assert lean_attributes({"agent.name": "a"}) == ({"agent.name": "a"}, False)
    span = Span.model_validate(attempt_history(3).spans[0])
    assert lean_span(span).attributes == lean_attributes(span.attributes)[0]
    assert lean_span(lean_span(span)) == lean_span(span)


def test_unvalidated_triplets_are_the_validated_ones() -> None:
    spans = [Span.model_validate(d) for d in attempt_history(4).spans]
    for triplet in extract_triplets(spans, AdapterConfig(final_reward_to_last=True)).triplets:
        validated = Triplet(
            prompt_token_ids=triplet.prompt_token_ids,
            response_token_ids=triplet.response_token_ids,
            response_logprobs=triplet.response_logprobs,
            reward=triplet.reward,
            metadata=triplet.metadata,
            span_ids=[triplet.metadata["span_id"]],
            policy_versions=[None],  # the history's calls name no serving version
        )
        assert triplet == validated
        assert triplet.__dict__ == validated.__dict__
        assert list(triplet.__dict__) == list(validated.__dict__)
        assert triplet.model_fields_set == validated.model_fields_set


def _records(rng: random.Random, count: int) -> list[TripletRecord]:
    def ids() -> list[int]:
        widths = (64, 200_000, 1 << 40)
        return [rng.randrange(rng.choice(widths)) * rng.choice((1, 1, -1)) for _ in range(rng.randint(0, 6))]

    records = []
    for _ in range(count):
        triplets = []
        for _ in range(rng.randint(0, 3)):
            response = ids()
            triplets.append(
                Triplet(
                    prompt_token_ids=ids(),
                    response_token_ids=response,
                    response_logprobs=rng.choice([None, [], [-rng.random() for _ in response]]),
                    reward=rng.choice([None, 0.5, -1.0, math.nan]),
                    metadata=rng.choice([{}, {"a": "é", "b": None, "c": 3, "d": [1.5, True]}, {"x": "\u2028"}]),
                    prompt_extra=rng.choice([None, None, {"k": 1}]),
                )
            )
        fields: dict[str, Any] = {
            "rollout_id": rng.choice(["ro-1", "ro-é"]),
            "attempt_id": "at-1",
            "group_id": "g" * rng.randint(0, 200),
            "resources_id": rng.choice([None, "rs-1"]),
            "policy_version": rng.choice([None, 0, 7, -3, 1 << 40]),
            "triplets": triplets,
            "final_reward": rng.choice([None, 1.0]),
            "finish_time": rng.choice([1_767_225_600.5, 0.0]),
        }
        if "mode" in TripletRecord.model_fields:  # a field added since: written from the schema too
            fields["mode"] = rng.choice([None, "train", "val", "test"])
        records.append(TripletRecord.model_validate(fields))
    return records


def test_the_encoder_writes_the_codecs_bytes() -> None:
    encoder = TripletRecordEncoder(CODEC)
    for record in _records(random.Random(5), 800):
        assert encoder.encode(record) == CODEC.encode(record)


def test_an_unknown_schema_leaves_encoding_and_decoding_to_the_codec(monkeypatch: pytest.MonkeyPatch) -> None:
    from agl_stream.domain.adapter import span_decoder
    from agl_stream.wire.avro_writer import Declined

    monkeypatch.setattr(span_decoder, "SPAN_BATCH_FINGERPRINT", 1)
    decoder = SpanRecordDecoder(CODEC)
    value = span_values(attempt_history(1), CODEC, 10)[0]
    assert not decoder.fast and decoder.decode(value) == _reference(value) and decoder.codec_records == 1
    monkeypatch.setattr(CODEC, "compiled_writer", lambda *args, **kwargs: (_ for _ in ()).throw(Declined()))
    encoder = TripletRecordEncoder(CODEC)
    [record] = _records(random.Random(1), 1)
    assert not encoder.fast and encoder.encode(record) == CODEC.encode(record)
