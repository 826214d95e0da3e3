"""The compiled Avro writers write fastavro's bytes, or decline and leave the record to fastavro."""

from __future__ import annotations

import io
from typing import Any

import pytest
from fastavro import schemaless_writer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agl_stream.errors import CodecError
from agl_stream.models import (
    AVRO_CONTEXT,
    RECORD_MODELS,
    AglModel,
    Attempt,
    AttemptStarted,
    Reply,
    Rollout,
    RolloutEnqueued,
    RolloutEvent,
    RolloutState,
)
from agl_stream.wire.avro_writer import Declined, compile_writer
from agl_stream.wire.codec import Codec, dump_json
from tests.unit.test_models import model_strategy

CODEC = Codec.default()
JSON = {"string-json": dump_json}


def _fastavro(avro_name: str, datum: Any) -> bytes:
    writer = CODEC._writer(avro_name)
    out = io.BytesIO()
    schemaless_writer(out, writer.parsed, writer.prepare(datum) if writer.prepare is not None else datum)
    return out.getvalue()


def _datum(record: AglModel) -> Any:
    return record.model_dump(context=AVRO_CONTEXT)


@pytest.mark.parametrize("model", RECORD_MODELS, ids=lambda m: m.__name__)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_compiled_writer_writes_fastavros_bytes_or_declines(model: type[AglModel], data: st.DataObject) -> None:
    datum = _datum(data.draw(model_strategy(model)))
    try:
        compiled = compile_writer(CODEC._writer(model.avro_name).parsed, JSON)
    except Declined:  # a schema with a type it does not write: the codec never tries it
        assert CODEC._writer(model.avro_name).compiled is None
        return
    try:
        written = compiled(datum)
    except Declined:
        return
    assert written == _fastavro(model.avro_name, datum)


_ROLLOUT = Rollout(
    rollout_id="ro-1", input={"q": "2+2?", "n": [1, 2.5, None]}, start_time=1.5, mode="train",
    resources_id="rs-1", metadata={},
)  # fmt: skip
_ATTEMPT = Attempt(rollout_id="ro-1", attempt_id="at-1", sequence_id=1, start_time=2.0, worker_id="w")


@pytest.mark.parametrize(
    "record",
    [
        RolloutEvent(event_id="e1", rollout_id="ro-1", time=1.5, writer="c", payload=RolloutEnqueued(rollout=_ROLLOUT)),
        RolloutEvent(event_id="e2", rollout_id="ro-1", time=2.0, writer="c", payload=AttemptStarted(attempt=_ATTEMPT)),
        RolloutState(
            rollout=_ROLLOUT,
            attempts=[_ATTEMPT],
            version=2,
            cause_event_id="e2",
            cause_time=2.0,
            next_sequence_ids={"at-1": 3},
            span_counts={"at-1": 2},
            watchers=["agl.replies.c"],
        ),
        Reply(request_id="e1", outcome="applied", state_partition=0, state_offset=7),
    ],
    ids=lambda r: type(r).__name__,
)
def test_the_stores_records_take_the_compiled_path(record: AglModel) -> None:
    """What the store writes on every call is written without fastavro (or the speed is lost)."""
    datum = _datum(record)
    written = compile_writer(CODEC._writer(record.avro_name).parsed, JSON)(datum)
    assert written == _fastavro(record.avro_name, datum)
    assert CODEC.encode(record) == CODEC._writer(record.avro_name).header + written


def _with(datum: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    inner = datum
    for key in path[:-1]:
        inner = inner[key]
    inner[path[-1]] = value
    return datum


class _Text(str):
    pass


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("time",), 2),  # an int where a double goes: fastavro writes it as one
        (("payload", "rollout", "start_time"), True),
        (("payload", "rollout", "rollout_id"), _Text("ro-1")),  # a subclass: fastavro's rules
        (("payload", "rollout", "rollout_id"), "\ud800"),  # not Unicode: fastavro's error
        (("payload", "rollout", "config", "max_attempts"), 2**31),  # out of an Avro int
        (("payload", "rollout", "mode"), "nope"),  # not a symbol of the enum
        (("payload", "rollout", "input"), float("nan")),  # JSON cannot say it
        (("payload", "-type"), "agl.Nope"),
        (("payload",), ("agl.RolloutEnqueued",)),
    ],
)
def test_what_a_compiled_writer_is_not_sure_of_goes_to_fastavro(path: tuple[str, ...], value: Any) -> None:
    datum = _with(_datum(RolloutEvent(event_id="e", rollout_id="ro-1", time=1.0, writer="c",
                                      payload=RolloutEnqueued(rollout=_ROLLOUT))), path, value)  # fmt: skip
    with pytest.raises(Declined):
        compile_writer(CODEC._writer("agl.RolloutEvent").parsed, JSON)(datum)
    try:
        expected = CODEC._writer("agl.RolloutEvent").header + _fastavro("agl.RolloutEvent", datum)
    except Exception:  # fastavro (or the codec's tag check) refuses it: the codec says so, as before
        with pytest.raises(CodecError):
            CODEC.encode_dict("agl.RolloutEvent", datum)
        return
    assert CODEC.encode_dict("agl.RolloutEvent", datum) == expected


def test_a_missing_field_is_left_to_fastavros_default() -> None:
    datum = _datum(_ROLLOUT)
    del datum["end_time"]  # defaulted in the schema: fastavro fills it in
    with pytest.raises(Declined):
        compile_writer(CODEC._writer("agl.Rollout").parsed, JSON)(datum)
    assert CODEC.encode_dict("agl.Rollout", datum) == CODEC.encode(_ROLLOUT)


def test_only_schemas_with_a_type_the_writers_do_not_write_go_straight_to_fastavro() -> None:
    """The spans' attribute values are a union of primitives and arrays, which the compiled
    writers leave to fastavro's search: those schemas are refused when compiled (not tried and
    declined on every record); every other record type has a compiled writer."""
    refused = {name for name in CODEC._writers if CODEC._writer(name).compiled is None}
    assert refused == {"agl.OtelResource", "agl.Span", "agl.SpanBatch", "agl.SpanEvent", "agl.SpanLink"}
    with pytest.raises(Declined):
        compile_writer(["string", "long"], JSON)
