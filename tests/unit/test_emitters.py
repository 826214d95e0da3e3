"""Emitters write the seed's span layout; readers find rewards, messages and objects in span lists."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agl_stream.agent.emitters import (
    TRACER_NAME,
    emit_annotation,
    emit_exception,
    emit_message,
    emit_object,
    emit_reward,
    extract_links_from_attributes,
    extract_tags_from_attributes,
    find_final_reward,
    find_reward_spans,
    flatten_attributes,
    get_message_value,
    get_object_value,
    get_reward_value,
    get_rewards_from_span,
    is_reward_span,
    make_link_attributes,
    make_tag_attributes,
    reward,
)
from agl_stream.models import Span
from agl_stream.wire.semconv import AttributeLink, RewardDimension
from agl_stream.wire.spans import span_from_otel

# One provider for the module: the global provider can be set only once per process, so the
# emitters get this one passed in and the global path is tested in a subprocess below.
_EXPORTER = InMemorySpanExporter()
_PROVIDER = TracerProvider()
_PROVIDER.add_span_processor(SimpleSpanProcessor(_EXPORTER))


@pytest.fixture
def exported() -> Iterator[InMemorySpanExporter]:
    _EXPORTER.clear()
    yield _EXPORTER
    _EXPORTER.clear()


def only_span(exporter: InMemorySpanExporter) -> ReadableSpan:
    spans = exporter.get_finished_spans()
    assert len(spans) == 1, [s.name for s in spans]
    return spans[0]


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in (span.attributes or {}).items()}


def record(sequence_id: int, name: str, attributes: dict[str, Any]) -> Span:
    return Span(
        rollout_id="ro-000000000001",
        attempt_id="at-00000001",
        sequence_id=sequence_id,
        trace_id="ab" * 16,
        span_id=f"{sequence_id:016x}",
        name=name,
        attributes=attributes,
    )


def reward_record(sequence_id: int, *dimensions: tuple[str, float]) -> Span:
    attributes: dict[str, Any] = {}
    for index, (name, value) in enumerate(dimensions):
        attributes[f"agentlightning.reward.{index}.name"] = name
        attributes[f"agentlightning.reward.{index}.value"] = value
    return record(sequence_id, "agentlightning.annotation", attributes)


# --- emit_reward ----------------------------------------------------------------------------


def test_scalar_reward_layout(exported: InMemorySpanExporter) -> None:
    returned = emit_reward(0.75, tracer_provider=_PROVIDER)
    span = only_span(exported)
    # The SDK exports a snapshot of the span, so compare identities rather than objects.
    assert returned.get_span_context().span_id == span.context.span_id
    assert span.name == "agentlightning.annotation"
    assert span.instrumentation_scope is not None
    assert span.instrumentation_scope.name == TRACER_NAME == "agentlightning"
    assert attrs(span) == {"agentlightning.reward.0.name": "primary", "agentlightning.reward.0.value": 0.75}
    assert span.end_time is not None


@pytest.mark.parametrize("value", [1, True])
def test_int_and_bool_rewards_become_floats(exported: InMemorySpanExporter, value: int) -> None:
    emit_reward(value, tracer_provider=_PROVIDER)
    stored = attrs(only_span(exported))["agentlightning.reward.0.value"]
    assert stored == 1.0
    assert type(stored) is float


def test_dict_reward_puts_primary_key_first(exported: InMemorySpanExporter) -> None:
    emit_reward(
        {"efficiency": 0.5, "task_completion": 1.0, "style": 0.25},
        primary_key="task_completion",
        tracer_provider=_PROVIDER,
    )
    assert attrs(only_span(exported)) == {
        "agentlightning.reward.0.name": "task_completion",
        "agentlightning.reward.0.value": 1.0,
        "agentlightning.reward.1.name": "efficiency",
        "agentlightning.reward.1.value": 0.5,
        "agentlightning.reward.2.name": "style",
        "agentlightning.reward.2.value": 0.25,
    }


def test_dict_reward_without_primary_key_uses_first_key(exported: InMemorySpanExporter) -> None:
    emit_reward({"accuracy": 0.9, "cost": -2}, tracer_provider=_PROVIDER)
    assert attrs(only_span(exported)) == {
        "agentlightning.reward.0.name": "accuracy",
        "agentlightning.reward.0.value": 0.9,
        "agentlightning.reward.1.name": "cost",
        "agentlightning.reward.1.value": -2.0,
    }


def test_reward_links_tags_and_attributes(exported: InMemorySpanExporter) -> None:
    emit_reward(
        0.5,
        links={"gen_ai.response.id": "chatcmpl-1", "span_id": "00000000000000ff"},
        tags=["fast", "reliable"],
        attributes={"judge": {"model": "gpt", "version": 2}},
        tracer_provider=_PROVIDER,
    )
    span = only_span(exported)
    assert attrs(span) == {
        "agentlightning.reward.0.name": "primary",
        "agentlightning.reward.0.value": 0.5,
        "agentlightning.link.0.key_match": "gen_ai.response.id",
        "agentlightning.link.0.value_match": "chatcmpl-1",
        "agentlightning.link.1.key_match": "span_id",
        "agentlightning.link.1.value_match": "00000000000000ff",
        "agentlightning.tag.0": "fast",
        "agentlightning.tag.1": "reliable",
        "judge.model": "gpt",
        "judge.version": 2,
    }
    assert extract_tags_from_attributes(span.attributes) == ["fast", "reliable"]
    assert extract_links_from_attributes(span.attributes) == [
        AttributeLink(key_match="gen_ai.response.id", value_match="chatcmpl-1"),
        AttributeLink(key_match="span_id", value_match="00000000000000ff"),
    ]


def test_link_and_tag_helpers_compose_with_attributes(exported: InMemorySpanExporter) -> None:
    extra = {**make_link_attributes({"gen_ai.response.id": "r-9"}), **make_tag_attributes(["x"])}
    emit_reward(1.0, attributes=extra, tracer_provider=_PROVIDER)
    assert attrs(only_span(exported)) == {
        "agentlightning.reward.0.name": "primary",
        "agentlightning.reward.0.value": 1.0,
        "agentlightning.link.0.key_match": "gen_ai.response.id",
        "agentlightning.link.0.value_match": "r-9",
        "agentlightning.tag.0": "x",
    }


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"reward": "1.0"}, TypeError, "must be a number"),
        ({"reward": None}, TypeError, "must be a number"),
        ({"reward": math.nan}, ValueError, "finite"),
        ({"reward": math.inf}, ValueError, "finite"),
        ({"reward": {"a": "high"}}, ValueError, "'a' must be a number"),
        ({"reward": {"a": None}}, ValueError, "'a' must be a number"),
        ({"reward": {"a": -math.inf}}, ValueError, "finite"),
        ({"reward": {}}, ValueError, "at least one dimension"),
        ({"reward": {"a": 1.0}, "primary_key": "b"}, ValueError, "primary_key 'b'"),
        ({"reward": 1.0, "primary_key": "a"}, ValueError, "multi-dimensional"),
        ({"reward": 1.0, "attributes": {"agentlightning.reward.1.value": 2.0}}, ValueError, "written by the emitter"),
        ({"reward": 1.0, "attributes": {"agentlightning.reward": [1]}}, ValueError, "written by the emitter"),
        ({"reward": 1.0, "links": {"k": 3}}, ValueError, "must be strings"),
        ({"reward": 1.0, "tags": "fast"}, TypeError, "single string"),
        ({"reward": 1.0, "tags": ["ok"], "attributes": {"agentlightning.tag.5": "x"}}, ValueError, "emitter"),
    ],
)
def test_bad_rewards_are_rejected(
    exported: InMemorySpanExporter, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        emit_reward(**kwargs, tracer_provider=_PROVIDER)
    assert exported.get_finished_spans() == ()


# --- emit_annotation ------------------------------------------------------------------------


def test_annotation_flattens_nested_values(exported: InMemorySpanExporter) -> None:
    emit_annotation(
        {
            "meta": {"step": 3, "ok": True},
            "scores": [0.1, 0.2],
            "mixed": [1, "one"],
            "turns": [{"role": "user"}, {"role": "assistant"}],
            "empty": [],
        },
        tracer_provider=_PROVIDER,
    )
    span = only_span(exported)
    assert span.name == "agentlightning.annotation"
    assert attrs(span) == {
        "meta.step": 3,
        "meta.ok": True,
        "scores": [0.1, 0.2],
        "mixed.0": 1,
        "mixed.1": "one",
        "turns.0.role": "user",
        "turns.1.role": "assistant",
        "empty": [],
    }


def test_bools_and_ints_are_not_one_sequence() -> None:
    assert flatten_attributes({"xs": [True, 1]}) == {"xs.0": True, "xs.1": 1}


@pytest.mark.parametrize(
    ("annotation", "error"),
    [
        ({"x": None}, TypeError),
        ({"x": object()}, TypeError),
        ({"x": b"raw"}, TypeError),
        ({"x": {1: "a"}}, TypeError),
        ({"x": 2**63}, ValueError),
    ],
)
def test_bad_annotations_are_rejected(
    exported: InMemorySpanExporter, annotation: dict[str, Any], error: type[Exception]
) -> None:
    with pytest.raises(error, match="'x'"):
        emit_annotation(annotation, tracer_provider=_PROVIDER)
    assert exported.get_finished_spans() == ()


def test_annotation_is_child_of_current_span_and_does_not_become_current(exported: InMemorySpanExporter) -> None:
    tracer = _PROVIDER.get_tracer("test")
    with tracer.start_as_current_span("agent") as parent:
        emit_annotation({"k": "v"}, tracer_provider=_PROVIDER)
        assert trace.get_current_span() is parent
    annotation, agent = exported.get_finished_spans()
    assert annotation.parent is not None
    assert agent.context is not None
    assert annotation.parent.span_id == agent.context.span_id


# --- emit_message ---------------------------------------------------------------------------


def test_message_layout(exported: InMemorySpanExporter) -> None:
    emit_message("step 3 done", attributes={"level": "info"}, tracer_provider=_PROVIDER)
    span = only_span(exported)
    assert span.name == "agentlightning.message"
    assert attrs(span) == {"agentlightning.message.body": "step 3 done", "level": "info"}
    assert get_message_value(span) == "step 3 done"
    assert get_message_value(record(1, "x", {})) is None


def test_message_rejects_non_strings_and_body_override(exported: InMemorySpanExporter) -> None:
    with pytest.raises(TypeError, match="string"):
        emit_message(["a"], tracer_provider=_PROVIDER)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"agentlightning\.message\.body"):
        emit_message("a", attributes={"agentlightning.message.body": "b"}, tracer_provider=_PROVIDER)
    with pytest.raises(TypeError, match="must be a string"):
        get_message_value(record(1, "agentlightning.message", {"agentlightning.message.body": 3}))
    assert exported.get_finished_spans() == ()


# --- emit_object ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        ("hi", {"agentlightning.object.type": "str", "agentlightning.object.literal": "hi"}),
        (42, {"agentlightning.object.type": "int", "agentlightning.object.literal": "42"}),
        (2.5, {"agentlightning.object.type": "float", "agentlightning.object.literal": "2.5"}),
        (False, {"agentlightning.object.type": "bool", "agentlightning.object.literal": "False"}),
        (b"\x00\xff", {"agentlightning.object.type": "bytes", "agentlightning.object.literal": "AP8="}),
        (
            {"a": [1, None]},
            {"agentlightning.object.type": "dict", "agentlightning.object.json": '{"a": [1, null]}'},
        ),
        ([1, 2], {"agentlightning.object.type": "list", "agentlightning.object.json": "[1, 2]"}),
        (None, {"agentlightning.object.type": "NoneType", "agentlightning.object.json": "null"}),
        (
            OrderedDict(b=1),
            {"agentlightning.object.type": "collections.OrderedDict", "agentlightning.object.json": '{"b": 1}'},
        ),
    ],
)
def test_object_layout_and_round_trip(exported: InMemorySpanExporter, obj: Any, expected: dict[str, str]) -> None:
    emit_object(obj, tracer_provider=_PROVIDER)
    span = only_span(exported)
    assert span.name == "agentlightning.object"
    assert attrs(span) == expected
    assert get_object_value(span) == obj
    # Same answer from our span record, i.e. after the span went through the pipeline.
    assert get_object_value(span_from_otel(span, "ro-000000000001", "at-00000001", 1)) == obj


def test_object_rejects_unserializable(exported: InMemorySpanExporter) -> None:
    with pytest.raises(TypeError, match="JSON serializable"):
        emit_object({"x": object()}, tracer_provider=_PROVIDER)
    with pytest.raises(TypeError, match="JSON serializable"):
        emit_object([math.nan], tracer_provider=_PROVIDER)
    assert exported.get_finished_spans() == ()


def test_object_readers() -> None:
    assert get_object_value(record(1, "x", {})) is None
    bad_json = record(1, "agentlightning.object", {"agentlightning.object.json": "{nope"})
    with pytest.raises(ValueError, match="valid JSON"):
        get_object_value(bad_json)
    odd_type = {"agentlightning.object.type": "complex", "agentlightning.object.literal": "1j"}
    with pytest.raises(ValueError, match="'complex'"):
        get_object_value(record(1, "agentlightning.object", odd_type))
    bad_int = {"agentlightning.object.type": "int", "agentlightning.object.literal": "x"}
    with pytest.raises(ValueError, match="not a valid int"):
        get_object_value(record(1, "agentlightning.object", bad_int))


# --- emit_exception -------------------------------------------------------------------------


def test_exception_layout(exported: InMemorySpanExporter) -> None:
    try:
        raise KeyError("missing tool")
    except KeyError as exc:
        emit_exception(exc, attributes={"tool": "search"}, tracer_provider=_PROVIDER)
    span = only_span(exported)
    assert span.name == "agentlightning.exception"
    attributes = attrs(span)
    stacktrace = attributes.pop("exception.stacktrace")
    assert attributes == {
        "exception.type": "KeyError",
        "exception.message": "'missing tool'",
        "exception.escaped": True,
        "tool": "search",
    }
    assert "test_exception_layout" in stacktrace
    assert stacktrace.rstrip().endswith("KeyError: 'missing tool'")
    assert [event.name for event in span.events] == ["exception"]
    assert span.events[0].attributes is not None
    assert span.events[0].attributes["exception.type"] == "KeyError"
    assert span.status.status_code is trace.StatusCode.UNSET


def test_exception_without_traceback_still_has_stacktrace(exported: InMemorySpanExporter) -> None:
    emit_exception(ValueError("bad"), tracer_provider=_PROVIDER)
    assert attrs(only_span(exported))["exception.stacktrace"] == "ValueError: bad\n"


def test_exception_rejects_non_exceptions(exported: InMemorySpanExporter) -> None:
    with pytest.raises(TypeError, match="exception instance"):
        emit_exception("boom", tracer_provider=_PROVIDER)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"exception\.type"):
        emit_exception(ValueError("x"), attributes={"exception.type": "Other"}, tracer_provider=_PROVIDER)
    assert exported.get_finished_spans() == ()


# --- reward decorator -----------------------------------------------------------------------


def test_reward_decorator_emits_sync_and_async(monkeypatch: pytest.MonkeyPatch) -> None:
    import agl_stream.agent.emitters as emitters

    emitted: list[Any] = []
    monkeypatch.setattr(emitters, "emit_reward", lambda value: emitted.append(value))

    @reward
    def score(x: float) -> float | None:
        return None if x < 0 else x * 2

    @reward
    async def ascore(x: float) -> float:
        return x + 1

    import asyncio

    assert score(2.0) == 4.0
    assert score(-1.0) is None
    assert asyncio.run(ascore(1.0)) == 2.0
    assert score.__name__ == "score"
    assert emitted == [4.0, 2.0]


# --- readers over span lists ----------------------------------------------------------------


def test_no_reward_gives_none() -> None:
    spans = [record(1, "openai.chat.completion", {"gen_ai.response.id": "r"}), record(2, "agentlightning.message", {})]
    assert find_final_reward(spans) is None
    assert find_reward_spans(spans) == []
    assert find_final_reward([]) is None


def test_last_reward_in_list_order_wins() -> None:
    spans = [
        reward_record(1, ("primary", 0.1)),
        record(2, "openai.chat.completion", {}),
        reward_record(3, ("primary", 0.7)),
        record(4, "agentlightning.message", {"agentlightning.message.body": "done"}),
    ]
    assert find_final_reward(spans) == 0.7
    assert [s.sequence_id for s in find_reward_spans(spans)] == [1, 3]
    # List position decides, as in the seed: callers sort by sequence id first.
    assert find_final_reward(list(reversed(spans))) == 0.1


def test_multi_dimensional_primary_reward() -> None:
    span = reward_record(1, ("task_completion", 1.0), ("efficiency", 0.25))
    assert get_reward_value(span) == 1.0
    assert find_final_reward([span]) == 1.0
    assert get_rewards_from_span(span) == [
        RewardDimension(name="task_completion", value=1.0),
        RewardDimension(name="efficiency", value=0.25),
    ]


def test_readers_accept_otel_spans(exported: InMemorySpanExporter) -> None:
    emit_reward({"a": 0.3, "b": 0.9}, primary_key="b", tracer_provider=_PROVIDER)
    emit_message("between", tracer_provider=_PROVIDER)
    emit_reward(0.6, tracer_provider=_PROVIDER)
    spans = list(exported.get_finished_spans())
    assert [get_reward_value(s) for s in spans] == [0.9, None, 0.6]
    assert find_reward_spans(spans) == [spans[0], spans[2]]
    assert find_final_reward(spans[:2]) == 0.9
    assert find_final_reward(spans) == 0.6
    converted = [span_from_otel(s, "ro-000000000001", "at-00000001", i) for i, s in enumerate(spans, 1)]
    assert find_final_reward(converted) == 0.6
    assert get_rewards_from_span(converted[0]) == [
        RewardDimension(name="b", value=0.9),
        RewardDimension(name="a", value=0.3),
    ]


def test_reward_value_stored_as_text_is_read() -> None:
    span = record(
        1, "agentlightning.annotation", {"agentlightning.reward.0.name": "p", "agentlightning.reward.0.value": "0.5"}
    )
    assert get_reward_value(span) == 0.5


def test_legacy_reward_encodings() -> None:
    agentops = record(1, "reward_fn", {"agentops.task.output": '{"type": "reward", "value": 0.4}'})
    agentops_null = record(2, "reward_fn", {"agentops.entity.output": '{"type": "reward", "value": null}'})
    not_reward = record(3, "tool", {"agentops.task.output": '{"type": "tool", "value": 1.0}'})
    v02 = record(4, "agentlightning.annotation", {"reward": 0.8})
    v02_wrong_name = record(5, "other", {"reward": 0.9})
    assert get_reward_value(agentops) == 0.4
    assert get_reward_value(agentops_null) is None
    assert get_reward_value(not_reward) is None
    assert get_reward_value(v02) == 0.8
    assert get_reward_value(v02_wrong_name) is None
    assert [is_reward_span(s) for s in (agentops, agentops_null, not_reward, v02, v02_wrong_name)] == [
        True,
        False,
        False,
        True,
        False,
    ]
    assert find_final_reward([agentops, v02, v02_wrong_name, agentops_null]) == 0.8


@pytest.mark.parametrize(
    "attributes",
    [
        {"agentlightning.reward.1.name": "a", "agentlightning.reward.1.value": 1.0},
        {"agentlightning.reward.0.name": "a"},
        {"agentlightning.reward.0.name": "a", "agentlightning.reward.0.value": "high"},
        {"agentlightning.reward.x.value": 1.0},
        {"agentlightning.reward": 1.0},
    ],
)
def test_malformed_reward_attributes_raise(attributes: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        get_rewards_from_span(record(1, "agentlightning.annotation", attributes))


def test_unrelated_prefix_is_not_a_reward() -> None:
    span = record(1, "x", {"agentlightning.rewards_total": 3.0})
    assert get_rewards_from_span(span) == []
    assert get_reward_value(span) is None


def test_tag_and_link_extraction_edge_cases() -> None:
    assert extract_tags_from_attributes(None) == []
    assert extract_tags_from_attributes({"agentlightning.tag": ["a", "b"]}) == ["a", "b"]
    with pytest.raises(ValueError, match="without gaps"):
        extract_tags_from_attributes({"agentlightning.tag.1": "a"})
    assert extract_links_from_attributes({"other": 1}) == []


# --- global provider ------------------------------------------------------------------------


def test_global_provider_and_no_provider_paths() -> None:
    # A fresh interpreter: this process may already have a global provider from other tests.
    script = textwrap.dedent(
        """
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        from agl_stream.agent.emitters import emit_exception, emit_message, emit_object, emit_reward

        # No provider installed: OTel's no-op, nothing raises, nothing records.
        spans = [emit_reward(1.0), emit_message("m"), emit_object({"a": 1}), emit_exception(ValueError("v"))]
        assert not any(s.is_recording() for s in spans)

        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        emit_reward({"a": 2.0})
        (span,) = exporter.get_finished_spans()
        assert span.name == "agentlightning.annotation", span.name
        assert dict(span.attributes) == {"agentlightning.reward.0.name": "a", "agentlightning.reward.0.value": 2.0}
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
