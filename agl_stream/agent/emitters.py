"""Emit Agent Lightning annotation spans from agent code, and read them back from span lists.

Emitters only talk to the OpenTelemetry API. By default they use the process-wide tracer
provider, which the runner installs; a span processor there stamps rollout, attempt and
sequence ids and ships the spans. Without an installed provider OpenTelemetry hands out
non-recording spans, so agent code that emits rewards still runs outside a rollout.

Readers accept anything :class:`SpanLike`: our :class:`agl_stream.models.Span` records and the
SDK's ``ReadableSpan`` alike.
"""

from __future__ import annotations

import base64
import functools
import inspect
import json
import math
import numbers
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar, cast

from opentelemetry import trace
from opentelemetry.semconv.attributes import exception_attributes

from agl_stream.logs import get_logger
from agl_stream.wire.semconv import (
    AGL_ANNOTATION,
    AGL_EXCEPTION,
    AGL_MESSAGE,
    AGL_OBJECT,
    PRIMARY_REWARD_NAME,
    AttributeLink,
    LightningSpanAttributes,
    LinkAttributes,
    RewardAttributes,
    RewardDimension,
    link_key,
    reward_key,
    tag_key,
)

__all__ = [
    "TRACER_NAME",
    "SpanLike",
    "emit_annotation",
    "emit_exception",
    "emit_message",
    "emit_object",
    "emit_reward",
    "encode_object",
    "extract_links_from_attributes",
    "extract_tags_from_attributes",
    "find_final_reward",
    "find_reward_spans",
    "flatten_attributes",
    "get_message_value",
    "get_object_value",
    "get_reward_value",
    "get_rewards_from_span",
    "is_reward_span",
    "make_link_attributes",
    "make_tag_attributes",
    "reward",
]

log = get_logger(__name__)

TRACER_NAME = "agentlightning"
"""Instrumentation scope of emitted spans; kept equal to the seed's so scope filters carry over."""

_REWARD = LightningSpanAttributes.REWARD.value
_LINK = LightningSpanAttributes.LINK.value
_TAG = LightningSpanAttributes.TAG.value
_MESSAGE_BODY = LightningSpanAttributes.MESSAGE_BODY.value
_OBJECT_TYPE = LightningSpanAttributes.OBJECT_TYPE.value
_OBJECT_LITERAL = LightningSpanAttributes.OBJECT_LITERAL.value
_OBJECT_JSON = LightningSpanAttributes.OBJECT_JSON.value

# Legacy reward encodings still found in spans from older agents: AgentOps' @operation output
# (a {"type": "reward", "value": ...} payload) and Agent Lightning 0.2's bare "reward" attribute.
_AGENTOPS_OUTPUT_KEYS = ("agentops.task.output", "agentops.entity.output")
_LEGACY_REWARD_KEY = "reward"

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_Primitive = str | bool | int | float
AttributeMap = dict[str, Any]


class SpanLike(Protocol):
    """What the readers need from a span: its name and its flat attribute map."""

    @property
    def name(self) -> str: ...

    @property
    def attributes(self) -> Mapping[str, Any] | None: ...


_S = TypeVar("_S", bound=SpanLike)
_F = TypeVar("_F", bound=Callable[..., Any])


# ---------------------------------------------------------------------------------------------
# Attribute helpers
# ---------------------------------------------------------------------------------------------


def _check_primitive(key: str, value: Any) -> _Primitive:
    if isinstance(value, bool | str | float):
        return value
    if isinstance(value, int):
        # The span record stores attributes as Avro longs; reject now rather than at ingest.
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise ValueError(f"attribute {key!r}: integer {value} does not fit in 64 bits")
        return value
    if isinstance(value, bytes | bytearray):
        raise TypeError(f"attribute {key!r}: bytes are not a span attribute value; emit them with emit_object")
    raise TypeError(
        f"attribute {key!r}: {type(value).__name__} is not a span attribute value "
        "(use str, bool, int, float, or dicts/lists of those)"
    )


def _primitive_kind(value: _Primitive) -> type:
    # bool is an int subclass, yet OTel requires homogeneous sequences, so tell them apart.
    return bool if isinstance(value, bool) else type(value)


def flatten_attributes(data: Mapping[str, Any], prefix: str = "") -> AttributeMap:
    """Turn nested dicts/lists into flat, dot-separated OpenTelemetry attributes.

    Dict keys and list indices become path segments (``{"a": [{"b": 1}]}`` gives ``a.0.b``).
    A non-empty list whose items are all primitives of one type stays a single sequence
    attribute, as OpenTelemetry allows; any other list is spelled out by index.

    Raises:
        TypeError: a key is not a string, or a leaf is not str/bool/int/float.
        ValueError: an integer does not fit in 64 bits.
    """
    flat: AttributeMap = {}

    def walk(value: Any, path: str) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise TypeError(f"attribute keys must be strings, got {key!r} under {path or '<root>'!r}")
                walk(item, f"{path}.{key}" if path else key)
        elif isinstance(value, list | tuple):
            if value and all(isinstance(item, _Primitive) for item in value):
                if len({_primitive_kind(item) for item in value}) == 1:
                    flat[path] = [_check_primitive(path, item) for item in value]
                    return
            if not value:
                flat[path] = []
                return
            for index, item in enumerate(value):
                walk(item, f"{path}.{index}")
        else:
            if not path:
                raise TypeError("attributes must be a mapping")
            flat[path] = _check_primitive(path, value)

    walk(data, prefix)
    return flat


def make_tag_attributes(tags: Sequence[str]) -> AttributeMap:
    """Attributes that tag a span: ``agentlightning.tag.<i> = tag``."""
    if isinstance(tags, str):
        # A lone string is a sequence of characters; tagging with each letter is never wanted.
        raise TypeError("tags must be a sequence of strings, not a single string")
    attributes: AttributeMap = {}
    for index, tag in enumerate(tags):
        if not isinstance(tag, str):
            raise TypeError(f"tag {index} must be a string, got {type(tag).__name__}")
        attributes[tag_key(index)] = tag
    return attributes


def make_link_attributes(links: Mapping[str, str]) -> AttributeMap:
    """Attributes that link a span to others: one ``key_match``/``value_match`` pair per entry.

    ``{"gen_ai.response.id": "chatcmpl-1"}`` links to the LLM call span that produced that
    response; ``{"span_id": "..."}`` links to one span by id.
    """
    attributes: AttributeMap = {}
    for index, (key, value) in enumerate(links.items()):
        if not isinstance(key, str) or not isinstance(value, str):
            raise ValueError(f"link {index}: key and value must be strings, got {key!r}: {value!r}")
        attributes[link_key(index, LinkAttributes.KEY_MATCH)] = key
        attributes[link_key(index, LinkAttributes.VALUE_MATCH)] = value
    return attributes


def _indexed_records(attributes: Mapping[str, Any], prefix: str) -> list[dict[str, Any]]:
    """Collect ``<prefix>.<i>.<field>`` attributes into a list of ``{field: value}`` dicts."""
    by_index: dict[int, dict[str, Any]] = {}
    start = prefix + "."
    for key, value in attributes.items():
        if key == prefix:
            raise ValueError(f"attribute {key!r} must be spelled out as {prefix}.<index>.<field>")
        if not key.startswith(start):
            continue
        index_text, _, field = key[len(start) :].partition(".")
        if not index_text.isdigit() or not field:
            raise ValueError(f"attribute {key!r} does not follow {prefix}.<index>.<field>")
        by_index.setdefault(int(index_text), {})[field] = value
    return _dense(by_index, prefix)


def _dense(by_index: Mapping[int, Any], prefix: str) -> list[Any]:
    # A gap means a writer dropped part of a list; guessing which entry is primary would be worse.
    if sorted(by_index) != list(range(len(by_index))):
        raise ValueError(f"{prefix} indices must run 0..n-1 without gaps, got {sorted(by_index)}")
    return [by_index[index] for index in range(len(by_index))]


def extract_tags_from_attributes(attributes: Mapping[str, Any] | None) -> list[str]:
    """The tags written by :func:`make_tag_attributes`, in order (empty when there are none)."""
    attributes = attributes or {}
    whole = attributes.get(_TAG)
    if isinstance(whole, list | tuple):
        # Tolerate the un-expanded spelling (one sequence attribute) some writers produce.
        return [str(tag) for tag in whole]
    by_index: dict[int, str] = {}
    start = _TAG + "."
    for key, value in attributes.items():
        if key.startswith(start):
            index_text = key[len(start) :]
            if not index_text.isdigit():
                raise ValueError(f"attribute {key!r} does not follow {_TAG}.<index>")
            if not isinstance(value, str):
                raise ValueError(f"attribute {key!r}: tags are strings, got {type(value).__name__}")
            by_index[int(index_text)] = value
    return _dense(by_index, _TAG)


def extract_links_from_attributes(attributes: Mapping[str, Any] | None) -> list[AttributeLink]:
    """The links written by :func:`make_link_attributes`, in order (empty when there are none)."""
    return [AttributeLink.model_validate(record) for record in _indexed_records(attributes or {}, _LINK)]


def _merge(own: AttributeMap, extra: Mapping[str, Any] | None, reserved: Sequence[str] = ()) -> AttributeMap:
    """Add caller attributes to the emitter's own, refusing any that would shadow or corrupt them."""
    if not extra:
        return own
    flat_extra = flatten_attributes(extra)
    for key in flat_extra:
        if key in own or any(key == prefix or key.startswith(prefix + ".") for prefix in reserved):
            raise ValueError(f"attribute {key!r} is written by the emitter itself and cannot be passed in")
    return {**own, **flat_extra}


# ---------------------------------------------------------------------------------------------
# Emitters
# ---------------------------------------------------------------------------------------------


def _start(name: str, attributes: AttributeMap, tracer_provider: trace.TracerProvider | None) -> trace.Span:
    # Looked up per call rather than at import: the runner installs its provider after agent
    # modules (and this one) are imported.
    tracer = trace.get_tracer(TRACER_NAME, tracer_provider=tracer_provider)
    # start_span (not start_as_current_span): the annotation is a leaf under whatever span is
    # current, and must not become the parent of spans the caller starts afterwards.
    return tracer.start_span(name, attributes=attributes)


def emit_annotation(
    annotation: Mapping[str, Any], *, tracer_provider: trace.TracerProvider | None = None
) -> trace.Span:
    """Emit an ``agentlightning.annotation`` span carrying ``annotation`` as its attributes.

    Nested dicts and lists are flattened (see :func:`flatten_attributes`). The span is ended
    before it is returned; with the SDK provider it is an SDK ``ReadableSpan``.

    Raises:
        TypeError: a value is not representable as a span attribute.
    """
    attributes = flatten_attributes(annotation)
    span = _start(AGL_ANNOTATION, attributes, tracer_provider)
    span.end()
    return span


def _reward_number(value: Any) -> float:
    # numbers.Real admits bool/int and numpy scalars, which reward functions commonly return.
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"reward must be a finite number, got {number}")
    return number


def _reward_dimensions(reward: float | Mapping[str, float], primary_key: str | None) -> list[RewardDimension]:
    if isinstance(reward, Mapping):
        if not reward:
            raise ValueError("a multi-dimensional reward needs at least one dimension")
        values: dict[str, float] = {}
        for name, value in reward.items():
            if not isinstance(name, str):
                raise TypeError(f"reward dimension names must be strings, got {name!r}")
            if not isinstance(value, numbers.Real):
                raise ValueError(f"reward dimension {name!r} must be a number, got {type(value).__name__}")
            values[name] = _reward_number(value)
        primary = next(iter(values)) if primary_key is None else primary_key
        if primary not in values:
            raise ValueError(f"primary_key {primary!r} is not one of the reward dimensions {list(values)}")
        ordered = [primary, *(name for name in values if name != primary)]
        return [RewardDimension(name=name, value=values[name]) for name in ordered]
    if primary_key is not None:
        raise ValueError("primary_key only applies to a multi-dimensional (dict) reward")
    if not isinstance(reward, numbers.Real):
        raise TypeError(f"reward must be a number or a dict of numbers, got {type(reward).__name__}")
    return [RewardDimension(name=PRIMARY_REWARD_NAME, value=_reward_number(reward))]


def emit_reward(
    reward: float | Mapping[str, float],
    *,
    primary_key: str | None = None,
    links: Mapping[str, str] | None = None,
    tags: Sequence[str] | None = None,
    attributes: Mapping[str, Any] | None = None,
    tracer_provider: trace.TracerProvider | None = None,
) -> trace.Span:
    """Emit a reward as an ``agentlightning.annotation`` span.

    Args:
        reward: A number (recorded as the single dimension ``"primary"``), or a dict of named
            dimensions. Dimension 0 on the span is the primary reward: ``primary_key`` if given,
            else the dict's first key; the others follow in dict order.
        primary_key: Which dimension of a dict reward is the primary one.
        links: Spans this reward is about, as ``{attribute key: value}`` (see
            :func:`make_link_attributes`), e.g. ``{"gen_ai.response.id": response.id}``.
        tags: Free-form tags for the reward.
        attributes: Further attributes; nested values are flattened.
        tracer_provider: Provider to use instead of the global one.

    Raises:
        TypeError: ``reward`` is neither a number nor a dict.
        ValueError: a dimension is not a number, a value is not finite, ``primary_key`` is not a
            dimension, or ``attributes`` tries to write reward/link/tag keys.
    """
    own: AttributeMap = {}
    for index, dimension in enumerate(_reward_dimensions(reward, primary_key)):
        own[reward_key(index, RewardAttributes.REWARD_NAME)] = dimension.name
        own[reward_key(index, RewardAttributes.REWARD_VALUE)] = dimension.value
    reserved = [_REWARD]
    if links:
        own.update(make_link_attributes(links))
        reserved.append(_LINK)
    if tags:
        own.update(make_tag_attributes(tags))
        reserved.append(_TAG)
    return emit_annotation(_merge(own, attributes, reserved), tracer_provider=tracer_provider)


def emit_message(
    message: str,
    *,
    attributes: Mapping[str, Any] | None = None,
    tracer_provider: trace.TracerProvider | None = None,
) -> trace.Span:
    """Emit an ``agentlightning.message`` span: a log line kept with the rollout's other spans.

    Raises:
        TypeError: ``message`` is not a string.
    """
    if not isinstance(message, str):
        raise TypeError(f"message must be a string, got {type(message).__name__}")
    span = _start(AGL_MESSAGE, _merge({_MESSAGE_BODY: message}, attributes), tracer_provider)
    span.end()
    return span


def _type_name(kind: type) -> str:
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def encode_object(obj: Any) -> AttributeMap:
    """The ``agentlightning.object.*`` attributes that represent ``obj``.

    Raises:
        TypeError: ``obj`` is not a primitive, bytes, or JSON-serializable value.
    """
    if isinstance(obj, str | bool | int | float):
        return {_OBJECT_TYPE: type(obj).__name__, _OBJECT_LITERAL: str(obj)}
    if isinstance(obj, bytes):
        return {_OBJECT_TYPE: "bytes", _OBJECT_LITERAL: base64.b64encode(obj).decode("ascii")}
    try:
        # allow_nan=False: NaN/Infinity are not JSON, and readers in other languages reject them.
        serialized = json.dumps(obj, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"object of type {_type_name(type(obj))} is not JSON serializable: {exc}") from exc
    return {_OBJECT_TYPE: _type_name(type(obj)), _OBJECT_JSON: serialized}


def emit_object(
    obj: Any,
    *,
    attributes: Mapping[str, Any] | None = None,
    tracer_provider: trace.TracerProvider | None = None,
) -> trace.Span:
    """Emit an ``agentlightning.object`` span holding ``obj`` (see :func:`encode_object`).

    Raises:
        TypeError: ``obj`` cannot be encoded.
    """
    own = encode_object(obj)
    reserved = [_OBJECT_TYPE, _OBJECT_LITERAL, _OBJECT_JSON]
    span = _start(AGL_OBJECT, _merge(own, attributes, reserved), tracer_provider)
    span.end()
    return span


def emit_exception(
    exception: BaseException,
    *,
    attributes: Mapping[str, Any] | None = None,
    tracer_provider: trace.TracerProvider | None = None,
) -> trace.Span:
    """Emit an ``agentlightning.exception`` span describing ``exception``.

    The span carries OpenTelemetry's ``exception.type`` / ``.message`` / ``.escaped`` /
    ``.stacktrace`` attributes and an ``exception`` event. Its status is left unset: the
    exception may have been handled, so marking the span failed would overstate it.

    Raises:
        TypeError: ``exception`` is not an exception instance.
    """
    if not isinstance(exception, BaseException):
        raise TypeError(f"expected an exception instance, got {type(exception).__name__}")
    own: AttributeMap = {
        exception_attributes.EXCEPTION_TYPE: type(exception).__name__,
        exception_attributes.EXCEPTION_MESSAGE: str(exception),
        exception_attributes.EXCEPTION_ESCAPED: True,
    }
    stacktrace = "".join(traceback.format_exception(type(exception), exception, exception.__traceback__))
    if stacktrace.strip():
        own[exception_attributes.EXCEPTION_STACKTRACE] = stacktrace
    span = _start(AGL_EXCEPTION, _merge(own, attributes), tracer_provider)
    span.record_exception(exception)
    span.end()
    return span


def reward(fn: _F) -> _F:
    """Decorate a reward function so that each number it returns is emitted with :func:`emit_reward`.

    Works on sync and async functions. A ``None`` result emits nothing. Kept for agents written
    against the seed's decorator; new code should call :func:`emit_reward` directly.
    """
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            result = await fn(*args, **kwargs)
            if result is not None:
                emit_reward(result)
            return result

        return cast(_F, async_wrapper)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        if result is not None:
            emit_reward(result)
        return result

    return cast(_F, wrapper)


# ---------------------------------------------------------------------------------------------
# Readers
# ---------------------------------------------------------------------------------------------


def get_rewards_from_span(span: SpanLike) -> list[RewardDimension]:
    """All reward dimensions on ``span``, primary first; empty when it carries none.

    Raises:
        ValueError: the ``agentlightning.reward.*`` attributes are malformed (missing field,
            index gap, non-numeric value).
    """
    records = _indexed_records(span.attributes or {}, _REWARD)
    return [RewardDimension.model_validate(record) for record in records]


def _legacy_reward(span: SpanLike) -> tuple[bool, float | None]:
    """(found, value) for the pre-0.3 encodings; found=False when the span has neither."""
    attributes = span.attributes or {}
    for key in _AGENTOPS_OUTPUT_KEYS:
        output = attributes.get(key)
        payload: Any = output
        if isinstance(output, str):
            try:
                payload = json.loads(output)
            except json.JSONDecodeError:
                continue
        if isinstance(payload, Mapping) and payload.get("type") == "reward":
            return True, _as_float_or_none(payload.get("value"), key)
    if span.name == AGL_ANNOTATION and _LEGACY_REWARD_KEY in attributes:
        return True, _as_float_or_none(attributes[_LEGACY_REWARD_KEY], _LEGACY_REWARD_KEY)
    return False, None


def _as_float_or_none(value: Any, key: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    log.warning("ignoring non-numeric legacy reward", key=key, value_type=type(value).__name__)
    return None


def get_reward_value(span: SpanLike) -> float | None:
    """The primary reward on ``span``, or ``None`` if it is not a reward span.

    Reads the ``agentlightning.reward.*`` layout, and also the older encodings (AgentOps
    operation output ``{"type": "reward", "value": ...}`` and a bare ``reward`` attribute on an
    annotation span) so traces from older agents still score.
    """
    dimensions = get_rewards_from_span(span)
    if dimensions:
        return dimensions[0].value
    return _legacy_reward(span)[1]


def is_reward_span(span: SpanLike) -> bool:
    """Whether ``span`` carries a (non-null) reward."""
    return get_reward_value(span) is not None


def find_reward_spans(spans: Sequence[_S]) -> list[_S]:
    """The reward spans among ``spans``, in their given order."""
    return [span for span in spans if is_reward_span(span)]


def find_final_reward(spans: Sequence[_S]) -> float | None:
    """The primary reward of the last reward span in ``spans``; ``None`` if there is none.

    "Last" is list position, not timestamp: pass spans in sequence-id order (as the store
    returns them) so that the reward emitted last wins.
    """
    for span in reversed(spans):
        value = get_reward_value(span)
        if value is not None:
            return value
    return None


def get_message_value(span: SpanLike) -> str | None:
    """The body of a message span, or ``None`` if ``span`` has none.

    Raises:
        TypeError: the body attribute is not a string.
    """
    attributes = span.attributes or {}
    if _MESSAGE_BODY not in attributes:
        return None
    body = attributes[_MESSAGE_BODY]
    if not isinstance(body, str):
        raise TypeError(f"{_MESSAGE_BODY} must be a string, got {type(body).__name__}")
    return body


_LITERAL_DECODERS: dict[str, Callable[[str], Any]] = {
    "str": str,
    "int": int,
    "float": float,
    "bool": lambda text: text.lower() == "true",
    "bytes": lambda text: base64.b64decode(text.encode("ascii")),
}


def get_object_value(span: SpanLike) -> Any:
    """Decode the object stored by :func:`emit_object`; ``None`` if ``span`` holds no object.

    Raises:
        ValueError: the stored JSON or literal cannot be decoded.
    """
    attributes = span.attributes or {}
    if _OBJECT_JSON in attributes:
        try:
            return json.loads(attributes[_OBJECT_JSON])
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{_OBJECT_JSON} does not hold valid JSON: {exc}") from exc
    if _OBJECT_LITERAL in attributes:
        literal = attributes[_OBJECT_LITERAL]
        kind = attributes.get(_OBJECT_TYPE, "str")
        decoder = _LITERAL_DECODERS.get(kind)
        if decoder is None:
            raise ValueError(f"cannot decode an object literal of type {kind!r}")
        try:
            return decoder(literal)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{_OBJECT_LITERAL} {literal!r} is not a valid {kind}: {exc}") from exc
    return None
