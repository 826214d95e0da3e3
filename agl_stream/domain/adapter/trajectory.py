"""The calls of one attempt -> training samples: one per call, or consecutive calls merged.

``transition``: every LLM call is its own sample (the triplets as :func:`extract_triplets`
gives them). ``trajectory``: a call whose prompt token ids start with the whole token sequence
of the sample before it (first prompt, then every response and every inserted token so far)
extends that sample: the tokens of its prompt beyond that sequence (tool results, user and
environment turns) and then its response are appended to the sample's response part, with a
``response_mask`` of 0 on the inserted tokens and 1 on the generated ones. Any other call
starts a new sample, and why is counted (:data:`DRIFT`, :data:`REWRITTEN`, :data:`BRANCH`).

Pure: no I/O, no clock; the same triplets in the same order always give the same samples.
The rule and its reasons: docs/design-notes.md, "Trajectory aggregation".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Literal, NamedTuple

from agl_stream.models import Triplet

__all__ = [
    "AGGREGATIONS",
    "BRANCH",
    "DRIFT",
    "REWRITTEN",
    "Aggregated",
    "Aggregation",
    "aggregate_triplets",
    "break_reason",
]

Aggregation = Literal["transition", "trajectory"]
"""How calls become samples; the names of Agent Lightning's ``trace_aggregator.level``."""
AGGREGATIONS: tuple[Aggregation, ...] = ("transition", "trajectory")

DRIFT = "drift"
"""The call keeps the sample's first prompt and is at least as long as the sample's sequence,
but differs inside it: the earlier turns were tokenised differently (retokenisation of a
response, a chat template that rewrites a turn)."""
REWRITTEN = "rewritten"
"""The call keeps the sample's first prompt but is shorter than the sample's sequence and does
not hold it: later turns were truncated, dropped or summarised, or a call was retried."""
BRANCH = "branch"
"""The call does not even keep the sample's first prompt: a different context (a sub-agent,
another conversation, a context rewritten from its start)."""


class Aggregated(NamedTuple):
    """What :func:`aggregate_triplets` made: the samples in call order, and per reason how many
    calls started a new sample because they did not continue the one before (empty in
    ``transition`` mode, where no call continues another)."""

    samples: list[Triplet]
    breaks: Counter[str]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low] and a[:high] != b[:high]: halve in C slices
    while high - low > 1:
        middle = (low + high) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle
    return low


def break_reason(sequence: Sequence[int], first_prompt_length: int, prompt: Sequence[int]) -> str | None:
    """Why a call with ``prompt`` does not continue a sample whose whole token sequence is
    ``sequence`` (its first ``first_prompt_length`` tokens being its first prompt), or None if
    it does (``prompt`` starts with ``sequence``)."""
    shared = _common_prefix(sequence, prompt)
    if shared == len(sequence):
        return None
    if shared < first_prompt_length:
        return BRANCH
    return REWRITTEN if len(prompt) < len(sequence) else DRIFT


def _span_ids(triplet: Triplet) -> list[str]:
    """The lineage of a call: its span_ids, or for a record written before they existed, the one
    span id its metadata names."""
    if triplet.span_ids:
        return list(triplet.span_ids)
    span_id = triplet.metadata.get("span_id")
    return [span_id] if isinstance(span_id, str) else []


def _logprobs(triplet: Triplet) -> list[float] | None:
    """The call's logprobs when there is one per response token, else None."""
    logprobs = triplet.response_logprobs
    if logprobs is None or len(logprobs) != len(triplet.response_token_ids):
        return None
    return list(logprobs)


def _policy_versions(triplet: Triplet) -> list[int | None]:
    """The serving version of each of the triplet's calls; None for each call when the record
    was written before versions were kept (or holds a list that does not match its calls)."""
    versions = triplet.policy_versions
    if len(versions) == triplet.calls:
        return list(versions)
    return [None] * triplet.calls


def _mask(triplet: Triplet) -> list[int]:
    """The call's response mask (all 1 for a single call: every response token was generated)."""
    mask = triplet.response_mask
    if mask is not None and len(mask) == len(triplet.response_token_ids):
        return list(mask)
    return [1] * len(triplet.response_token_ids)


class _Sample:
    """A sample being built: the first call's prompt, then the response part grown call by call."""

    def __init__(self, first: Triplet) -> None:
        self.first = first
        self.last = first
        self.prompt = list(first.prompt_token_ids)
        self.response = list(first.response_token_ids)
        self.sequence = self.prompt + self.response  # what the next call's prompt must start with
        self.mask = _mask(first)
        self.logprobs = _logprobs(first)
        self.span_ids = _span_ids(first)
        self.calls = first.calls
        self.policy_versions = _policy_versions(first)

    def extend(self, call: Triplet) -> None:
        inserted = list(call.prompt_token_ids[len(self.sequence) :])
        generated = list(call.response_token_ids)
        self.response += inserted + generated
        self.sequence += inserted + generated
        self.mask += [0] * len(inserted) + _mask(call)
        logprobs = _logprobs(call)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs += [0.0] * len(inserted) + logprobs
        else:
            self.logprobs = None
        self.span_ids += _span_ids(call)
        self.calls += call.calls
        self.policy_versions += _policy_versions(call)
        self.last = call

    def triplet(self) -> Triplet:
        return Triplet(
            prompt_token_ids=self.prompt,
            response_token_ids=self.response,
            response_logprobs=self.logprobs,
            reward=self.last.reward,
            metadata=dict(self.last.metadata),
            prompt_extra=self.first.prompt_extra,
            response_extra=self.last.response_extra,
            response_mask=self.mask,
            span_ids=self.span_ids,
            calls=self.calls,
            policy_versions=self.policy_versions,
        )


def aggregate_triplets(triplets: Sequence[Triplet], aggregation: Aggregation = "trajectory") -> Aggregated:
    """Turn the calls of one attempt, in call order, into training samples.

    ``transition``: the triplets themselves, one sample per call (nothing merged, no reasons).

    ``trajectory``: consecutive calls merged while each call's prompt starts with the sample's
    whole sequence so far. A merged sample has:

    * ``prompt_token_ids``: the first call's prompt;
    * ``response_token_ids``: the first call's response, then per later call the tokens of its
      prompt beyond the sequence so far (inserted: tool results, user and environment turns)
      and its response;
    * ``response_mask``: 1 on generated tokens, 0 on inserted ones (a mask on every sample,
      all 1 for a sample of one call);
    * ``response_logprobs``: aligned with the response part, 0.0 on inserted tokens (they were
      not sampled, and the mask keeps them out of the loss); None as soon as one merged call
      has none (or not one per response token);
    * ``reward``, ``metadata`` and ``response_extra``: the last merged call's, so the sample
      takes the reward today's matching gives its last call (the attempt's final reward when
      ``final_reward_to_last`` put it there); ``prompt_extra``: the first call's;
    * ``span_ids``: every merged call's, in call order; ``calls``: how many were merged;
    * ``policy_versions``: the serving version of every merged call, in call order (None per
      call of a record written before versions were kept), so ``len == calls``.

    A call that does not continue the sample before it starts a new one, counted under
    :func:`break_reason`'s answer in :attr:`Aggregated.breaks`.
    """
    if aggregation == "transition":
        return Aggregated(list(triplets), Counter())
    if aggregation != "trajectory":
        raise ValueError(f"unknown aggregation {aggregation!r}; expected one of {', '.join(AGGREGATIONS)}")
    samples: list[Triplet] = []
    breaks: Counter[str] = Counter()
    current: _Sample | None = None
    for call in triplets:
        if current is not None:
            reason = break_reason(current.sequence, len(current.prompt), call.prompt_token_ids)
            if reason is None:
                current.extend(call)
                continue
            breaks[reason] += 1
            samples.append(current.triplet())
        current = _Sample(call)
    if current is not None:
        samples.append(current.triplet())
    return Aggregated(samples, breaks)
