"""The pydantic models mirror the Avro schemas, and their own rules hold.

This module also builds hypothesis strategies for every model from its field annotations
(``model_strategy``); the codec tests import them.
"""

from __future__ import annotations

import json
import re
import types
import typing
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, StringConstraints, ValidationError
from pydantic.fields import FieldInfo

from agl_stream import ids
from agl_stream.models import (
    LLM,
    MODELS,
    RECORD_MODELS,
    TYPE_KEY,
    AglModel,
    AttemptUpdated,
    ProxyLLM,
    ResourcesUpdate,
    Rollout,
    RolloutCancelled,
    RolloutEvent,
    RolloutUpdated,
    Span,
    SpanContext,
    UnionMember,
)
from agl_stream.wire.contract import Contract

INT64 = (-(2**63), 2**63 - 1)

# --------------------------------------------------------------------------------------------
# Strategies built from the models
# --------------------------------------------------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(*INT64)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
"""Any JSON value; bool, int and float kept apart (True, 1 and 1.0 all occur)."""

edge_numbers = st.sampled_from([True, False, 0, 1, -1, 0.0, 1.0, -0.0, 2**63 - 1, -(2**63), 1e300])
attribute_scalars = (
    edge_numbers | st.booleans() | st.integers(*INT64) | st.floats(allow_nan=False) | st.text(max_size=12) | st.none()
)
attribute_values = attribute_scalars | st.lists(attribute_scalars, max_size=5)
"""OpenTelemetry attribute values, with the bool / int / float edge cases on purpose."""


def _partial_update(model: type[RolloutUpdated] | type[AttemptUpdated]) -> st.SearchStrategy[Any]:
    """RolloutUpdated / AttemptUpdated: a random subset of fields set, through ``of``."""

    @st.composite
    def build(draw: st.DrawFn) -> Any:
        chosen = draw(st.lists(st.sampled_from(model.updatable), unique=True))
        changes: dict[str, Any] = {}
        for name in chosen:
            info = model.model_fields[name]
            value = draw(_for_annotation(info.annotation, info.metadata))
            if value is None and name in model.not_nullable:
                continue
            changes[name] = value
        if model is AttemptUpdated:
            return AttemptUpdated.of(draw(st.text(max_size=12)), **changes)
        return RolloutUpdated.of(**changes)

    return build()


OVERRIDES: dict[type[BaseModel], st.SearchStrategy[Any]] = {}


def model_strategy(model: type[BaseModel]) -> st.SearchStrategy[Any]:
    """Instances of ``model`` with every field drawn from a strategy for its annotation."""
    if model in OVERRIDES:
        return OVERRIDES[model]
    if model in (RolloutUpdated, AttemptUpdated):
        return _partial_update(model)  # type: ignore[arg-type]
    fields = {name: _for_field(info) for name, info in model.model_fields.items()}
    return st.deferred(lambda: st.builds(model, **fields))


def _for_field(info: FieldInfo) -> st.SearchStrategy[Any]:
    return st.deferred(lambda: _for_annotation(info.annotation, info.metadata))


def _for_annotation(annotation: Any, metadata: list[Any]) -> st.SearchStrategy[Any]:
    if annotation is typing.Any:
        return json_values
    if annotation is type(None) or annotation is None:
        return st.none()
    origin = get_origin(annotation)
    if origin is Annotated:
        base, *extra = get_args(annotation)
        return _for_annotation(base, [*metadata, *extra])
    if origin is Literal:
        return st.sampled_from(get_args(annotation))
    if origin in (Union, types.UnionType):
        branches = get_args(annotation)
        scalar_like = {get_origin(b) or b for b in branches}
        if list in scalar_like and bool in {_strip(b) for b in branches}:
            return attribute_values
        return st.one_of(*[_for_annotation(b, metadata) for b in branches])
    if origin is list:
        (item,) = get_args(annotation)
        return st.lists(_for_annotation(item, []), max_size=4)
    if origin is dict:
        _, value = get_args(annotation)
        return st.dictionaries(st.text(max_size=10), _for_annotation(value, []), max_size=4)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return model_strategy(annotation)
    if annotation is bool:
        return st.booleans()
    if annotation is int:
        lo, hi = INT64
        for item in _flat(metadata):
            if isinstance(item, annotated_types.Ge):
                lo = max(lo, int(item.ge))  # type: ignore[call-overload]
            if isinstance(item, annotated_types.Le):
                hi = min(hi, int(item.le))  # type: ignore[call-overload]
        return st.integers(lo, hi)
    if annotation is float:
        lo_f: float | None = None
        hi_f: float | None = None
        for item in _flat(metadata):
            if isinstance(item, annotated_types.Ge):
                lo_f = float(item.ge)  # type: ignore[arg-type]
            if isinstance(item, annotated_types.Le):
                hi_f = float(item.le)  # type: ignore[arg-type]
        bounded = lo_f is not None or hi_f is not None
        return st.floats(min_value=lo_f, max_value=hi_f, allow_nan=False, allow_infinity=not bounded)
    if annotation is str:
        for item in metadata:
            if isinstance(item, StringConstraints) and item.pattern:
                return st.from_regex(str(item.pattern), fullmatch=True)
            if isinstance(item, StringConstraints):
                return st.text(min_size=item.min_length or 0, max_size=min(item.max_length or 16, 16))
        return st.text(max_size=16)
    if annotation is bytes:
        return st.binary(max_size=32)
    raise NotImplementedError(f"no strategy for {annotation!r}")


def _flat(metadata: list[Any]) -> list[Any]:
    """Constraints, with those inside a ``Field(...)`` of an ``Annotated`` type taken out."""
    return [m for item in metadata for m in (item.metadata if isinstance(item, FieldInfo) else [item])]


def _strip(annotation: Any) -> Any:
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return annotation


def typed(value: Any) -> Any:
    """A structure that compares equal only if types match too (True != 1 != 1.0)."""
    if isinstance(value, BaseModel):
        return (type(value).__name__, typed(value.model_dump()))
    if isinstance(value, dict):
        return {k: typed(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [typed(v) for v in value]
    return (type(value).__name__, value)


# --------------------------------------------------------------------------------------------
# Models mirror schemas
# --------------------------------------------------------------------------------------------

CONTRACT = Contract.load()


def _avro_record(name: str) -> dict[str, Any]:
    return CONTRACT.schema(name).expanded


def test_every_record_schema_has_a_model_and_back() -> None:
    record_schemas = {n for n, s in CONTRACT.current.items() if s.expanded["type"] == "record"}
    assert record_schemas == set(MODELS)
    assert len(RECORD_MODELS) == len(MODELS)


@pytest.mark.parametrize("model", RECORD_MODELS, ids=lambda m: m.__name__)
def test_model_fields_are_the_schema_fields(model: type[AglModel]) -> None:
    schema = _avro_record(model.avro_name)
    assert set(model.model_fields) == {f["name"] for f in schema["fields"]}
    assert model.model_config.get("extra") == "forbid"


def _enum_symbols(field_type: Any) -> list[str] | None:
    branches = field_type if isinstance(field_type, list) else [field_type]
    for branch in branches:
        if isinstance(branch, dict) and branch.get("type") == "enum":
            return list(branch["symbols"])
        if isinstance(branch, str) and branch.startswith("agl."):
            target = CONTRACT.current.get(branch)
            if target is not None and target.expanded["type"] == "enum":
                return list(target.expanded["symbols"])
    return None


@pytest.mark.parametrize("model", RECORD_MODELS, ids=lambda m: m.__name__)
def test_literal_statuses_are_the_avro_enum_symbols(model: type[AglModel]) -> None:
    schema = _avro_record(model.avro_name)
    for fld in schema["fields"]:
        symbols = _enum_symbols(fld["type"])
        if symbols is None:
            continue
        annotation = model.model_fields[fld["name"]].annotation
        literals = [a for a in get_args(annotation) if get_origin(a) is Literal] or [annotation]
        assert list(get_args(literals[0])) == symbols, f"{model.__name__}.{fld['name']}"


@pytest.mark.parametrize("model", RECORD_MODELS, ids=lambda m: m.__name__)
def test_python_defaults_are_the_avro_defaults(model: type[AglModel]) -> None:
    schema = _avro_record(model.avro_name)
    for fld in schema["fields"]:
        info = model.model_fields[fld["name"]]
        if "default" not in fld:
            continue
        assert not info.is_required(), f"{model.__name__}.{fld['name']} has an Avro default"
        default = info.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            default = default.model_dump()
        avro_default = fld["default"]
        ftype = fld["type"]
        if isinstance(ftype, dict) and ftype.get("logicalType") == "json":
            avro_default = json.loads(avro_default)
        assert default == avro_default, f"{model.__name__}.{fld['name']}"


def test_unknown_fields_are_rejected() -> None:
    with pytest.raises(ValidationError):
        RolloutCancelled.model_validate({"reason": None, "extra": 1})


def test_span_attribute_types_survive_validation() -> None:
    span = Span(
        rollout_id="ro-1",
        attempt_id="at-1",
        sequence_id=1,
        trace_id="0" * 32,
        span_id="1" * 16,
        name="x",
        attributes={"t": True, "one": 1, "onef": 1.0, "l": [False, 0, 0.0, "0", None]},
    )
    assert typed(span.attributes) == typed({"t": True, "one": 1, "onef": 1.0, "l": [False, 0, 0.0, "0", None]})
    # Beyond int64 an int becomes a double, as fastavro's union writer does on the dict path.
    big = Span.model_validate({**span.model_dump(), "attributes": {"big": 2**64}})
    assert typed(big.attributes) == {"big": ("float", 2.0**64)}
    # Ids: any text of 1 to 128 characters, as the seed takes (OpenTelemetry's are hex).
    assert Span.model_validate({**span.model_dump(), "trace_id": "XYZ"}).trace_id == "XYZ"
    with pytest.raises(ValidationError):
        Span.model_validate({**span.model_dump(), "trace_id": ""})
    with pytest.raises(ValidationError):
        SpanContext(trace_id="0" * 32, span_id="A" * 129)


def test_partial_updates_keep_unset_apart_from_null() -> None:
    update = RolloutUpdated.of(metadata=None, status="running")
    assert update.set_fields == ["status", "metadata"]
    assert update.changes() == {"status": "running", "metadata": None}
    assert RolloutUpdated.of().changes() == {}
    with pytest.raises(ValidationError, match="in set_fields but null"):
        RolloutUpdated.of(status=None)
    with pytest.raises(ValidationError, match="not in set_fields"):
        RolloutUpdated(status="running")
    with pytest.raises(ValidationError, match="cannot set"):
        RolloutUpdated(set_fields=["rollout_id"])
    with pytest.raises(ValidationError, match="repeats"):
        RolloutUpdated(set_fields=["mode", "mode"])
    with pytest.raises(ValueError, match="cannot set"):
        AttemptUpdated.of("at-1", input=1)
    attempt = AttemptUpdated.of("at-00000001", end_time=None, status="failed")
    assert attempt.changes() == {"status": "failed", "end_time": None}


def test_union_members_tag_only_in_the_avro_context() -> None:
    event = RolloutEvent(
        event_id=ids.new_event_id(),
        rollout_id="ro-1",
        time=1.0,
        writer="w",
        payload=RolloutCancelled(reason="r"),
    )
    assert TYPE_KEY not in event.model_dump()["payload"]
    dumped = event.model_dump(context={"avro": True})
    assert dumped["payload"][TYPE_KEY] == "agl.RolloutCancelled"
    assert RolloutEvent.model_validate(dumped) == event
    # The tag, not the shape, picks the record.
    other = {**dumped, "payload": {TYPE_KEY: "agl.SpanSequenceRequested", "attempt_id": "at-1"}}
    assert RolloutEvent.model_validate(other).payload.avro_name == "agl.SpanSequenceRequested"
    with pytest.raises(ValidationError):
        RolloutEvent.model_validate({**dumped, "payload": {"reason": "untagged"}})
    with pytest.raises(ValidationError, match="cannot be a"):
        RolloutCancelled.model_validate({TYPE_KEY: "agl.WatchdogFired", "reason": None})


def test_resources_discriminate_on_resource_type() -> None:
    update = ResourcesUpdate.model_validate(
        {
            "resources_id": "rs-1",
            "create_time": 1,
            "update_time": 2,
            "version": 1,
            "resources": {
                "a": {"resource_type": "proxy_llm", "endpoint": "http://h:1/v1", "model": "m"},
                "b": {"resource_type": "llm", "endpoint": "http://h:2", "model": "m"},
            },
        }
    )
    assert isinstance(update.resources["a"], ProxyLLM)
    assert isinstance(update.resources["b"], LLM)
    assert update.resources["a"].get_base_url("ro-1", "at-2") == "http://h:1/rollout/ro-1/attempt/at-2/v1"
    assert all(issubclass(m, UnionMember) for m in (LLM, ProxyLLM))


def test_ids_have_the_seed_shapes() -> None:
    rollout, attempt, resources = ids.new_rollout_id(), ids.new_attempt_id(), ids.new_resources_id()
    assert ids.is_rollout_id(rollout) and len(rollout) == 15
    assert re.fullmatch(r"at-[0-9a-f]{8}", attempt) and re.fullmatch(r"rs-[0-9a-f]{12}", resources)
    assert not ids.is_rollout_id(attempt)
    assert not ids.is_rollout_id("ro-ABCDEF012345")
    assert len({ids.new_rollout_id() for _ in range(1000)}) == 1000


@pytest.mark.parametrize("model", RECORD_MODELS, ids=lambda m: m.__name__)
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_strategies_build_valid_models(model: type[AglModel], data: st.DataObject) -> None:
    instance = data.draw(model_strategy(model))
    assert type(instance) is model
    assert model.model_validate(instance.model_dump(context={"avro": True})) == instance


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), 1e300, -1.0])
def test_times_must_be_finite_and_within_what_the_engine_holds(bad: float) -> None:
    base = {"rollout_id": "ro-1", "attempt_id": "at-1", "sequence_id": 1, "trace_id": "0" * 32, "span_id": "0" * 16}
    span = Span.model_validate({**base, "name": "ok", "start_time": 1.0, "end_time": 9_000_000_000.0})
    assert span.start_time == 1.0
    for field in ("start_time", "end_time"):
        with pytest.raises(ValidationError, match=field):
            Span.model_validate({**base, "name": "bad", field: bad})
    with pytest.raises(ValidationError, match="time"):
        Rollout(rollout_id="ro-1", input=None, start_time=bad)
