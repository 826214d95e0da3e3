"""The codec: round trips, the single-object framing, typed errors, library independence."""

from __future__ import annotations

import copy
import io
import json
import re
import warnings
from typing import Any

import avro.io
import avro.schema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agl_stream.errors import (
    CodecError,
    MalformedRecordError,
    NotSingleObjectEncodedError,
    RecordTypeError,
    UnknownFingerprintError,
)
from agl_stream.models import (
    AVRO_CONTEXT,
    LLM,
    RECORD_MODELS,
    TYPE_KEY,
    AglModel,
    AttemptHeartbeat,
    ModelCheckpoint,
    PromptTemplate,
    ProxyLLM,
    ResourcesUpdate,
    Rollout,
    RolloutEnqueued,
    RolloutEvent,
    Span,
    TaskRequest,
)
from agl_stream.wire.codec import HEADER_SIZE, MAGIC, Codec, _may_not_reencode, dump_json
from agl_stream.wire.contract import Contract, canonical_form
from tests.unit.test_models import model_strategy, typed

CODEC = Codec.default()


def span_dict(**overrides: Any) -> dict[str, Any]:
    span: dict[str, Any] = {
        "rollout_id": "ro-0123456789ab",
        "attempt_id": "at-01234567",
        "sequence_id": 3,
        "trace_id": "0af7651916cd43dd8448eb211c80319c",
        "span_id": "b7ad6b7169203331",
        "parent_id": None,
        "name": "openai.chat.completion",
        "kind": "CLIENT",
        "status": {"status_code": "OK", "description": None},
        "attributes": {
            "gen_ai.system": "openai",
            "gen_ai.usage.input_tokens": 12,
            "gen_ai.request.temperature": 1.0,
            "stream": False,
            "prompt_token_ids": [1, 2, 3],
            "agentlightning.reward.0.value": 0.5,
            "nothing": None,
            "mixed": [True, 1, 1.0, "1", None],
        },
        "events": [{"name": "e", "attributes": {"k": 1}, "timestamp": 1.5}],
        "links": [
            {
                "context": {
                    "trace_id": "1" * 32,
                    "span_id": "2" * 16,
                    "is_remote": True,
                    "trace_state": {"v": "1"},
                },
                "attributes": {"flag": True},
            }
        ],
        "start_time": 1_767_225_600.25,
        "end_time": 1_767_225_601.0,
        "context": {
            "trace_id": "0af7651916cd43dd8448eb211c80319c",
            "span_id": "b7ad6b7169203331",
            "is_remote": False,
            "trace_state": {},
        },
        "parent": None,
        "resource": {"attributes": {"service.name": "agent"}, "schema_url": ""},
        "scope_name": "scope",
        "scope_version": "1",
    }
    span.update(overrides)
    return span


# --------------------------------------------------------------------------------------------
# Round trips
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", RECORD_MODELS, ids=lambda m: m.__name__)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_record_round_trips(model: type[AglModel], data: st.DataObject) -> None:
    record = data.draw(model_strategy(model))
    encoded = CODEC.encode(record)
    assert encoded[:2] == MAGIC
    assert int.from_bytes(encoded[2:HEADER_SIZE], "little") == CODEC.fingerprint(model.avro_name)
    decoded = CODEC.decode(encoded, model)
    assert decoded == record
    assert typed(decoded) == typed(record)  # True, 1 and 1.0 stay apart
    # Replays must be byte-identical.
    assert CODEC.encode(decoded) == encoded
    # The dict path gives the same bytes and the same values.
    assert CODEC.encode_dict(model.avro_name, record.model_dump(context=AVRO_CONTEXT)) == encoded
    name, datum = CODEC.decode_dict(encoded)
    assert name == model.avro_name
    assert model.model_validate(datum) == record
    assert CODEC.encode_dict(name, datum) == encoded


_scalars = (
    st.sampled_from([True, False, 0, 1, -1, 0.0, 1.0, -0.0, 2**63 - 1, -(2**63)])
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=5)
    | st.none()
)
_attribute_values = _scalars | st.lists(_scalars, max_size=6)


@settings(max_examples=300, deadline=None)
@given(attributes=st.dictionaries(st.text(max_size=6), _attribute_values))
def test_attribute_values_keep_their_types_on_the_dict_path(attributes: dict[str, Any]) -> None:
    span = span_dict(attributes=attributes)
    before = copy.deepcopy(span)
    encoded = CODEC.encode_dict("agl.Span", span)
    assert span == before and typed(span) == typed(before)  # the input is not modified
    _, decoded = CODEC.decode_dict(encoded)
    assert typed(decoded["attributes"]) == typed(attributes)
    assert CODEC.encode_dict("agl.Span", decoded) == encoded


def test_bool_int_float_edge_cases() -> None:
    attributes = {
        "true": True,
        "false": False,
        "zero": 0,
        "one": 1,
        "one_float": 1.0,
        "zero_float": 0.0,
        "max": 2**63 - 1,
        "min": -(2**63),
        "inf": float("inf"),
        "bools": [True, False],
        "ints": [0, 1],
        "floats": [0.0, 1.0],
        "mixed": [True, 1, 1.0, "True", None],
        "empty": [],
    }
    _, decoded = CODEC.decode_dict(CODEC.encode_dict("agl.Span", span_dict(attributes=attributes)))
    assert typed(decoded["attributes"]) == typed(attributes)
    model = Span.model_validate(span_dict(attributes=attributes))
    assert typed(CODEC.decode(CODEC.encode(model), Span).attributes) == typed(attributes)


def test_nan_attribute_survives() -> None:
    _, decoded = CODEC.decode_dict(CODEC.encode_dict("agl.Span", span_dict(attributes={"x": float("nan")})))
    value = decoded["attributes"]["x"]
    assert isinstance(value, float) and value != value


def test_unions_of_records_carry_their_name() -> None:
    rollout = Rollout(rollout_id="ro-1", input={"q": "2+2"}, start_time=1.0)
    event = RolloutEvent(
        event_id="e-1",
        rollout_id="ro-1",
        time=2.0,
        writer="test",
        payload=RolloutEnqueued(rollout=rollout),
    )
    encoded = CODEC.encode(event)
    name, datum = CODEC.decode_dict(encoded)
    assert name == "agl.RolloutEvent"
    assert datum["payload"][TYPE_KEY] == "agl.RolloutEnqueued"
    # fastavro's tuple notation is accepted too, and gives the same bytes.
    plain = event.model_dump()
    plain["payload"] = ("agl.RolloutEnqueued", plain["payload"])
    assert CODEC.encode_dict("agl.RolloutEvent", plain) == encoded
    # Without a name, fastavro would pick a branch by shape: refused.
    untagged = event.model_dump()
    with pytest.raises(CodecError, match="needs a '-type' key"):
        CODEC.encode_dict("agl.RolloutEvent", untagged)
    with pytest.raises(CodecError, match="not one of"):
        CODEC.encode_dict("agl.RolloutEvent", {**untagged, "payload": {**untagged["payload"], TYPE_KEY: "agl.Nope"}})


def test_resources_of_identical_shape_keep_their_type() -> None:
    update = ResourcesUpdate(
        resources_id="rs-0123456789ab",
        create_time=1.0,
        update_time=1.0,
        version=2,
        resources={
            "proxy": ProxyLLM(endpoint="http://p/v1", model="m"),
            "llm": LLM(endpoint="http://l/v1", model="m", sampling_parameters={"temperature": 0.7}),
            "prompt": PromptTemplate(template="{x}", engine="f-string"),
            "ckpt": ModelCheckpoint(uri="/ckpt/3", model="m", policy_version=3),
        },
    )
    decoded = CODEC.decode(CODEC.encode(update), ResourcesUpdate)
    assert decoded == update
    assert {k: type(v) for k, v in decoded.resources.items()} == {
        "proxy": ProxyLLM,
        "llm": LLM,
        "prompt": PromptTemplate,
        "ckpt": ModelCheckpoint,
    }


def test_json_fields_are_written_deterministically() -> None:
    a = TaskRequest(request_id="r", input={"b": 1, "a": [1, {"d": 2, "c": 3}]}, metadata={"y": 1, "x": 2})
    b = TaskRequest(request_id="r", input={"a": [1, {"c": 3, "d": 2}], "b": 1}, metadata={"x": 2, "y": 1})
    assert CODEC.encode(a) == CODEC.encode(b)
    assert b'{"a":[1,{"c":3,"d":2}],"b":1}' in CODEC.encode(a)
    assert dump_json({"é": 1.5}) == '{"é":1.5}'


def test_json_fields_refuse_what_json_cannot_say() -> None:
    with pytest.raises(CodecError, match=r"agl\.TaskRequest"):
        CODEC.encode(TaskRequest(request_id="r", input={"x": float("nan")}))
    with pytest.raises(CodecError):
        CODEC.encode(TaskRequest(request_id="r", input={"x": object()}))


# --------------------------------------------------------------------------------------------
# Framing and typed errors
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc3",
        b"\xc3\x01\x00\x00",
        MAGIC + bytes(7),
        b'{"rollout_id": "ro-1"}',
        b"\xc3\x02" + bytes(20),
        b"\x00" * 30,
    ],
    ids=["empty", "one byte", "short header", "9 bytes", "json", "wrong version", "zeros"],
)
def test_not_single_object_encoded(data: bytes) -> None:
    with pytest.raises(NotSingleObjectEncodedError):
        CODEC.decode_dict(data)
    with pytest.raises(NotSingleObjectEncodedError):
        CODEC.decode(data, Span)


def test_unknown_fingerprint() -> None:
    good = CODEC.encode_dict("agl.Span", span_dict())
    unknown = 0x0123456789ABCDEF
    data = MAGIC + unknown.to_bytes(8, "little") + good[HEADER_SIZE:]
    with pytest.raises(UnknownFingerprintError) as info:
        CODEC.decode_dict(data)
    assert info.value.fingerprint == unknown
    assert "0x0123456789abcdef" in str(info.value)


def test_every_truncation_is_malformed() -> None:
    good = CODEC.encode_dict("agl.Span", span_dict())
    for end in range(HEADER_SIZE, len(good)):
        with pytest.raises(MalformedRecordError):
            CODEC.decode_dict(good[:end])


@pytest.mark.parametrize("extra", [b"\x00", b"garbage", bytes(100)])
def test_trailing_bytes_are_malformed(extra: bytes) -> None:
    good = CODEC.encode(AttemptHeartbeat(attempt_id="at-1"))
    with pytest.raises(MalformedRecordError, match="after the end"):
        CODEC.decode_dict(good + extra)


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(sorted(CODEC.contract.current)),
    body=st.binary(max_size=64),
)
def test_garbage_bodies_fail_only_with_codec_errors(name: str, body: bytes) -> None:
    data = CODEC.contract.current[name].header + body
    try:
        CODEC.decode_dict(data)
    except CodecError:
        pass
    model = CODEC.models.get(name)
    if model is not None:
        try:
            CODEC.decode(data, model)
        except CodecError:
            pass


def test_invalid_json_text_is_malformed() -> None:
    schema = _parse_with_avro(CODEC.contract.schema("TaskRequest").expanded)
    body = _avro_write(schema, _external_task_request(input="{not json"))
    with pytest.raises(MalformedRecordError, match="JSONDecodeError"):
        CODEC.decode_dict(CODEC.contract.schema("TaskRequest").header + body)


def test_wrong_record_type() -> None:
    data = CODEC.encode(AttemptHeartbeat(attempt_id="at-1"))
    with pytest.raises(RecordTypeError, match=r"expected a agl\.Span"):
        CODEC.decode(data, Span)


def test_validation_failure_on_decode_is_malformed() -> None:
    data = CODEC.encode_dict("agl.Span", span_dict(trace_id=""))
    assert CODEC.decode_dict(data)[1]["trace_id"] == ""
    with pytest.raises(MalformedRecordError, match="trace_id"):
        CODEC.decode(data, Span)


def test_encode_errors_are_codec_errors() -> None:
    with pytest.raises(CodecError, match="no schema named"):
        CODEC.encode_dict("agl.Nope", {})
    broken = span_dict()
    del broken["rollout_id"]
    with pytest.raises(CodecError, match=r"agl\.Span"):
        CODEC.encode_dict("agl.Span", broken)
    with pytest.raises(CodecError):
        CODEC.encode_dict("agl.Span", span_dict(sequence_id="three"))


# --------------------------------------------------------------------------------------------
# Library independence: the official avro package, and CRC-64-AVRO from the spec
# --------------------------------------------------------------------------------------------


def _external_task_request(**overrides: Any) -> dict[str, Any]:
    datum: dict[str, Any] = {
        "request_id": "req-42",
        "input": '{"question": "2+2?", "answer": 4}',
        "mode": "train",
        "resources_id": None,
        "config": {
            "timeout_seconds": 30.0,
            "unresponsive_seconds": None,
            "max_attempts": 3,
            "retry_condition": ["failed", "timeout"],
        },
        "metadata": '{"source": "crm"}',
        "request_time": 1_767_225_600.5,
    }
    datum.update(overrides)
    return datum


def _avro_write(schema: avro.schema.Schema, datum: dict[str, Any]) -> bytes:
    out = io.BytesIO()
    avro.io.DatumWriter(schema).write(datum, avro.io.BinaryEncoder(out))
    return out.getvalue()


def _avro_read(schema: avro.schema.Schema, body: bytes) -> Any:
    return avro.io.DatumReader(schema, schema).read(avro.io.BinaryDecoder(io.BytesIO(body)))


def _parse_with_avro(schema_json: dict[str, Any]) -> avro.schema.Schema:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # avro warns that it does not know logicalType json
        return avro.schema.parse(json.dumps(schema_json))


def test_task_request_written_by_the_avro_package_decodes() -> None:
    """What an external producer does: the published schema, any Avro library, a header."""
    expanded = CODEC.contract.schema("TaskRequest").expanded
    schema = _parse_with_avro(expanded)
    fingerprint = CODEC.fingerprint("agl.TaskRequest")
    data = b"\xc3\x01" + fingerprint.to_bytes(8, "little") + _avro_write(schema, _external_task_request())
    request = CODEC.decode(data, TaskRequest)
    assert request.input == {"question": "2+2?", "answer": 4}
    assert request.metadata == {"source": "crm"}
    assert request.mode == "train"
    assert request.config is not None and request.config.retry_condition == ["failed", "timeout"]
    assert request.request_time == 1_767_225_600.5


def test_avro_package_reads_our_bytes() -> None:
    request = TaskRequest(request_id="r-1", input=["a", 1, None], mode="val", request_time=2.5)
    encoded = CODEC.encode(request)
    schema = _parse_with_avro(CODEC.contract.schema("TaskRequest").expanded)
    datum = _avro_read(schema, encoded[HEADER_SIZE:])
    assert datum["request_id"] == "r-1"
    assert json.loads(datum["input"]) == ["a", 1, None]
    assert datum["mode"] == "val" and datum["metadata"] is None and datum["request_time"] == 2.5


def test_avro_package_reads_spans() -> None:
    encoded = CODEC.encode_dict("agl.Span", span_dict())
    schema = _parse_with_avro(CODEC.contract.schema("Span").expanded)
    datum = _avro_read(schema, encoded[HEADER_SIZE:])
    assert typed(datum["attributes"]) == typed(span_dict()["attributes"])


EMPTY = 0xC15D213AA4D7A795


def _crc64_avro(data: bytes) -> int:
    """CRC-64-AVRO exactly as the Avro specification describes it."""
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (EMPTY & -(fp & 1))
        table.append(fp)
    fp = EMPTY
    for byte in data:
        fp = (fp >> 8) ^ table[(fp ^ byte) & 0xFF]
    return fp


@pytest.mark.parametrize("name", ["TaskRequest", "Span", "RolloutEvent", "WorkerStatus"])
def test_fingerprint_matches_an_independent_crc64(name: str) -> None:
    schema = CODEC.contract.schema(name)
    assert _crc64_avro(canonical_form(schema.expanded).encode("utf-8")) == schema.fingerprint
    assert schema.header == b"\xc3\x01" + schema.fingerprint.to_bytes(8, "little")


def test_crc64_spec_vectors() -> None:
    # Reference values (Java longs) from the Avro test suite, share/test/data/schema-tests.txt.
    assert _crc64_avro(b'"null"') == 7195948357588979594
    assert _crc64_avro(b'"int"') == 8247732601305521295
    assert _crc64_avro(b'"boolean"') == -6970731678124411036 % 2**64


@pytest.mark.parametrize("name", ["DlqRecord", "TaskRequest", "Span"])
def test_canonical_form_matches_the_avro_package(name: str) -> None:
    """The avro package computes its own canonical form. It keeps logicalType on primitives
    (against the spec), so compare on a copy without logical types; stripping them must not
    change our fingerprint, because the canonical form drops them."""
    schema = CODEC.contract.schema(name)
    stripped = json.loads(json.dumps(schema.expanded).replace(', "logicalType": "json"', ""))
    assert "logicalType" not in json.dumps(stripped)
    theirs = _parse_with_avro(stripped)
    assert theirs.fingerprint("CRC-64-AVRO") == schema.fingerprint.to_bytes(8, "little")
    assert json.loads(theirs.canonical_form) == json.loads(schema.canonical)


def test_every_bundled_schema_parses_in_the_avro_package() -> None:
    for schema in Contract.load().current.values():
        _parse_with_avro(schema.expanded)


_ONE_PATTERN = re.compile(r"\\u[dD][89a-fA-F]|[eE]\+?\d{3}|\d{300}")


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.sampled_from(["\\ud800", "\\uDFFF", "\\u00e9", "e", "E+", "1", "9" * 150, "x", '"', "\\\\", "e+30", "E308"]),
        max_size=12,
    ).map("".join)
)
def test_the_json_reencode_check_flags_exactly_what_one_search_for_all_three_cases_would(text: str) -> None:
    """The check before re-encoding a decoded JSON field (three plain searches, two skipped when
    they cannot match) flags the same texts as one search for a surrogate escape, a three-digit
    exponent or 300 digits."""
    assert _may_not_reencode(text) == (_ONE_PATTERN.search(text) is not None)
