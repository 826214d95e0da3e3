"""Spans of one attempt -> training triplets: which LLM calls count, and which reward each gets.

A pure function of the span set and an :class:`AdapterConfig`: no I/O, no clock, no dependence
on input order or hash seeds, so replaying the same spans always gives the same triplets.
A malformed span never fails the trace: it is skipped and the reason recorded in
:attr:`AdapterResult.issues`.
"""

from __future__ import annotations

import json
import math
import numbers
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, StrictBool, field_validator

from agl_stream.agent.emitters import get_reward_value
from agl_stream.domain.adapter.lean import LeanSpan, TokenIds
from agl_stream.domain.adapter.trajectory import Aggregation, aggregate_triplets
from agl_stream.domain.adapter.tree import TraceNode, agent_name_of, build_tree, node_key, repair_hierarchy
from agl_stream.models import Span, Triplet
from agl_stream.wire.semconv import AGL_ANNOTATION, POLICY_VERSION

__all__ = [
    "DEFAULT_LLM_CALL_MATCH",
    "AdapterConfig",
    "AdapterResult",
    "RewardMatchPolicy",
    "extract_triplets",
]

DEFAULT_LLM_CALL_MATCH = r"openai\.(?:chat\.)?completion"
"""Matches (``re.search``) both span names the LLM proxy writes: ``openai.chat.completion`` for
chat calls, as in the seed, and ``openai.completion`` for text completions."""

PROMPT_TOKEN_IDS = "prompt_token_ids"
RESPONSE_TOKEN_IDS = "response_token_ids"
RESPONSE_ID = "gen_ai.response.id"
LOGPROBS_CONTENT = "logprobs.content"

# Where each is found, first key present wins: ours (and the OpenAI instrumentation's), then the
# Weave tracer's flattened operation output (the seed reads the same places).
_WEAVE_OUTPUT = "agentlightning.operation.output"
PROMPT_TOKEN_KEYS = (PROMPT_TOKEN_IDS, f"{_WEAVE_OUTPUT}.prompt_token_ids")
RESPONSE_TOKEN_KEYS = (
    RESPONSE_TOKEN_IDS,
    f"{_WEAVE_OUTPUT}.response_token_ids.0",
    f"{_WEAVE_OUTPUT}.choices.0.token_ids",  # newer vLLM
    f"{_WEAVE_OUTPUT}.choices.0.provider_specific_fields.token_ids",  # newer vLLM and OpenAI SDK
)
RESPONSE_ID_KEYS = (RESPONSE_ID, f"{_WEAVE_OUTPUT}.id")

# A reward written as an operation (``@reward``-decorated code of the seed's 0.3 line): a judge
# scope for the calls inside it, with or without a value.
AGL_OPERATION = "agentlightning.operation"
OPERATION_NAME = "agentlightning.operation.name"
REWARD_OPERATION = "agentlightning.reward"

# Pre-0.3 reward encodings; emitters.get_reward_value reads them but silently ignores a
# non-numeric value, which the adapter must report instead.
_AGENTOPS_OUTPUT_KEYS = ("agentops.task.output", "agentops.entity.output")
_LEGACY_REWARD_KEY = "reward"


class RewardMatchPolicy(str, Enum):
    """How reward spans are assigned to LLM calls (each call takes at most one reward)."""

    FIRST_OCCURRENCE = "first_occurrence"
    """In start-time order, a reward goes to the newest call that ended before the reward began
    and has no reward yet, wherever the two sit in the tree."""

    FIRST_SIBLING = "first_sibling"
    """Like first_occurrence, but only among calls with the same parent as the reward; a reward
    with no such call is dropped."""


class AdapterConfig(BaseModel):
    """Settings of :func:`extract_triplets` (the seed's ``TracerTraceToTriplet`` options).

    Attributes:
        llm_call_match: Regex searched in span names to select LLM call spans.
        agent_match: Regex searched in agent names; when set, only calls whose nearest enclosing
            agent span matches are kept. None keeps calls from anywhere.
        exclude_llm_call_in_reward: Drop calls nested under a reward span (LLM-as-judge calls).
        dedup_llm_call: Drop a call whose ``gen_ai.response.id`` was already taken, and a call
            without an id nested under a kept call (one request traced by two instrumentations).
        reward_match: A :class:`RewardMatchPolicy` or its value; anything else is rejected.
        repair_hierarchy: Re-parent floating top-level spans first (:func:`repair_hierarchy`).
        final_reward_to_last: When the last triplet got no reward from matching, give it the
            trace's final reward. Off by default, as in the seed's adapter.
        aggregation: ``transition`` (default): one triplet per kept call. ``trajectory``:
            consecutive calls whose prompts continue the sample before them merged into one
            sample with a response mask (:func:`~agl_stream.domain.adapter.trajectory.aggregate_triplets`).
            The trainer does not read response masks yet: keep ``transition`` for training.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    llm_call_match: str = DEFAULT_LLM_CALL_MATCH
    agent_match: str | None = None
    exclude_llm_call_in_reward: StrictBool = True
    dedup_llm_call: StrictBool = True
    reward_match: RewardMatchPolicy = RewardMatchPolicy.FIRST_OCCURRENCE
    repair_hierarchy: StrictBool = True
    final_reward_to_last: StrictBool = False
    aggregation: Aggregation = "transition"

    @field_validator("llm_call_match", "agent_match")
    @classmethod
    def _compiles(cls, pattern: str | None) -> str | None:
        if pattern is not None:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"invalid regular expression {pattern!r}: {exc}") from exc
        return pattern


@dataclass(frozen=True)
class AdapterResult:
    """What :func:`extract_triplets` found.

    Attributes:
        triplets: The training samples in call order (start time, then sequence id, span id):
            one per kept LLM call, or with ``aggregation="trajectory"`` consecutive calls merged.
        final_reward: The primary reward of the last reward span (highest sequence id), or None.
        issues: One human-readable line per span skipped or repaired, and per dropped reward.
        breaks: With ``aggregation="trajectory"``, per reason, the calls that started a new
            sample (:data:`~agl_stream.domain.adapter.trajectory.DRIFT`, ``REWRITTEN``, ``BRANCH``).
    """

    triplets: list[Triplet] = field(default_factory=list)
    final_reward: float | None = None
    issues: list[str] = field(default_factory=list)
    breaks: Counter[str] = field(default_factory=Counter)


@dataclass
class _Call:
    node: TraceNode
    agent_name: str | None
    response_id: str | None
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    logprobs: list[float] | None
    policy_version: int | None


@dataclass
class _Rewards:
    """Reward reading of every node: valid values, and the spans that at least look like rewards."""

    values: dict[str, float] = field(default_factory=dict)
    scopes: set[str] = field(default_factory=set)


# ---------------------------------------------------------------------------------------------
# Reading span attributes
# ---------------------------------------------------------------------------------------------


def _is_real(value: Any) -> bool:
    # bool is an int subclass; neither a token id nor a log-probability is ever a bool.
    kind = type(value)
    if kind is float or kind is int:  # the common case, without the ABC check (replay hot path)
        return True
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _first_key(attributes: Mapping[str, Any], keys: Sequence[str]) -> str:
    """The first of ``keys`` the attributes hold (the first key when none is there)."""
    for key in keys:
        if attributes.get(key) is not None:
            return key
    return keys[0]


def _token_ids(attributes: Mapping[str, Any], keys: Sequence[str]) -> tuple[list[int] | None, str | None]:
    """(ids, None) or (None, why not), from the first of ``keys`` present."""
    key = _first_key(attributes, keys)
    value = attributes.get(key)
    if type(value) is TokenIds and value:  # read from a record: non-negative ints already
        return value, None
    if value is None:
        return None, f"no {key}"
    if isinstance(value, tuple):
        value = list(value)
    if not isinstance(value, list):
        return None, f"{key} is a {type(value).__name__}, not a list of integers"
    if not value:
        return None, f"{key} is empty"
    if set(map(type, value)) == _INT_ONLY:  # decoded data: one pass in C (the hot path)
        return (list(value), None) if min(value) >= 0 else (None, f"{key} holds negative ids")
    if not all(isinstance(item, int) and not isinstance(item, bool) for item in value):
        kinds = sorted({type(item).__name__ for item in value if not isinstance(item, int) or isinstance(item, bool)})
        return None, f"{key} holds non-integer values ({', '.join(kinds)})"
    if any(item < 0 for item in value):
        return None, f"{key} holds negative ids"
    return list(value), None


_INT_ONLY = {int}
_FLOAT_ONLY = {float}
_scan_json: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def _json(text: str) -> Any:
    """``json.loads(text)``; text without surrounding whitespace goes straight to the scanner
    (json.loads adds two regex calls around it), anything else to json.loads and its errors."""
    try:
        value, end = _scan_json(text, 0)
    except (StopIteration, ValueError):
        return json.loads(text)
    return value if end == len(text) else json.loads(text)


def _logprobs(attributes: Mapping[str, Any], n_tokens: int) -> tuple[list[float] | None, str | None]:
    """Per-token log-probabilities from the OpenAI ``logprobs.content`` list (JSON text), if present."""
    raw = attributes.get(LOGPROBS_CONTENT)
    if raw is None:
        return None, None
    if not isinstance(raw, str):
        return None, f"{LOGPROBS_CONTENT} is a {type(raw).__name__}, not JSON text"
    try:
        content = _json(raw)
    except ValueError as exc:
        return None, f"{LOGPROBS_CONTENT} is not valid JSON ({exc})"
    if content is None:
        return None, None
    if not isinstance(content, list):
        return None, f"{LOGPROBS_CONTENT} is a JSON {type(content).__name__}, not a list"
    try:  # the usual shape, in C loops: dicts with a finite float logprob each
        fast = [entry["logprob"] for entry in content]
    except (TypeError, KeyError):
        fast = None
    if fast is not None and set(map(type, fast)) <= _FLOAT_ONLY and all(map(math.isfinite, fast)):
        if len(fast) != n_tokens:
            return None, f"{LOGPROBS_CONTENT} has {len(fast)} entries for {n_tokens} response tokens"
        return fast, None
    values: list[float] = []
    for index, entry in enumerate(content):
        logprob: Any = entry.get("logprob") if isinstance(entry, dict) else None
        if not _is_real(logprob) or not math.isfinite(logprob):
            return None, f"{LOGPROBS_CONTENT}[{index}] has no finite numeric logprob"
        values.append(float(logprob))
    # A length mismatch means logprobs and tokens come from different tokenizations or a
    # truncated record; pairing them up would train on wrong importance ratios.
    if len(values) != n_tokens:
        return None, f"{LOGPROBS_CONTENT} has {len(values)} entries for {n_tokens} response tokens"
    return values, None


def _policy_version(attributes: Mapping[str, Any]) -> tuple[int | None, str | None]:
    """The version of the server that answered the call (:data:`POLICY_VERSION`, which the LLM
    proxy writes when the server names one), or None; a value that is no version is reported."""
    value = attributes.get(POLICY_VERSION)
    if value is None:
        return None, None
    if type(value) is int and value >= 0:
        return value, None
    return None, f"{POLICY_VERSION} {value!r} is not a non-negative integer"


def _legacy_reward_is_non_numeric(span: LeanSpan) -> bool:
    attributes = span.attributes
    for key in _AGENTOPS_OUTPUT_KEYS:
        payload: Any = attributes.get(key)
        if isinstance(payload, str):
            try:
                payload = json.loads(payload)
            except ValueError:
                continue
        if isinstance(payload, dict) and payload.get("type") == "reward":
            value = payload.get("value")
            return value is not None and not isinstance(value, numbers.Real)
    if span.name == AGL_ANNOTATION and _LEGACY_REWARD_KEY in attributes:
        value = attributes[_LEGACY_REWARD_KEY]
        return value is not None and not isinstance(value, numbers.Real)
    return False


def _is_reward_operation(span: LeanSpan) -> bool:
    return span.name == AGL_OPERATION and span.attributes.get(OPERATION_NAME) == REWARD_OPERATION


def _read_rewards(nodes: Sequence[TraceNode], issues: list[str]) -> _Rewards:
    rewards = _Rewards()
    for node in nodes:
        if node.span is None:
            continue
        if not node.span.rewardish:  # no reward attribute: at most a reward operation (a judge's scope)
            if _is_reward_operation(node.span):
                rewards.scopes.add(node.id)
            continue
        try:
            value = get_reward_value(node.span)
        except (ValueError, TypeError) as exc:
            # Still a reward scope: an LLM call under a broken reward annotation is a judge call.
            rewards.scopes.add(node.id)
            issues.append(f"{node.label}: reward skipped: malformed reward attributes ({_one_line(exc)})")
            continue
        if value is None:
            if _legacy_reward_is_non_numeric(node.span):
                rewards.scopes.add(node.id)
                issues.append(f"{node.label}: reward skipped: legacy reward value is not a number")
            elif _is_reward_operation(node.span):
                rewards.scopes.add(node.id)  # a judge's scope, though it carries no value
            continue
        rewards.scopes.add(node.id)
        if not math.isfinite(value):
            issues.append(f"{node.label}: reward skipped: value {value} is not finite")
            continue
        rewards.values[node.id] = value
    return rewards


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


# ---------------------------------------------------------------------------------------------
# Selecting LLM calls
# ---------------------------------------------------------------------------------------------


class _Scope(NamedTuple):
    """What a node inherits from its ancestors."""

    agent_name: str | None
    in_matching_agent: bool
    reward_span: str | None  # id of the nearest enclosing reward span
    llm_call: str | None  # id of the nearest enclosing kept call


def _child_scope(node: TraceNode, scope: _Scope, agent_match: re.Pattern[str] | None, rewards: _Rewards) -> _Scope:
    own_agent = agent_name_of(node)
    in_reward = node.id in rewards.scopes
    if own_agent is None and not in_reward:
        return scope  # most nodes: the children inherit the very same scope
    agent_name, in_matching = scope.agent_name, scope.in_matching_agent
    if own_agent is not None:
        # The nearest agent decides: a non-matching agent nested in a matching one is excluded.
        in_matching = agent_match is None or agent_match.search(own_agent) is not None
        agent_name = own_agent if in_matching else None
    reward_span = node.id if in_reward else scope.reward_span
    return _Scope(agent_name, in_matching, reward_span, scope.llm_call)


def _select_call(
    node: TraceNode, scope: _Scope, config: AdapterConfig, seen_ids: set[str], issues: list[str]
) -> _Call | None:
    """The call ``node`` contributes, or None (with the reason recorded)."""
    span = node.span
    assert span is not None  # virtual nodes are named agentlightning.virtual, never an LLM call
    if not scope.in_matching_agent:
        issues.append(f"{node.label}: skipped: not inside an agent matching agent_match {config.agent_match!r}")
        return None
    if config.exclude_llm_call_in_reward and scope.reward_span is not None:
        issues.append(f"{node.label}: skipped: inside reward span {scope.reward_span}")
        return None
    raw_id = span.attributes.get(_first_key(span.attributes, RESPONSE_ID_KEYS))
    response_id = str(raw_id) if raw_id is not None else None
    if config.dedup_llm_call:
        if response_id is not None and response_id in seen_ids:
            issues.append(f"{node.label}: skipped: duplicate response id {response_id}")
            return None
        if response_id is None and scope.llm_call is not None:
            issues.append(f"{node.label}: skipped: no response id and nested in LLM call {scope.llm_call}")
            return None
    if span.end_time is None and span.start_time is not None:
        issues.append(f"{node.label}: skipped: the call never finished (no end time), so it is no training sample")
        return None
    prompt, why = _token_ids(span.attributes, PROMPT_TOKEN_KEYS)
    response, why_response = _token_ids(span.attributes, RESPONSE_TOKEN_KEYS)
    why = why or why_response
    if why is not None or prompt is None or response is None:
        issues.append(f"{node.label}: skipped: {why}")
        return None
    logprobs, why_logprobs = _logprobs(span.attributes, len(response))
    if why_logprobs is not None:  # the sample stands without them; its reward stays with it
        issues.append(f"{node.label}: logprobs dropped: {why_logprobs}")
    version, why_version = _policy_version(span.attributes)
    if why_version is not None:  # the sample stands without it (trained as of unknown version)
        issues.append(f"{node.label}: policy version dropped: {why_version}")
    if response_id is not None:
        seen_ids.add(response_id)
    return _Call(node, scope.agent_name, response_id, prompt, response, logprobs, version)


def _find_calls(root: TraceNode, config: AdapterConfig, rewards: _Rewards, issues: list[str]) -> list[_Call]:
    """Kept calls in pre-order, which decides which of two same-id spans wins (the outer, earlier one)."""
    calls: list[_Call] = []
    seen_ids: set[str] = set()
    llm_call = re.compile(config.llm_call_match)
    agent_match = re.compile(config.agent_match) if config.agent_match is not None else None
    start = _Scope(agent_name=None, in_matching_agent=config.agent_match is None, reward_span=None, llm_call=None)
    stack: list[tuple[TraceNode, _Scope]] = [(root, start)]
    while stack:
        node, scope = stack.pop()
        if node.span is not None and llm_call.search(node.name):
            call = _select_call(node, scope, config, seen_ids, issues)
            if call is not None:
                calls.append(call)
                scope = _Scope(scope.agent_name, scope.in_matching_agent, scope.reward_span, node.id)
        if node.children:
            child_scope = _child_scope(node, scope, agent_match, rewards)
            stack.extend([(child, child_scope) for child in reversed(node.children)])
    return calls


# ---------------------------------------------------------------------------------------------
# Matching rewards
# ---------------------------------------------------------------------------------------------


def _claim(pending: list[TraceNode], reward: TraceNode, assigned: dict[str, TraceNode]) -> bool:
    """Give ``reward`` to the newest pending call that ended before it began and has no reward."""
    for call in reversed(pending):
        if call.end <= reward.start and call.id not in assigned:
            assigned[call.id] = reward
            return True
    return False


def _match_first_occurrence(
    nodes: Sequence[TraceNode], call_ids: set[str], rewards: Mapping[str, float]
) -> tuple[dict[str, TraceNode], list[TraceNode]]:
    assigned: dict[str, TraceNode] = {}
    unmatched: list[TraceNode] = []
    pending: list[TraceNode] = []
    for node in sorted(nodes, key=node_key):
        if node.id in call_ids:
            pending.append(node)
        if node.id in rewards and not _claim(pending, node, assigned):
            unmatched.append(node)
    return assigned, unmatched


def _match_first_sibling(
    root: TraceNode, call_ids: set[str], rewards: Mapping[str, float]
) -> tuple[dict[str, TraceNode], list[TraceNode]]:
    assigned: dict[str, TraceNode] = {}
    unmatched: list[TraceNode] = []
    if root.id in rewards:
        unmatched.append(root)  # the root has no siblings
    for parent in root.walk():
        pending: list[TraceNode] = []
        for child in parent.children:
            if child.id in call_ids:
                pending.append(child)
            if child.id in rewards and not _claim(pending, child, assigned):
                unmatched.append(child)
    return assigned, unmatched


def _final_reward(nodes: Sequence[TraceNode], rewards: Mapping[str, float]) -> TraceNode | None:
    # Sequence ids are taken as spans end, so the highest one is the reward emitted last: the
    # same choice as emitters.find_final_reward over spans in sequence order.
    reward_nodes = [node for node in nodes if node.id in rewards]
    return max(reward_nodes, key=lambda node: (node.sequence_id, node.end, node.id), default=None)


# ---------------------------------------------------------------------------------------------
# The adapter
# ---------------------------------------------------------------------------------------------


_TRIPLET_FIELDS_SET = frozenset(
    {"prompt_token_ids", "response_token_ids", "response_logprobs", "reward", "metadata", "span_ids", "policy_versions"}
)


def _triplet(call: _Call, reward: float | None, reward_span: TraceNode | None, source: str | None) -> Triplet:
    """The Triplet that ``Triplet(prompt_token_ids=..., ..., metadata=...)`` validates to, built
    without validation: every value here is already of its field's type (fresh lists of ints
    and floats, a float or None, a dict of JSON scalars), and validating 100-odd numbers a call
    cost more than the rest of the adapter (tested equal to the validated model)."""
    triplet = Triplet.__new__(Triplet)
    object.__setattr__(
        triplet,
        "__dict__",
        {
            "prompt_token_ids": call.prompt_token_ids,
            "response_token_ids": call.response_token_ids,
            "response_logprobs": call.logprobs,
            "reward": reward,
            "metadata": {
                "response_id": call.response_id,
                "span_id": call.node.id,
                "sequence_id": call.node.sequence_id,
                "span_name": call.node.name,
                "agent_name": call.agent_name,
                "reward_span_id": reward_span.id if reward_span is not None else None,
                "reward_source": source,
            },
            "prompt_extra": None,
            "response_extra": None,
            "response_mask": None,
            "span_ids": [call.node.id],
            "calls": 1,
            "policy_versions": [call.policy_version],
        },
    )
    object.__setattr__(triplet, "__pydantic_fields_set__", set(_TRIPLET_FIELDS_SET))
    object.__setattr__(triplet, "__pydantic_extra__", None)
    object.__setattr__(triplet, "__pydantic_private__", None)
    return triplet


def extract_triplets(spans: Sequence[Span | LeanSpan], config: AdapterConfig | None = None) -> AdapterResult:
    """Turn the spans of one attempt into triplets, one per kept LLM call (span models are read
    as their :class:`~agl_stream.domain.adapter.lean.LeanSpan`, what the replay decodes directly).

    Steps: build the span tree (:func:`agl_stream.domain.adapter.tree.build_tree`), optionally repair
    it, read every reward span, select LLM calls (name, agent scope, not under a reward span,
    dedup by response id, valid token ids and logprobs), match rewards to the selected calls
    by ``config.reward_match``, order triplets by call, put the final reward on the last
    triplet if it has none (``config.final_reward_to_last``), and with
    ``config.aggregation == "trajectory"`` merge consecutive calls into samples.
    """
    config = config or AdapterConfig()
    if not spans:
        return AdapterResult()
    tree = build_tree(spans)
    issues = list(tree.issues)
    if config.repair_hierarchy:
        repair_hierarchy(tree.root, re.compile(config.llm_call_match))
    nodes = tree.nodes()
    rewards = _read_rewards(nodes, issues)
    calls = _find_calls(tree.root, config, rewards, issues)

    assigned: dict[str, TraceNode] = {}
    final_node: TraceNode | None = None
    if rewards.values:  # without reward values there is nothing to match, nor a final reward
        call_ids = {call.node.id for call in calls}
        if config.reward_match is RewardMatchPolicy.FIRST_SIBLING:
            assigned, unmatched = _match_first_sibling(tree.root, call_ids, rewards.values)
        else:
            assigned, unmatched = _match_first_occurrence(nodes, call_ids, rewards.values)
        policy = config.reward_match.value
        for node in sorted(unmatched, key=node_key):
            issues.append(f"{node.label}: reward {rewards.values[node.id]} matched no LLM call ({policy})")
        final_node = _final_reward(nodes, rewards.values)
    final_reward = rewards.values[final_node.id] if final_node is not None else None

    calls.sort(key=lambda call: node_key(call.node))
    triplets: list[Triplet] = []
    for call in calls:
        reward_node = assigned.get(call.node.id)
        if reward_node is not None:
            triplets.append(_triplet(call, rewards.values[reward_node.id], reward_node, config.reward_match.value))
        else:
            triplets.append(_triplet(call, None, None, None))
    if config.final_reward_to_last and triplets and triplets[-1].reward is None and final_node is not None:
        triplets[-1] = _triplet(calls[-1], final_reward, final_node, "final_reward")
    if config.aggregation == "transition":
        return AdapterResult(triplets=triplets, final_reward=final_reward, issues=issues)
    samples, breaks = aggregate_triplets(triplets, config.aggregation)
    return AdapterResult(triplets=samples, final_reward=final_reward, issues=issues, breaks=breaks)
