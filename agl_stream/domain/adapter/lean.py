"""The adapter's input: one lean tuple per span, holding only what the adapter reads.

The adapter reads a span's ids, parent, name, times, sequence id and a known handful of
attributes (token ids, response id, logprobs, reward and agent-name keys). Everything else of a
span (resource, context, events, links, status, the prompt text and other attributes) is never
looked at, so :class:`LeanSpan` does not carry it: the replay builds LeanSpans straight from
record bytes (:mod:`agl_stream.domain.adapter.span_decoder`) without materializing the rest, and the live
builder converts its validated :class:`~agl_stream.models.Span` models with :func:`lean_span`.
Both filter attributes with the same rule (:func:`is_adapter_key`), so the adapter sees the same
input on both paths; a key the adapter starts to read must be added here, or its own tests fail
(they go through :func:`lean_span` too).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from agl_stream.models import Span
from agl_stream.wire.semconv import POLICY_VERSION

__all__ = [
    "ADAPTER_KEYS",
    "REWARDISH_KEYS",
    "REWARD_PREFIX",
    "LeanSpan",
    "TokenIds",
    "is_adapter_key",
    "lean_attributes",
    "lean_span",
    "token_ids",
]

REWARD_PREFIX = "agentlightning.reward"
"""``agentlightning.reward.<i>.<field>`` (emitters' reward layout; the bare prefix is an error there)."""

REWARDISH_KEYS = frozenset({"agentops.task.output", "agentops.entity.output", "reward"})
"""Legacy reward encodings (emitters ``_AGENTOPS_OUTPUT_KEYS`` and ``_LEGACY_REWARD_KEY``)."""

_WEAVE_OUTPUT = "agentlightning.operation.output"

ADAPTER_KEYS = frozenset(
    {
        # LLM calls (triplets.py): response id, token ids, logprobs, serving version
        "gen_ai.response.id",
        f"{_WEAVE_OUTPUT}.id",
        "prompt_token_ids",
        f"{_WEAVE_OUTPUT}.prompt_token_ids",
        "response_token_ids",
        f"{_WEAVE_OUTPUT}.response_token_ids.0",
        f"{_WEAVE_OUTPUT}.choices.0.token_ids",
        f"{_WEAVE_OUTPUT}.choices.0.provider_specific_fields.token_ids",
        "logprobs.content",
        POLICY_VERSION,  # the version of the server that answered the call (the LLM proxy's)
        # reward operations (triplets.py)
        "agentlightning.operation.name",
        # agent names (tree.agent_name_of)
        "agent.name",
        "agentops.span.kind",
        "operation.name",
        "recipient_agent_type",
        "langchain.chain.type",
        "executor.id",
        "type",
        "agentlightning.operation.input.name",
        "lc_name",
    }
    | REWARDISH_KEYS
)
"""Every attribute key the adapter reads, besides those under :data:`REWARD_PREFIX`."""


class TokenIds(list[int]):
    """Token ids read from a record, with the Avro varints they were read from (``varints``:
    each id's zig-zag varint, in order, as fastavro writes it).

    Every item is a non-negative ``int`` (the reader only makes one when that holds), so the
    adapter takes it without checking each id, and the triplet encoder writes ``varints`` instead
    of encoding every id again. Like the rest of a LeanSpan, never mutated. Built as a list
    (list's own constructor, in C), then ``varints`` set: :func:`token_ids`.
    """

    __slots__ = ("varints",)
    varints: bytes


def token_ids(ids: Iterable[int], varints: bytes) -> TokenIds:
    """:class:`TokenIds` of non-negative ``ids`` read from ``varints``."""
    made = TokenIds(ids)
    made.varints = varints
    return made


def is_adapter_key(key: str) -> bool:
    return key in ADAPTER_KEYS or key.startswith(REWARD_PREFIX)


class LeanSpan(NamedTuple):
    """What the adapter reads of one span (a tuple: built in one C call, fields read in C).

    ``attributes`` holds only the adapter's keys (:func:`is_adapter_key`), in the span's order;
    ``rewardish`` says whether one of them can make the span a reward span (a key under
    :data:`REWARD_PREFIX` or a legacy reward key), which spares the reward reader most spans.
    """

    rollout_id: str
    attempt_id: str
    sequence_id: int
    span_id: str
    parent_id: str | None
    name: str
    start_time: float | None
    end_time: float | None
    attributes: dict[str, Any]
    rewardish: bool


def lean_attributes(attributes: Mapping[str, Any] | None) -> tuple[dict[str, Any], bool]:
    """The adapter's attributes of a span (same order), and whether one is reward-like."""
    if not attributes:
        return {}, False
    # is_adapter_key inline: no function call per key (the live builder converts every span)
    kept = {key: value for key, value in attributes.items() if key in ADAPTER_KEYS or key.startswith(REWARD_PREFIX)}
    rewardish = not REWARDISH_KEYS.isdisjoint(kept) or any(key.startswith(REWARD_PREFIX) for key in kept)
    return kept, rewardish


def lean_span(span: Span | LeanSpan) -> LeanSpan:
    """The LeanSpan of a span model (a LeanSpan is returned as it is)."""
    if isinstance(span, LeanSpan):
        return span
    attributes, rewardish = lean_attributes(span.attributes)
    return LeanSpan(
        span.rollout_id,
        span.attempt_id,
        span.sequence_id,
        span.span_id,
        span.parent_id,
        span.name,
        span.start_time,
        span.end_time,
        attributes,
        rewardish,
    )
