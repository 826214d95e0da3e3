"""Bad input, fuzzed: every decoder of untrusted bytes or JSON and every HTTP body parser.

Each case ends in a clear, typed error (CodecError, OtlpError, TaskRequestError, pydantic's
ValidationError at the model edge), in a DLQ record (``prepare_records`` + ``dead_letter``), or
in an answer with a JSON error (4xx; 503 where the route says "not now"): never an unexpected
exception type (IndexError, struct.error, RecursionError, UnicodeDecodeError, OverflowError...),
a 500, a stall (every test has a timeout) or a silent drop (every record and span is accounted
for). What decodes must also encode again, or it fails later, far from the bad input.

Corrupted inputs are derived from valid encodings (truncated, spliced, bytes flipped, inserted
or appended, headers and fingerprints swapped, huge varints), which reaches much deeper than
random bytes. The valid records come from a seeded corpus built from the models' annotations.

Pure: no broker, no ClickHouse, nothing mocked. The HTTP apps run in-process (starlette's
TestClient) on their real collaborators, never started: a body that would reach Kafka gets that
collaborator's own 503 ("still starting"), so valid bodies are answered too. The inference
server runs its real engine (tiny random policy; token budgets of valid bodies capped at two).
Two routes would reach a backend that cannot answer here, so their valid bodies are steered
off it, while their parsing runs in full: ``POST /v1/query`` with no fence would run SQL on
ClickHouse (a body that validates gets a fence on a topic the gateway has no sink for), and a
completion the LLM proxy would forward names a model it does not serve (404). The proxy's
per-attempt routes (``/rollout/{id}/attempt/{id}/v1/...``) need its store client to number
spans and are not fuzzed here; their bodies go through the same parser as ``/v1/...``.
"""

from __future__ import annotations

import base64
import functools
import gzip
import io
import itertools
import json
import math
import random
import re
import types
import zlib
from collections.abc import Callable, Iterator
from typing import Annotated, Any, Literal, Union, cast, get_args, get_origin

import annotated_types
import fastavro
import pydantic_core
import pytest
from aiokafka import ConsumerRecord, TopicPartition
from google.protobuf import json_format
from google.rpc import status_pb2
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan
from pydantic import BaseModel, StringConstraints, ValidationError
from pydantic.fields import FieldInfo
from starlette.testclient import TestClient

from agl_stream.clickhouse.avro_ingest import container, container_header, zigzag
from agl_stream.config import Settings
from agl_stream.domain.ingress import (
    IngressLimits,
    TaskRequestError,
    TaskRequestTooLargeError,
    decode_request,
    request_from_json,
    request_from_line,
)
from agl_stream.errors import CodecError, MalformedRecordError
from agl_stream.kafka.io import Rejected, dead_letter, decode_as, prepare_records
from agl_stream.models import (
    AVRO_CONTEXT,
    RECORD_MODELS,
    AglModel,
    AttemptUpdated,
    DlqRecord,
    Reply,
    RolloutState,
    RolloutUpdated,
    Span,
    SpanBatch,
    TaskRequest,
)
from agl_stream.models.base import MAX_EPOCH_SECONDS
from agl_stream.wire import otlp
from agl_stream.wire.codec import HEADER_SIZE, MAGIC, Codec
from agl_stream.wire.reply_wire import ReplyEncoder, replies_of
from agl_stream.wire.span_records import SPAN_BATCH, batch_body_of_span, span_dict_records, span_dicts_of, spans_of
from consumers.clickhouse_sink import EnvelopeBody
from consumers.sink_specs import SPECS

pytestmark = pytest.mark.timeout(120)  # a stall fails, instead of hanging the suite

CODEC = Codec.default()
LIMITS = IngressLimits()
KNOWN_FINGERPRINTS = sorted(CODEC.contract.known)

FUZZ = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
"""Modest on purpose: the whole file runs in seconds on two slow cores."""

DEEP = 100_000
"""Nesting far past any parser's recursion limit."""


# --------------------------------------------------------------------------------------------
# Shared strategies
# --------------------------------------------------------------------------------------------


def _avro_string(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return zigzag(len(data)) + data


# --------------------------------------------------------------------------------------------
# A corpus of valid records, built from the models' own annotations by a seeded generator:
# hypothesis then spends its examples on damaging them (drawing rich records with hypothesis
# costs ~10-20 ms each, too much for a suite that must stay fast)
# --------------------------------------------------------------------------------------------

_JSON_SAMPLES: list[Any] = [None, 0, -7, 2.5, "ünïcode ✓", True, [], {"q": [1, None, {"deep": "x"}], "n": 1e-3}]
_TEXTS = ["", "ro-1", "at-00000002", "ünïcode ✓ 🚀", "x" * 40, "a,b=c", "\x00\n"]


def _constraints(metadata: list[Any]) -> list[Any]:
    return [m for item in metadata for m in (item.metadata if isinstance(item, FieldInfo) else [item])]


def _scalar(annotation: Any, metadata: list[Any], rng: random.Random) -> Any:
    flat = _constraints(metadata)
    # The bounds of an int or a float field: numbers (annotated_types types them as protocols).
    lows: list[Any] = [m.ge for m in flat if isinstance(m, annotated_types.Ge)] + [
        m.gt for m in flat if isinstance(m, annotated_types.Gt)
    ]
    highs: list[Any] = [m.le for m in flat if isinstance(m, annotated_types.Le)]
    if annotation is bool:
        return rng.random() < 0.5
    if annotation is int:
        low, high = max([-(2**31), *lows]), min([2**31 - 1, *highs])
        return rng.choice([low, high, rng.randint(int(low), int(high))])
    if annotation is float:
        low_f, high_f = max([-1e12, *lows]), min([1e12, *highs])
        return rng.choice([float(low_f), float(high_f), rng.uniform(low_f, high_f)])
    if annotation is str:
        pattern = next((m.pattern for m in flat if isinstance(m, StringConstraints) and m.pattern), None)
        if pattern is not None:
            size = int(re.findall(r"\{(\d+)\}", str(pattern))[0])
            return "".join(rng.choice("0123456789abcdef") for _ in range(size))
        if any(isinstance(m, StringConstraints) and m.min_length for m in flat):  # ids: never empty
            return rng.choice([t for t in _TEXTS if t]) if rng.random() < 0.5 else f"{rng.getrandbits(64):016x}"
        return rng.choice(_TEXTS)
    if annotation is bytes:
        return rng.randbytes(rng.randint(0, 24))
    raise NotImplementedError(annotation)


def _value(annotation: Any, metadata: list[Any], rng: random.Random, depth: int) -> Any:
    if annotation is Any:
        return rng.choice(_JSON_SAMPLES)
    origin = get_origin(annotation)
    if origin is Annotated:
        base, *extra = get_args(annotation)
        return _value(base, [*metadata, *extra], rng, depth)
    if origin is Literal:
        return rng.choice(get_args(annotation))
    if origin in (Union, types.UnionType):
        branches = [b for b in get_args(annotation) if b is not type(None)]
        if len(branches) < len(get_args(annotation)) and rng.random() < 0.25:
            return None
        return _value(rng.choice(branches), metadata, rng, depth)
    size = rng.randint(0, 3) if depth < 3 else 0
    if origin is list:
        return [_value(get_args(annotation)[0], [], rng, depth + 1) for _ in range(size)]
    if origin is dict:
        return {f"{rng.choice(_TEXTS)}{i}": _value(get_args(annotation)[1], [], rng, depth + 1) for i in range(size)}
    if isinstance(annotation, type) and issubclass(annotation, AglModel):
        return _instance(annotation, rng, depth + 1)
    return _scalar(annotation, metadata, rng)


def _instance(model: type[AglModel], rng: random.Random, depth: int = 0) -> AglModel:
    fields = {name: _value(info.annotation, info.metadata, rng, depth) for name, info in model.model_fields.items()}
    if model is RolloutUpdated or model is AttemptUpdated:
        chosen = {n: fields[n] for n in model.updatable if rng.random() < 0.5}
        chosen = {n: v for n, v in chosen.items() if v is not None or n not in model.not_nullable}
        if model is AttemptUpdated:
            return AttemptUpdated.of(fields["attempt_id"], **chosen)
        return RolloutUpdated.of(**chosen)
    return model(**fields)


@functools.cache
def corpus(model: type[AglModel]) -> tuple[AglModel, ...]:
    """Valid, varied records of ``model`` (the same ones on every run)."""
    rng = random.Random(f"agl-fuzz-{model.__name__}")
    return tuple(_instance(model, rng) for _ in range(6))


def records_of(*models: type[AglModel]) -> st.SearchStrategy[AglModel]:
    return st.sampled_from(models or RECORD_MODELS).flatmap(lambda model: st.sampled_from(corpus(model)))


def valid_records(models: tuple[type[AglModel], ...] = RECORD_MODELS) -> st.SearchStrategy[bytes]:
    """A valid single-object encoding of a record of any (or the given) type."""
    return records_of(*models).map(CODEC.encode)


def test_the_corpus_has_every_record_type_and_encodes() -> None:
    for model in RECORD_MODELS:
        for record in corpus(model):
            assert CODEC.decode(CODEC.encode(record), model) is not None


@st.composite
def corrupted(draw: st.DrawFn, data: bytes) -> bytes:
    """``data`` damaged the ways storage, truncation, a buggy or a hostile producer damage it."""
    kind = draw(
        st.sampled_from(
            ["truncate", "append", "flip", "insert", "delete", "splice", "fingerprint", "magic", "varint", "body"]
        )
    )
    body = bytearray(data)
    position = draw(st.integers(HEADER_SIZE, max(HEADER_SIZE, len(body) - 1)))
    if kind == "truncate":
        del body[draw(st.integers(0, len(body) - 1)) :]
    elif kind == "append":
        body += draw(st.binary(min_size=1, max_size=16))
    elif kind == "flip" and len(body) > HEADER_SIZE:
        for _ in range(draw(st.integers(1, 4))):
            at = draw(st.integers(HEADER_SIZE, len(body) - 1))
            body[at] = draw(st.integers(0, 255))
    elif kind == "insert":
        body[position:position] = draw(st.binary(min_size=1, max_size=12))
    elif kind == "delete" and len(body) > HEADER_SIZE:
        del body[position : position + draw(st.integers(1, 8))]
    elif kind == "splice":  # another record's body after this header: a wrong schema for the bytes
        other = draw(valid_records())
        body = body[:HEADER_SIZE] + bytearray(other[HEADER_SIZE:])
    elif kind == "fingerprint":  # a known (other or historical) or unknown writer schema
        fingerprint = draw(st.sampled_from(KNOWN_FINGERPRINTS) | st.integers(0, 2**64 - 1))
        body[2:HEADER_SIZE] = fingerprint.to_bytes(8, "little")
    elif kind == "magic":
        body[: draw(st.integers(1, 2))] = draw(st.binary(min_size=1, max_size=2))
    elif kind == "varint":  # a huge, negative or overlong length or count where one may be
        huge = draw(st.sampled_from([b"\xff" * 9 + b"\x01", b"\xff" * 20 + b"\x01", b"\x01", b"\xfe\xff\xff\xff\x0f"]))
        body[position : position + 1] = huge
    else:  # random bytes under a valid header
        body = body[:HEADER_SIZE] + bytearray(draw(st.binary(max_size=64)))
    return bytes(body)


@st.composite
def damaged_records(draw: st.DrawFn) -> bytes:
    return draw(corrupted(draw(valid_records())))


untrusted_messages = st.one_of(
    damaged_records(),
    valid_records(),
    st.binary(max_size=64),
    st.binary(max_size=48).map(lambda body: MAGIC + body),
)
"""What a consumer may fetch from a topic anyone can write to."""


def _assert_decodes_again(name: str, datum: dict[str, Any]) -> None:
    """A decoded record is one the codec can write (else a processor folding it fails later).

    One exception: Avro reads an ``int`` as a varint of any length, so a damaged one can hold a
    value past 32 bits (a ``long`` wraps at 64). The dict can then not be written back, which
    fails with a CodecError (a sink re-encoding it dead-letters it), and the models, the
    processors' path, refuse it: every ``int`` field is bounded there.
    """
    try:
        encoded = CODEC.encode_dict(name, datum)
    except CodecError:
        model = CODEC.models.get(name)
        assert model is not None
        with pytest.raises(ValidationError):
            model.model_validate(datum)
        return
    assert CODEC.decode_dict(encoded)[0] == name


# --------------------------------------------------------------------------------------------
# Codec: every record type, corrupted
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", RECORD_MODELS, ids=lambda m: m.__name__)
@settings(FUZZ, max_examples=3)
@given(data=st.data())
def test_every_record_type_fails_only_with_codec_errors_when_damaged(
    model: type[AglModel], data: st.DataObject
) -> None:
    good = CODEC.encode(data.draw(st.sampled_from(corpus(model)), label="record"))
    cases = [good[:end] for end in range(len(good))]  # every truncation, header included
    cases += [good + tail for tail in (b"\x00", b"\x02x", bytes(9))]  # trailing bytes
    cases += [data.draw(corrupted(good), label=f"damage {i}") for i in range(6)]
    for case in cases:
        try:
            name, datum = CODEC.decode_dict(case)
        except CodecError as error:
            assert str(error)
        else:
            _assert_decodes_again(name, datum)
        try:
            record = CODEC.decode(case, model)
        except CodecError as error:
            assert str(error)
        else:
            CODEC.encode(record)
    for tail in (b"\x00", bytes(9)):
        with pytest.raises(MalformedRecordError, match="after the end"):
            CODEC.decode_dict(good + tail)


@settings(FUZZ, max_examples=80)
@given(message=untrusted_messages)
def test_any_message_decodes_or_is_a_codec_error(message: bytes) -> None:
    try:
        name, datum = CODEC.decode_dict(message)
    except CodecError as error:
        assert str(error)
    else:
        _assert_decodes_again(name, datum)
        model = CODEC.models.get(name)  # none for a bare enum
        try:
            record = None if model is None else CODEC.decode(message, model)
        except CodecError:
            pass
        else:
            assert record is None or CODEC.decode_dict(CODEC.encode(record))[0] == name


def _task_request_with_input_text(text: str | bytes) -> bytes:
    """A TaskRequest whose ``input`` field holds ``text`` as its JSON text, whatever that is."""
    marker = "MARKER-7c1e"
    good = CODEC.encode(TaskRequest(request_id="req-1", input=marker))
    placeholder = _avro_string(json.dumps(marker))
    assert good.count(placeholder) == 1
    return good.replace(placeholder, _avro_string(text))


@settings(FUZZ, max_examples=40)
@given(
    text=st.one_of(
        st.text(max_size=40),
        st.from_regex(r"\A[\[\]{}\"0-9eE.+\-,:a-z\\ ]{0,40}\Z"),
        st.recursive(
            st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=6),
            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
            max_leaves=8,
        ).map(lambda value: json.dumps(value)),  # may say NaN or Infinity
    )
)
@example(text="NaN")  # was: decoded as nan, then the codec refused to write the record back
@example(text="[1, -Infinity]")
@example(text="1e400")  # parsed as inf: the same
@example(text='{"a": 1' + "0" * 400 + ".5}")
@example(text='"\\ud800"')  # a lone surrogate: decoded, then not writable as UTF-8
@example(text='{"\\udfff": 1}')
@example(text='"\\ud83d\\ude00"')  # a surrogate pair is text
@example(text="[" * DEEP + "]" * DEEP)
@example(text="{not json")
def test_json_fields_decode_only_to_what_the_codec_writes(text: str) -> None:
    data = _task_request_with_input_text(text)
    try:
        request = CODEC.decode(data, TaskRequest)
    except MalformedRecordError as error:
        assert "TaskRequest" in str(error)
        return
    again = CODEC.decode(CODEC.encode(request), TaskRequest)
    assert json.dumps(again.input, sort_keys=True) == json.dumps(request.input, sort_keys=True)


@settings(FUZZ, max_examples=20)
@given(
    text=st.text(max_size=6),
    damage=st.sampled_from([b"", b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xe2\x82", b"\xf4\x90\x80\x80"]),
    at=st.integers(0, 24),
)
@example(text="", damage=b"\xed\xa0\x80", at=0)  # CESU-8 of a lone surrogate
def test_avro_strings_are_utf8_or_malformed(text: str, damage: bytes, at: int) -> None:
    """Invalid UTF-8 in an Avro string is a MalformedRecordError, never a UnicodeDecodeError."""
    good = CODEC.encode(TaskRequest(request_id="req-1", input=None, resources_id="RID"))
    raw = text.encode()
    raw = raw[: at % (len(raw) + 1)] + damage + raw[at % (len(raw) + 1) :]
    data = good.replace(_avro_string("RID"), _avro_string(raw))
    try:
        assert CODEC.decode(data, TaskRequest).resources_id == raw.decode("utf-8")
    except MalformedRecordError as error:
        assert "UnicodeDecodeError" in str(error)
        with pytest.raises(UnicodeDecodeError):
            raw.decode("utf-8")


# --------------------------------------------------------------------------------------------
# Models: times that are no times
# --------------------------------------------------------------------------------------------

BAD_TIMES: list[Any] = [
    math.nan,
    math.inf,
    -math.inf,
    1e300,
    -1.0,
    -1e-9,
    MAX_EPOCH_SECONDS + 1,
    10**400,
    "soon",
    [1.0],
]


def _epoch_fields(model: type[BaseModel]) -> list[str]:
    """Fields typed EpochSeconds (or EpochSeconds | None): points in time the engine stores."""
    return [
        name
        for name, info in model.model_fields.items()
        if str(int(MAX_EPOCH_SECONDS)) in repr(info.annotation) + repr(info.metadata)
    ]


def _is_float(annotation: Any) -> bool:
    """``float``, ``float | None``, or either Annotated (EpochSeconds)."""
    branches = get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)
    return any(b is float or (get_origin(b) is Annotated and get_args(b)[0] is float) for b in branches)


EPOCH_MODELS = [(m, f) for m in RECORD_MODELS for f in _epoch_fields(m)]
FLOAT_FIELDS = [(m, f) for m in RECORD_MODELS for f, info in m.model_fields.items() if _is_float(info.annotation)]


def _datum_setting(model: type[AglModel], record: AglModel, field: str) -> dict[str, Any]:
    """The record's dict form (union members tagged, as the codec reads them), ready for
    ``field`` to be set: a partial update must name it in set_fields."""
    datum = record.model_dump(context=AVRO_CONTEXT)
    if field in getattr(model, "updatable", ()):
        datum["set_fields"] = [*[f for f in datum["set_fields"] if f != field], field]
    return datum


def test_epoch_fields_are_found() -> None:
    found = {(m.__name__, f) for m, f in EPOCH_MODELS}
    assert {("Span", "start_time"), ("RolloutEvent", "time"), ("Attempt", "last_heartbeat_time")} <= found


@pytest.mark.parametrize(("model", "field"), EPOCH_MODELS, ids=lambda v: getattr(v, "__name__", v))
@settings(FUZZ, max_examples=3)
@given(data=st.data())
def test_non_finite_or_out_of_range_times_are_refused_at_the_edge(
    model: type[AglModel], field: str, data: st.DataObject
) -> None:
    datum = _datum_setting(model, data.draw(st.sampled_from(corpus(model))), field)
    for bad in BAD_TIMES:
        with pytest.raises(ValidationError) as info:
            model.model_validate({**datum, field: bad})
        assert any(field in error["loc"] for error in info.value.errors())
    for fine in (0.0, 1_700_000_000.5, MAX_EPOCH_SECONDS):
        record = model.model_validate({**datum, field: fine})
        assert CODEC.decode(CODEC.encode(record), model) == record
    # A writer that does not validate (another language, an old version) gets a DLQ reason.
    raw = CODEC.encode_dict(model.avro_name, {**datum, field: math.nan})
    with pytest.raises(MalformedRecordError, match=field):
        CODEC.decode(raw, model)


def test_float_fields_are_found() -> None:
    assert len(FLOAT_FIELDS) > len(EPOCH_MODELS) and ("DlqRecord", "time") in {(m.__name__, f) for m, f in FLOAT_FIELDS}


@settings(FUZZ, max_examples=40)
@given(
    model_field=st.sampled_from(FLOAT_FIELDS),
    value=st.sampled_from([math.nan, math.inf, -math.inf, 1e300, -1e300, -0.0, 5e-324, 10**30, 10**400, -1, "1"]),
    data=st.data(),
)
def test_any_float_field_takes_any_number_or_refuses_it_clearly(
    model_field: tuple[type[AglModel], str], value: Any, data: st.DataObject
) -> None:
    model, field = model_field
    datum = _datum_setting(model, data.draw(st.sampled_from(corpus(model))), field)
    try:
        record = model.model_validate({**datum, field: value})
    except ValidationError:
        return
    encoded = CODEC.encode(record)
    assert CODEC.encode(CODEC.decode(encoded, model)) == encoded


# --------------------------------------------------------------------------------------------
# prepare_records: bad records become DLQ records with a reason, never an exception
# --------------------------------------------------------------------------------------------


def _consumer_record(offset: int, value: bytes | None, key: bytes | None = b"k") -> ConsumerRecord[bytes, bytes]:
    return ConsumerRecord(
        topic="agl.some-topic",
        partition=offset % 3,
        offset=offset,
        timestamp=1_700_000_000_000,
        timestamp_type=0,
        key=key,
        value=value,
        checksum=None,
        serialized_key_size=0 if key is None else len(key),
        serialized_value_size=0 if value is None else len(value),
        headers=(),
    )


PREPARES: dict[str, Callable[[bytes], Any]] = {
    "decode_as(any)": decode_as(CODEC),
    "decode_as(agl.Span)": decode_as(CODEC, "agl.Span"),
    **{
        f"sink {spec.name}": EnvelopeBody(CODEC, spec.record, skip_tombstones=spec.skip_tombstones, also=spec.also)
        for spec in SPECS
    },
}


@settings(FUZZ, max_examples=40)
@given(
    prepare_name=st.sampled_from(sorted(PREPARES)),
    values=st.lists(untrusted_messages | st.none() | st.just(b""), min_size=1, max_size=6),
    keys=st.lists(st.none() | st.binary(max_size=2048), min_size=6, max_size=6),
)
def test_prepare_records_dead_letters_every_bad_record_and_drops_none(
    prepare_name: str, values: list[bytes | None], keys: list[bytes | None]
) -> None:
    prepare = PREPARES[prepare_name]
    messages = [_consumer_record(i, value, keys[i]) for i, value in enumerate(values)]
    batch: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]] = {}
    for message in messages:
        batch.setdefault(TopicPartition(message.topic, message.partition), []).append(message)
    prepared, rejected = prepare_records(batch, prepare)
    offsets = sorted([f.offset for f in prepared] + [r.offset for r in rejected])
    assert offsets == list(range(len(values))), "every record is prepared or rejected, exactly once"
    for fetched in prepared:
        assert fetched.raw == (values[fetched.offset] or b"")
        if prepare_name.startswith("decode_as"):
            assert fetched.value == CODEC.decode_dict(fetched.raw)[1]
    for item in rejected:
        assert isinstance(item.error, CodecError) and str(item.error)
        assert item.raw == (values[item.offset] or b"")
        _assert_dead_letter_is_writable(item)
    if prepare_name.startswith("sink "):
        checker = prepare
        assert isinstance(checker, EnvelopeBody)
        for fetched in prepared:  # what the engine rejects is checked again in Python: CodecError
            try:
                checker.check(fetched.raw)
            except CodecError as error:
                _assert_dead_letter_is_writable(Rejected.of(fetched, error))


def _assert_dead_letter_is_writable(item: Rejected) -> None:
    record = dead_letter(item, "processor.fuzz")
    again = CODEC.decode(CODEC.encode(record), DlqRecord)
    assert (again.source_offset, again.value_size) == (item.offset, len(item.raw))
    assert again.error_type == type(item.error).__name__
    assert again.reason


@settings(FUZZ, max_examples=40)
@given(message=untrusted_messages | valid_records((TaskRequest,)).flatmap(corrupted))
def test_ingress_decoding_fails_only_with_its_typed_errors(message: bytes) -> None:
    """The ingress processor dead-letters CodecError and TaskRequestError; anything else would
    stop it on a poison record."""
    try:
        request = decode_request(CODEC, message, LIMITS)
    except (CodecError, TaskRequestError) as error:
        assert str(error)
    else:
        CODEC.encode(request)


# --------------------------------------------------------------------------------------------
# Ingress: task requests as JSON (POST /v1/tasks, task files)
# --------------------------------------------------------------------------------------------

TASK_KEYS = ["request_id", "input", "mode", "resources_id", "config", "metadata", "request_time", "extra"]
CONFIG_KEYS = ["max_attempts", "timeout_seconds", "unresponsive_seconds", "retry_condition", "other"]
weird_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([2**31, 2**63, -(2**63) - 1, 10**400, 0, -1]),
    st.floats(),  # NaN and infinities included
    st.text(max_size=12),
    st.sampled_from(["train", "failed", "timeout", "req-1", "\ud800", "a\udfffb", "", " ", "x" * 200]),
)
weird_json = st.recursive(
    weird_scalars,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(CONFIG_KEYS) | st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=10,
)


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


@settings(FUZZ, max_examples=40)
@given(
    value=weird_json | st.dictionaries(st.sampled_from(TASK_KEYS), weird_json, max_size=6),
    input_depth=st.sampled_from([0, 0, 0, 0, 0, 50, 990, 2_000]),
)
@example(value={"input": 1, "request_time": 10**1000}, input_depth=0)  # was OverflowError from math.isfinite
@example(value={"input": 1, "config": {"timeout_seconds": 10**400}}, input_depth=0)
@example(value={"input": 1, "resources_id": "\ud800"}, input_depth=0)  # was accepted, then not writable
@example(value={}, input_depth=5_000)  # was RecursionError while measuring the input
@example(value={"input": 1, "mode": [10**5000]}, input_depth=0)  # repr() of it raises ValueError
@example(value={"input": 1, "config": {"retry_condition": [[10**5000]]}}, input_depth=0)
@example(value={"input": {"\ud800": 1}, "metadata": {"k": math.nan}}, input_depth=0)
def test_task_requests_from_json_are_valid_and_writable_or_refused_with_a_reason(value: Any, input_depth: int) -> None:
    if input_depth and isinstance(value, dict):
        value = {**value, "input": _nested(input_depth)}
    try:
        request = request_from_json(value, LIMITS, default_request_id="req-default")
    except TaskRequestError as error:
        assert str(error)
        return
    assert CODEC.decode(CODEC.encode(request), TaskRequest) == request


@settings(FUZZ, max_examples=40)
@given(line=st.text(max_size=60) | weird_json.map(lambda v: json.dumps(v)))
@example(line="[" * DEEP)  # was RecursionError
@example(line='{"input": 1' + "0" * 5000 + "}")  # was ValueError (digit limit), not a TaskRequestError
@example(line='{"input": 1, "request_time": 1' + "0" * 1000 + "}")  # was OverflowError
def test_task_file_lines_are_requests_or_refused_with_a_reason(line: str) -> None:
    try:
        request = request_from_line(line, 7, LIMITS)
    except TaskRequestError as error:
        assert str(error)
    else:
        CODEC.encode(request)


def test_sizes_win_the_error_type() -> None:
    with pytest.raises(TaskRequestTooLargeError):
        request_from_json({"input": "x" * 600_000, "mode": "nope"}, LIMITS, default_request_id="r")


# --------------------------------------------------------------------------------------------
# OTLP: bodies, compression, protobuf and JSON
# --------------------------------------------------------------------------------------------


def _mostly(common: st.SearchStrategy[Any], rare: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``common`` three times in four (``a | b`` weighs its branches alike, whatever they hold)."""
    return st.integers(0, 3).flatmap(lambda n: rare if n == 0 else common)


_scalar_values = st.one_of(
    st.text(max_size=8).map(lambda v: AnyValue(string_value=v)),
    st.booleans().map(lambda v: AnyValue(bool_value=v)),
    st.integers(-(2**63), 2**63 - 1).map(lambda v: AnyValue(int_value=v)),
    st.floats().map(lambda v: AnyValue(double_value=v)),
    st.binary(max_size=8).map(lambda v: AnyValue(bytes_value=v)),
    st.just(AnyValue()),
)


def _array_value(items: list[AnyValue]) -> AnyValue:
    value = AnyValue()
    value.array_value.values.extend(items)
    return value


def _kvlist_value(pairs: list[tuple[str, AnyValue]]) -> AnyValue:
    value = AnyValue()
    value.kvlist_value.values.extend(KeyValue(key=k, value=v) for k, v in pairs)
    return value


_any_values = st.recursive(
    _scalar_values,
    lambda inner: (
        st.lists(inner, max_size=3).map(_array_value)
        | st.lists(st.tuples(st.text(max_size=4), inner), max_size=3).map(_kvlist_value)
    ),
    max_leaves=4,
)
_OWNER_KEYS = [otlp.ROLLOUT_ID_KEY, otlp.ATTEMPT_ID_KEY, otlp.SEQUENCE_ID_KEY]
_attribute_keys = _mostly(st.text(max_size=6), st.sampled_from(_OWNER_KEYS))
_attributes = st.lists(st.builds(KeyValue, key=_attribute_keys, value=_any_values), max_size=3)
_ids = st.sampled_from(["ro-1", "at-1", "", "ro-2"]).map(lambda v: AnyValue(string_value=v)) | _scalar_values
_owner = st.lists(
    st.builds(KeyValue, key=st.sampled_from(_OWNER_KEYS), value=_ids),
    max_size=3,
)
_VALID_OWNER = [
    KeyValue(key=otlp.ROLLOUT_ID_KEY, value=AnyValue(string_value="ro-1")),
    KeyValue(key=otlp.ATTEMPT_ID_KEY, value=AnyValue(string_value="at-1")),
]


_owners = _mostly(st.just(_VALID_OWNER), _owner)  # put last: the owner attributes win
_nanos = _mostly(
    st.integers(0, 9_200_000_000 * 10**9),
    st.sampled_from([0, 9_300_000_000_000_000_000]) | st.integers(0, 2**64 - 1),
)


def _trace_id(size: int) -> st.SearchStrategy[bytes]:
    return _mostly(st.binary(min_size=size, max_size=size), st.binary(max_size=size + 2))


_links = st.builds(
    PbSpan.Link,
    trace_id=_trace_id(16),
    span_id=_trace_id(8),
    trace_state=st.text(max_size=10),
    attributes=_attributes,
    flags=st.integers(0, 2**32 - 1),
)
_events = st.builds(PbSpan.Event, time_unix_nano=_nanos, name=st.text(max_size=6), attributes=_attributes)
_spans = st.builds(
    PbSpan,
    trace_id=_trace_id(16),
    span_id=_trace_id(8),
    parent_span_id=st.just(b"") | _trace_id(8),
    name=st.text(max_size=8),
    kind=st.integers(0, 9),
    start_time_unix_nano=_nanos,
    end_time_unix_nano=_nanos,
    attributes=st.tuples(_attributes, _mostly(st.just([]), _owner)).map(lambda p: p[0] + p[1]),
    events=st.lists(_events, max_size=2),
    links=st.lists(_links, max_size=1),
    flags=st.integers(0, 2**32 - 1),
    trace_state=st.text(max_size=10),
)
otlp_requests = st.builds(
    ExportTraceServiceRequest,
    resource_spans=st.lists(
        st.builds(
            ResourceSpans,
            resource=st.builds(Resource, attributes=st.tuples(_attributes, _owners).map(lambda p: p[0] + p[1])),
            scope_spans=st.lists(
                st.builds(
                    ScopeSpans,
                    scope=st.builds(InstrumentationScope, name=st.text(max_size=5), version=st.text(max_size=3)),
                    spans=st.lists(_spans, max_size=3),
                ),
                max_size=2,
            ),
            schema_url=st.text(max_size=5),
        ),
        max_size=2,
    ),
)


def _otlp_json(request: ExportTraceServiceRequest) -> dict[str, Any]:
    """The OTLP JSON form of a request: protobuf's JSON mapping with hex ids."""
    document: dict[str, Any] = json_format.MessageToDict(request)

    def hexed(message: dict[str, Any], names: tuple[str, ...]) -> None:
        for name in names:
            if name in message:
                message[name] = base64.b64decode(message[name]).hex()

    for resource_spans in document.get("resourceSpans", []):
        for scope_spans in resource_spans.get("scopeSpans", []):
            for span in scope_spans.get("spans", []):
                hexed(span, ("traceId", "spanId", "parentSpanId"))
                for link in span.get("links", []):
                    hexed(link, ("traceId", "spanId"))
    return document


def _span_count(request: ExportTraceServiceRequest) -> int:
    return sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)


def _assert_otlp_outcome(body: bytes, encoding: otlp.Encoding) -> None:
    """Parsed and decoded with every span accounted for, each storable; or a clear OtlpError."""
    try:
        request = otlp.parse_request(body, encoding)
    except otlp.MalformedOtlpError as error:
        assert str(error)
        with pytest.raises(otlp.MalformedOtlpError):
            otlp.decode_body(body, encoding)
        return
    decoded = otlp.decode_request(request)
    assert decoded.total == _span_count(request), "no span goes unaccounted for"
    assert all(reason for reason in decoded.rejected)
    for item in decoded.spans:
        assert CODEC.decode(CODEC.encode(item.span), Span).span_id == item.span.span_id
    message = otlp.rejection_message(decoded.rejected, decoded.total)
    assert bool(message) == bool(decoded.rejected)


@settings(FUZZ, max_examples=20)
@given(data=st.data())
def test_otlp_protobuf_bodies_decode_or_are_malformed(data: st.DataObject) -> None:
    body = data.draw(otlp_requests).SerializeToString()
    damaged = data.draw(
        st.just(body)
        | st.binary(max_size=64)
        | st.builds(lambda cut: body[:cut], st.integers(0, max(0, len(body) - 1)))
        | st.builds(
            lambda at, b: body[:at] + b + body[at:], st.integers(0, len(body)), st.binary(min_size=1, max_size=8)
        )
        | st.builds(
            lambda at, v: body[:at] + bytes([v]) + body[at + 1 :], st.integers(0, len(body)), st.integers(0, 255)
        )
    )
    _assert_otlp_outcome(damaged, "protobuf")


def _replace_somewhere(document: Any, value: Any, choice: int) -> Any:
    """``document`` with the ``choice``-th of its subtrees (pre-order, modulo their count) replaced."""
    paths: list[tuple[Any, ...]] = []

    def walk(node: Any, path: tuple[Any, ...]) -> None:
        paths.append(path)
        if isinstance(node, dict):
            for key, child in node.items():
                walk(child, (*path, key))
        elif isinstance(node, list):
            for index, child in enumerate(node):
                walk(child, (*path, index))

    walk(document, ())
    path = paths[choice % len(paths)]
    if not path:
        return value
    parent = document
    for step in path[:-1]:
        parent = parent[step]
    parent[path[-1]] = value
    return document


_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
    | st.sampled_from(["00" * 16, "zz", "0" * 33, "AAAA", "SPAN_KIND_SERVER", "STATUS_CODE_ERROR", "1e400"]),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                [
                    "resourceSpans",
                    "scopeSpans",
                    "spans",
                    "traceId",
                    "spanId",
                    "links",
                    "attributes",
                    "key",
                    "value",
                    "stringValue",
                    "intValue",
                    "kvlistValue",
                    "arrayValue",
                    "values",
                    "startTimeUnixNano",
                    "kind",
                    "status",
                ]
            )
            | st.text(max_size=5),
            inner,
            max_size=4,
        )
    ),
    max_leaves=10,
)


@settings(FUZZ, max_examples=25)
@given(request=otlp_requests, replacement=_json_values, choice=st.integers(0, 10_000), mode=st.integers(0, 3))
@example(request=ExportTraceServiceRequest(), replacement="[" * DEEP + "]" * DEEP, choice=0, mode=3)  # RecursionError
@example(request=ExportTraceServiceRequest(), replacement='{"resourceSpans": ' + "[" * 3000, choice=0, mode=3)
def test_otlp_json_bodies_decode_or_are_malformed(
    request: ExportTraceServiceRequest, replacement: Any, choice: int, mode: int
) -> None:
    document = _otlp_json(request)
    if mode == 0:
        body = json.dumps(document).encode()
    elif mode == 1:
        body = json.dumps(_replace_somewhere(document, replacement, choice)).encode()
    elif mode == 2:
        text = json.dumps(document).encode()
        body = text[: choice % (len(text) + 1)] + b"\xff" + text[choice % (len(text) + 1) :]
    else:
        body = replacement.encode() if isinstance(replacement, str) else json.dumps(replacement).encode()
    _assert_otlp_outcome(body, "json")


GZIP_CODINGS = ("gzip", "x-gzip")


@settings(FUZZ, max_examples=40)
@given(
    payload=st.binary(max_size=300),
    cuts=st.lists(st.integers(0, 300), max_size=3),
    header=st.sampled_from(["gzip", "GZIP ", "x-gzip", "identity", None, "", "deflate", "br", "gzip, gzip"]),
    damage=st.sampled_from(["none", "truncate", "trailing", "flip", "raw"]),
    at=st.integers(0, 10_000),
)
@example(payload=b"x" * 100, cuts=[30], header="gzip", damage="none", at=0)  # the second member was dropped
@example(payload=b"x" * 100, cuts=[], header="gzip", damage="trailing", at=0)  # the junk was ignored
def test_decompress_gives_the_whole_body_or_a_typed_error(
    payload: bytes, cuts: list[int], header: str | None, damage: str, at: int
) -> None:
    bounds = sorted({0, *[c for c in cuts if c <= len(payload)], len(payload)})
    body = b"".join(gzip.compress(payload[a:b]) for a, b in itertools.pairwise(bounds)) or gzip.compress(b"")
    if damage == "truncate":
        body = body[: at % len(body)]
    elif damage == "trailing":
        body += b"junk"
    elif damage == "flip":
        position = at % len(body)
        body = body[:position] + bytes([body[position] ^ 0x5A]) + body[position + 1 :]
    elif damage == "raw":
        body = payload
    coding = (header or "identity").strip().lower()
    try:
        out = otlp.decompress(body, header, limit=1 << 16)
    except otlp.OtlpError as error:
        assert str(error)
        assert coding not in (*GZIP_CODINGS, "identity") or damage != "none", f"a valid body was refused: {error}"
        return
    assert coding in (*GZIP_CODINGS, "identity")
    if coding == "identity":
        assert out == body
    elif damage in ("none", "flip"):
        assert out == payload, "every member, none dropped, none changed (a flip that passes is in the header)"
    elif damage == "truncate":
        assert payload.startswith(out)  # cut at a member's end: a shorter, valid gzip body
    else:
        assert damage == "raw" and coding in GZIP_CODINGS  # random bytes that happen to be gzip


def test_decompress_refuses_bombs_and_unknown_codings_with_typed_errors() -> None:
    with pytest.raises(otlp.OtlpTooLargeError):
        otlp.decompress(gzip.compress(bytes(1 << 20)), "gzip", limit=1 << 16)
    with pytest.raises(otlp.OtlpTooLargeError):
        otlp.decompress(gzip.compress(bytes(1 << 15)) * 3, "gzip", limit=1 << 16)
    with pytest.raises(otlp.UnsupportedOtlpContentError):
        otlp.decompress(zlib.compress(b"{}"), "deflate")
    with pytest.raises(otlp.MalformedOtlpError, match="members"):
        otlp.decompress(gzip.compress(b"") * (otlp.MAX_GZIP_MEMBERS + 1), "gzip")


@settings(FUZZ, max_examples=30)
@given(header=st.none() | st.text(max_size=40))
def test_content_types_are_an_encoding_or_unsupported(header: str | None) -> None:
    try:
        assert otlp.content_encoding(header) in ("protobuf", "json")
    except otlp.UnsupportedOtlpContentError as error:
        assert str(error)


# --------------------------------------------------------------------------------------------
# Span batches, reply wire, sink containers
# --------------------------------------------------------------------------------------------


@settings(FUZZ, max_examples=40)
@given(message=valid_records((Span, SpanBatch)).flatmap(corrupted) | untrusted_messages)
def test_span_records_read_as_spans_or_fail_with_codec_errors(message: bytes) -> None:
    try:
        dicts = span_dicts_of(CODEC, message)
    except CodecError as error:
        assert str(error)
        with pytest.raises(CodecError):
            spans_of(CODEC, message)
        return
    try:
        spans = spans_of(CODEC, message)
    except MalformedRecordError:
        return
    assert len(spans) == len(dicts)


@settings(FUZZ, max_examples=40)
@given(
    body=st.binary(max_size=40)
    | valid_records((Span,))
    .map(lambda data: data[HEADER_SIZE:])
    .flatmap(lambda body: st.just(body) | st.builds(lambda cut: body[:cut], st.integers(0, len(body))))
)
@example(body=b"\xff" * 11)  # a length that never ends
@example(body=b"\x01")  # a negative length
@example(body=b"\xfe\xff\xff\xff\x0f")  # a length past the end
def test_a_single_span_becomes_a_batch_body_or_a_malformed_record(body: bytes) -> None:
    try:
        batch_body = batch_body_of_span(memoryview(body))
    except MalformedRecordError as error:
        assert str(error)
        return
    header = CODEC.contract.schema(SPAN_BATCH).header
    try:
        batch = CODEC.decode(header + batch_body, SpanBatch)
    except CodecError:
        return  # a broken span body makes a broken batch: the sink's check dead-letters it
    single = CODEC.decode(CODEC.contract.schema("agl.Span").header + body, Span)
    assert [CODEC.encode(s) for s in batch.spans] == [CODEC.encode(single)]


@settings(FUZZ, max_examples=15)
@given(spans=st.lists(records_of(Span), min_size=1, max_size=8), max_bytes=st.integers(200, 3000))
def test_span_batches_carry_every_span_in_order(spans: list[Span], max_bytes: int) -> None:
    records = span_dict_records([s.model_dump() for s in spans], CODEC, max_bytes=max_bytes)
    read = [span for _, data in records for span in spans_of(CODEC, data)]
    by_attempt = sorted(read, key=lambda s: (s.rollout_id, s.attempt_id))
    expected = sorted(spans, key=lambda s: (s.rollout_id, s.attempt_id))
    assert [CODEC.encode(s) for s in by_attempt] == [CODEC.encode(s) for s in expected]


REPLIES = ReplyEncoder(CODEC)


@settings(FUZZ, max_examples=20)
@given(
    request_id=st.text(max_size=20),
    outcome=st.sampled_from(["applied", "rejected", "empty", "unknown", "notice"]),
    state=st.none() | records_of(RolloutState),
    error=st.none() | st.text(max_size=30),
    state_partition=st.integers(-(2**31), 2**31 - 1),
    state_offset=st.integers(-(2**63), 2**63 - 1),
    covered=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=4),
    data=st.data(),
)
def test_replies_spliced_from_state_bytes_read_back_or_fail_as_malformed(
    request_id: str,
    outcome: Any,
    state: AglModel | None,
    error: str | None,
    state_partition: int,
    state_offset: int,
    covered: list[int],
    data: st.DataObject,
) -> None:
    encoded_state = None if state is None else CODEC.encode(state)
    state_body = None if encoded_state is None else REPLIES.state_body(encoded_state)
    fields: dict[str, Any] = {
        "state_partition": state_partition,
        "state_offset": state_offset,
        "covered_partitions": covered,
    }
    body = REPLIES.body(request_id, outcome, state_body=state_body, error=error, **fields)
    decoded = CODEC.decode(REPLIES.header + body, Reply)
    expected = Reply(request_id=request_id, outcome=outcome, state=state, error=error, **fields)
    assert CODEC.encode(decoded) == CODEC.encode(expected)
    [batch] = REPLIES.records([body, body])  # two answers to one writer: one agl.ReplyBatch
    assert [CODEC.encode(r) for r in replies_of(CODEC, batch)] == [CODEC.encode(expected)] * 2
    if encoded_state is not None:  # a state body damaged on its way: the reply is refused, typed
        damaged_state = data.draw(corrupted(encoded_state))
        damaged = REPLIES.body(request_id, outcome, state_body=REPLIES.state_body(damaged_state), **fields)
        for record in (REPLIES.header + damaged, *REPLIES.records([body, damaged])):
            try:
                [CODEC.encode(r) for r in replies_of(CODEC, record)]
            except CodecError as failure:
                assert str(failure)


@settings(FUZZ, max_examples=20)
@given(rows=st.lists(st.tuples(st.integers(0, 2**31 - 1), st.integers(0, 2**63 - 1), valid_records()), max_size=4))
def test_sink_containers_hold_exactly_their_rows(rows: list[tuple[int, int, bytes]]) -> None:
    schema = {"type": "record", "name": "Raw", "fields": [{"name": "b", "type": "bytes"}]}
    header = container_header(schema)
    bodies = [(p, o, _avro_string(data)) for p, o, data in rows]
    # fastavro types a record as any Avro value; these are the envelope schema's records.
    read = cast("list[dict[str, Any]]", list(fastavro.reader(io.BytesIO(container(header, bodies)))))
    assert [(r["kafka_partition"], r["kafka_offset"], r["record"]["b"]) for r in read] == rows


# --------------------------------------------------------------------------------------------
# HTTP bodies: the gateway, the LLM proxy, the inference server
# --------------------------------------------------------------------------------------------

BASE_URL = "http://127.0.0.1"
CONTENT_TYPES = [
    "application/json",
    "application/json; charset=utf-8",
    "APPLICATION/JSON",
    "text/plain",
    "application/x-protobuf",
    "application/x-www-form-urlencoded",
    None,
]


def _deep(n: int, open_: bytes = b"[", close: bytes = b"]") -> bytes:
    return open_ * n + close * n


raw_bodies = st.one_of(
    weird_json.map(lambda v: json.dumps(v).encode()),  # NaN, Infinity, \ud800 escapes, huge ints
    st.binary(max_size=64),
    st.text(max_size=20).map(lambda t: json.dumps({"input": t}).encode()[:-2] + b'\xed\xa0\x80"}'),  # CESU-8
    st.integers(1, 20_000).map(_deep),
    st.integers(1, 5_000).map(lambda n: _deep(n, b'{"a":', b"}")),
    st.integers(300, 6_000).map(lambda n: b'{"input": 1, "request_time": 1' + b"0" * n + b"}"),
)


def _body_of(value: Any) -> bytes:
    return json.dumps(value).encode()


def _assert_clear_answer(response: Any, *, unavailable_ok: bool = True) -> None:
    """2xx, or a 4xx (a 503 where the route says "not now") with a readable error body."""
    status = response.status_code
    assert status < 500 or (unavailable_ok and status == 503), f"{status}: {response.text[:600]}"
    if status < 400:
        return
    media_type = response.headers.get("content-type", "")
    if media_type.startswith(otlp.PROTOBUF):
        assert status_pb2.Status.FromString(response.content).message
        return
    assert media_type.startswith("application/json"), f"{status} {media_type}: {response.text[:300]}"
    document = response.json()
    error = document["error"]
    if isinstance(error, dict):  # OpenAI's shape (the proxy, the inference server): {"error": {"message"}}
        assert error["message"], document
    else:  # the gateway's: {"error": kind, "message"}
        assert error and document["message"], document


def _post(client: TestClient, path: str, body: bytes, content_type: str | None, **headers: str) -> Any:
    if content_type is not None:
        headers["content-type"] = content_type
    return client.post(path, content=body, headers=headers)


@pytest.fixture(scope="module")
def fuzz_settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    """Settings that name a broker nobody will call: no collaborator here is ever started."""
    return Settings(data_dir=tmp_path_factory.mktemp("fuzz"), kafka_bootstrap="127.0.0.1:9", api_token=None)


@pytest.fixture(scope="module")
def gateway(fuzz_settings: Settings) -> Iterator[tuple[Any, TestClient]]:
    """The gateway's real app on a Gateway that was never run: no sink, no ClickHouse client,
    its task producer and trace store client not started (their routes answer 503)."""
    from consumers.gateway import Gateway, create_app

    instance = Gateway(fuzz_settings, specs=())
    with TestClient(create_app(instance), base_url=BASE_URL, raise_server_exceptions=False) as client:
        yield instance, client


@settings(FUZZ, max_examples=25)
@given(
    body=raw_bodies
    | st.lists(st.dictionaries(st.sampled_from(TASK_KEYS), weird_json, max_size=6), max_size=3).map(_body_of)
    | st.dictionaries(st.sampled_from(TASK_KEYS), weird_json, max_size=6).map(_body_of),
    content_type=st.sampled_from(CONTENT_TYPES),
)
@example(body=_deep(DEEP), content_type="application/json")
@example(body=b'{"input": 1, "request_time": 1' + b"0" * 1000 + b"}", content_type="application/json")  # was a 500
@example(body=b'{"input": 1, "resources_id": "\\ud800"}', content_type="application/json")
@example(body=b'{"input": 1, "request_id": "\\ud800"}', content_type="application/json")
@example(body=b'{"input": ' + _deep(3000) + b"}", content_type="application/json")
@example(body=b"\xff\xfe\x00{", content_type="application/json")
@example(body=b'{"input": 1}', content_type="text/plain")
@example(body=b"[]", content_type="application/json")
def test_post_tasks_answers_every_body_clearly(
    gateway: tuple[Any, TestClient], body: bytes, content_type: str | None
) -> None:
    _, client = gateway
    response = _post(client, "/v1/tasks", body, content_type)
    _assert_clear_answer(response)
    if response.status_code == 422:
        assert response.json()["items"] or "empty" in response.json()["message"]


QUERY_KEYS = ["sql", "parameters", "fence", "timeout", "other"]


def _kept_from_clickhouse(body: bytes) -> bytes:
    """The body, or, when it is a query the gateway would run, the same with a fence on a topic
    no sink of this gateway reads (answered 400 before ClickHouse is asked)."""
    from consumers.gateway import QueryRequest

    try:
        QueryRequest.model_validate_json(body)
    except ValidationError:
        return body
    document = json.loads(body)
    document["fence"] = {"agl.not-sunk": {"0": 1}}
    return json.dumps(document).encode()


@settings(FUZZ, max_examples=20)
@given(
    body=raw_bodies
    | st.dictionaries(st.sampled_from(QUERY_KEYS), weird_json | st.just({"t": {"0": 1}}), max_size=4).map(_body_of),
    content_type=st.sampled_from(CONTENT_TYPES),
)
@example(body=_deep(DEEP), content_type="application/json")
@example(body=b'{"sql": "SELECT 1", "timeout": NaN}', content_type="application/json")
@example(body=b'{"sql": "SELECT 1", "fence": {"t": {"x": 1}}}', content_type="application/json")
@example(body=b'{"sql": "\\ud800"}', content_type="application/json")
def test_post_query_answers_every_body_clearly(
    gateway: tuple[Any, TestClient], body: bytes, content_type: str | None
) -> None:
    _, client = gateway
    response = _post(client, "/v1/query", _kept_from_clickhouse(body), content_type)
    _assert_clear_answer(response, unavailable_ok=False)


@settings(FUZZ, max_examples=20)
@given(
    body=raw_bodies
    | otlp_requests.map(lambda r: r.SerializeToString())
    | otlp_requests.map(lambda r: _body_of(_otlp_json(r))),
    content_type=st.sampled_from([*CONTENT_TYPES, "application/x-protobuf; proto=x"]),
    content_encoding=st.sampled_from([None, "gzip", "deflate", "identity"]),
    compress=st.booleans(),
)
@example(body=_deep(DEEP), content_type="application/json", content_encoding=None, compress=False)  # was a 500
@example(body=_deep(DEEP), content_type="application/json", content_encoding="gzip", compress=True)
@example(body=b"\x0a\xff\xff\xff\xff\x0f", content_type="application/x-protobuf", content_encoding=None, compress=False)
def test_post_traces_answers_every_body_clearly(
    gateway: tuple[Any, TestClient], body: bytes, content_type: str | None, content_encoding: str | None, compress: bool
) -> None:
    _, client = gateway
    headers = {} if content_encoding is None else {"content-encoding": content_encoding}
    sent = gzip.compress(body) if compress else body
    response = _post(client, "/v1/traces", sent, content_type, **headers)
    _assert_clear_answer(response)


@pytest.fixture(scope="module")
def stopping_gateway(fuzz_settings: Settings) -> Iterator[TestClient]:
    """A gateway shutting down: ``/v1/sql`` parses every body, then answers a valid one 503
    instead of running it on ClickHouse."""
    from consumers.gateway import Gateway, create_app

    instance = Gateway(fuzz_settings, specs=())
    instance.stopping = True
    with TestClient(create_app(instance), base_url=BASE_URL, raise_server_exceptions=False) as client:
        yield client


@settings(FUZZ, max_examples=20)
@given(
    body=raw_bodies
    | st.dictionaries(st.sampled_from(["query", "format", "timeout", "x"]), weird_json, max_size=4).map(_body_of),
    content_type=st.sampled_from(CONTENT_TYPES),
    params=st.dictionaries(st.sampled_from(["query", "format", "timeout"]), st.text(max_size=8), max_size=3),
)
@example(body=_deep(DEEP), content_type="application/json", params={})
@example(body=b"\xff\xfe", content_type="text/plain", params={})
@example(body=b"", content_type=None, params={"query": "SELECT 1", "timeout": "nan"})
def test_sql_answers_every_body_clearly(
    stopping_gateway: TestClient, body: bytes, content_type: str | None, params: dict[str, str]
) -> None:
    _assert_clear_answer(_post(stopping_gateway, "/v1/sql", body, content_type))
    _assert_clear_answer(stopping_gateway.get("/v1/sql", params=params))


# -- the LLM proxy ------------------------------------------------------------------------------

SERVED = "served-model"


@pytest.fixture(scope="module")
def proxy(fuzz_settings: Settings) -> Iterator[TestClient]:
    """The proxy's real app on an LLMProxy never started (no LiteLLM, no store client)."""
    from producers.llm_proxy import LLMProxy, ProxyOptions, create_app, model_list_of

    instance = LLMProxy(fuzz_settings, model_list_of([f"{SERVED}=http://127.0.0.1:9"]), ProxyOptions())
    with TestClient(create_app(instance), base_url=BASE_URL, raise_server_exceptions=False) as client:
        yield client


def _parsed(body: bytes) -> list[Any]:
    """What either JSON parser a route may use makes of ``body`` (none, one or both results)."""
    out = []
    for parse in (json.loads, pydantic_core.from_json):
        try:
            out.append(parse(body))
        except (ValueError, RecursionError):
            pass
    return out


def _not_forwarded(path: str, body: bytes) -> bytes:
    """A body the proxy would forward to its backend (a served model and the messages or prompt
    that path needs) asks for a model it does not serve instead: 404, before LiteLLM or any
    backend is involved. Every other refusal is reached unchanged."""
    for document in _parsed(body):
        if not isinstance(document, dict) or document.get("model") != SERVED:
            continue
        chat = path.endswith("chat/completions")
        if (chat and isinstance(document.get("messages"), list)) or (not chat and document.get("prompt") is not None):
            return json.dumps({**document, "model": "not-" + SERVED}).encode()
    return body


CHAT_KEYS = ["model", "messages", "prompt", "stream", "max_tokens", "n", "temperature", "logprobs", "stop"]


@settings(FUZZ, max_examples=20)
@given(
    path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
    body=raw_bodies
    | st.dictionaries(st.sampled_from(CHAT_KEYS), weird_json | st.just(SERVED), max_size=5).map(_body_of),
    content_type=st.sampled_from(CONTENT_TYPES),
)
@example(path="/v1/chat/completions", body=_deep(DEEP), content_type="application/json")
@example(path="/v1/completions", body=b'{"model": "x", "prompt": NaN}', content_type="application/json")
def test_llm_proxy_answers_every_body_clearly(
    proxy: TestClient, path: str, body: bytes, content_type: str | None
) -> None:
    _assert_clear_answer(_post(proxy, path, _not_forwarded(path, body), content_type), unavailable_ok=False)


# -- the inference server -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def inference() -> Iterator[tuple[Any, TestClient]]:
    """The inference server's real app and engine, with its tiny random policy, not following
    Kafka; two new tokens at most unless a request asks for more."""
    from consumers.inference import InferenceOptions, InferenceServer

    server = InferenceServer(None, InferenceOptions(follow=False, default_max_tokens=2))
    with TestClient(server.app, base_url=BASE_URL, raise_server_exceptions=False) as client:
        assert client.portal is not None
        engine = client.portal.start_task_soon(server.engine.run)
        try:
            yield server, client
        finally:
            engine.cancel()  # the portal waits for its tasks: the engine runs until cancelled


def _cheap(path: str, body: bytes) -> bytes:
    """A body the server would generate for, with at most two rows of two new tokens (what is
    checked before generation is untouched, so every refusal is still reached)."""
    from consumers.inference import ChatRequest, CompletionRequest

    model = ChatRequest if path.endswith("chat/completions") else CompletionRequest
    for document in _parsed(body):
        try:
            model.model_validate(document)
        except ValidationError:
            continue
        capped = {
            key: min(document[key], 2) for key in ("max_tokens", "max_completion_tokens", "n") if document.get(key)
        }
        prompt = document.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
            capped["prompt"] = prompt[:2]
        return json.dumps({**document, **capped}).encode()
    return body


_edge_floats = st.sampled_from([0.0, 5e-324, 1e-300, 1e-46, 1e-30, 0.5, 1.0, 2.0, 2.5, -0.0]) | st.floats(0, 2)
SAMPLING = {
    "temperature": _edge_floats,
    "top_p": _edge_floats,
    "max_tokens": st.integers(-1, 3),
    "n": st.integers(0, 3),
    "logprobs": st.integers(-1, 21),
    "top_logprobs": st.integers(-1, 21),
    "stop": st.text(max_size=2) | st.lists(st.text(max_size=2), max_size=2),
    "stop_token_ids": st.lists(st.integers(-1, 70), max_size=2),
    "seed": st.integers() | st.sampled_from([2**64, -(2**63)]),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
}
INFERENCE_KEYS = [*CHAT_KEYS, "top_logprobs", "top_p", "seed", "stop_token_ids", "echo", "suffix", "stream_options"]


@settings(FUZZ, max_examples=25)
@given(
    path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
    body=raw_bodies
    | st.dictionaries(st.sampled_from(INFERENCE_KEYS), weird_json, max_size=6).map(_body_of)
    | st.fixed_dictionaries(
        {"messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "x"]), "content": weird_json}))},
        optional={"prompt": weird_json, "max_tokens": weird_json, "n": weird_json},
    ).map(_body_of)
    | st.fixed_dictionaries(
        {"prompt": st.text(max_size=8) | st.lists(st.integers(-1, 70), max_size=4)}, optional=SAMPLING
    )
    .map(_body_of)
    .map(lambda body: body.replace(b"Infinity", b"1e999")),
    content_type=st.sampled_from(CONTENT_TYPES),
)
@example(path="/v1/chat/completions", body=_deep(DEEP), content_type="application/json")
@example(path="/v1/completions", body=b'{"prompt": [[1, 2], [-1]]}', content_type="application/json")
@example(path="/v1/completions", body=b'{"prompt": "x", "top_p": 1e-300}', content_type="application/json")  # was a 500
@example(
    path="/v1/completions", body=b'{"prompt": "x", "temperature": 1e-300}', content_type="application/json"
)  # same
@example(
    path="/v1/completions", body=b'{"prompt": "hi", "logprobs": 5, "stream": true}', content_type="application/json"
)
@example(
    path="/v1/chat/completions",
    body=b'{"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 3}',
    content_type="application/json",
)
def test_inference_server_answers_every_body_clearly(
    inference: tuple[Any, TestClient], path: str, body: bytes, content_type: str | None
) -> None:
    server, client = inference
    response = _post(client, path, _cheap(path, body), content_type)
    _assert_clear_answer(response, unavailable_ok=False)
    if response.status_code == 200:
        assert response.headers["x-agl-policy-version"] == str(server.policy.version)


def _chunks(size: int) -> Iterator[bytes]:
    """A body of ``size`` bytes sent chunked, without a Content-Length."""
    sent = 0
    while sent < size:
        chunk = b" " * min(1 << 20, size - sent)
        sent += len(chunk)
        yield chunk


def test_bodies_over_a_routes_limit_are_413_whether_declared_or_streamed(
    gateway: tuple[Any, TestClient], stopping_gateway: TestClient, proxy: TestClient, inference: tuple[Any, TestClient]
) -> None:
    from consumers.gateway import MAX_QUERY_BODY_BYTES
    from consumers.gateway_sql import MAX_SQL_BODY_BYTES

    json_type = {"content-type": "application/json"}
    declared = {**json_type, "content-length": str(64 << 20)}
    clients = {"/v1/tasks": gateway[1], "/v1/query": gateway[1], "/v1/traces": gateway[1], "/v1/sql": stopping_gateway}
    clients |= {"/v1/chat/completions": proxy, "/v1/completions": inference[1]}
    for path, client in clients.items():
        response = client.post(path, content=b"{}", headers=declared)
        assert response.status_code == 413 and response.json()["error"], (path, response.text)
    for path, client, limit in (
        ("/v1/sql", stopping_gateway, MAX_SQL_BODY_BYTES),
        ("/v1/query", gateway[1], MAX_QUERY_BODY_BYTES),
    ):
        response = client.post(path, content=_chunks(limit + 1), headers=json_type)
        assert response.status_code == 413 and response.json()["error"] == "too_large", (path, response.text)


def test_the_unstarted_collaborators_answer_valid_bodies_503(gateway: tuple[Any, TestClient]) -> None:
    """The harness itself: a valid task or span reaches the (unstarted) Kafka side and gets its
    503, so the fuzzed routes above did run their whole parsing path."""
    _, client = gateway
    response = client.post("/v1/tasks", json={"request_id": "req-1", "input": {"q": 1}})
    assert response.status_code == 503 and response.json()["error"] == "unavailable"
    span = PbSpan(trace_id=b"\x01" * 16, span_id=b"\x02" * 8, name="s", start_time_unix_nano=1)
    span.attributes.extend(
        [
            KeyValue(key=otlp.ROLLOUT_ID_KEY, value=AnyValue(string_value="ro-1")),
            KeyValue(key=otlp.ATTEMPT_ID_KEY, value=AnyValue(string_value="at-1")),
        ]
    )
    request = ExportTraceServiceRequest(resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(spans=[span])])])
    response = _post(client, "/v1/traces", request.SerializeToString(), otlp.PROTOBUF)
    assert response.status_code == 503
