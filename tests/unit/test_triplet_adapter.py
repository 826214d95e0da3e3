"""The trace -> triplet adapter on hand-built span trees: the seed's rules, our fixes, bad input."""

from __future__ import annotations

import json
import math
import random
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agl_stream.domain.adapter import (
    DEFAULT_LLM_CALL_MATCH,
    VIRTUAL_ROOT_ID,
    AdapterConfig,
    AdapterResult,
    RewardMatchPolicy,
    agent_name_of,
    build_tree,
    extract_triplets,
    repair_hierarchy,
)
from agl_stream.domain.adapter.tree import TraceNode
from agl_stream.models import Span
from agl_stream.wire.semconv import AGL_ANNOTATION, AGL_VIRTUAL

CHAT = "openai.chat.completion"


def sid(n: int) -> str:
    return f"{n:016x}"


class Trace:
    """Builds the spans of one attempt. Sequence ids follow creation order unless given."""

    def __init__(self) -> None:
        self.spans: list[Span] = []

    def add(
        self,
        name: str,
        start: float | None,
        end: float | None,
        parent: str | None = None,
        *,
        seq: int | None = None,
        span_id: str | None = None,
        attrs: dict[str, Any] | None = None,
        **attributes: Any,
    ) -> str:
        attributes = {**(attrs or {}), **attributes}
        n = len(self.spans) + 1
        span = Span(
            rollout_id="ro-000000000001",
            attempt_id="at-00000001",
            sequence_id=seq if seq is not None else n,
            trace_id="ab" * 16,
            span_id=span_id or sid(n),
            parent_id=parent,
            name=name,
            attributes=attributes,
            start_time=start,
            end_time=end,
        )
        self.spans.append(span)
        return span.span_id

    def root(self, start: float = 0.0, end: float = 100.0) -> str:
        return self.add("session", start, end)

    def agent(self, parent: str | None, start: float, end: float, name: str) -> str:
        return self.add("agent_run", start, end, parent, attrs={"agent.name": name})

    def call(
        self,
        parent: str | None,
        start: float | None,
        end: float | None,
        rid: str | None = "auto",
        *,
        name: str = CHAT,
        prompt: Any = (1, 2),
        response: Any = (3, 4),
        span_id: str | None = None,
        seq: int | None = None,
        attrs: dict[str, Any] | None = None,
    ) -> str:
        attributes = dict(attrs or {})
        if rid == "auto":
            rid = f"resp-{len(self.spans) + 1}"
        if rid is not None:
            attributes["gen_ai.response.id"] = rid
        if prompt is not None:
            attributes["prompt_token_ids"] = list(prompt) if isinstance(prompt, tuple) else prompt
        if response is not None:
            attributes["response_token_ids"] = list(response) if isinstance(response, tuple) else response
        return self.add(name, start, end, parent, seq=seq, span_id=span_id, attrs=attributes)

    def reward(self, parent: str | None, at: float, value: Any, *, seq: int | None = None) -> str:
        attributes = {"agentlightning.reward.0.name": "primary", "agentlightning.reward.0.value": value}
        return self.add(AGL_ANNOTATION, at, at, parent, seq=seq, attrs=attributes)


def run(trace: Trace, **config: Any) -> AdapterResult:
    return extract_triplets(trace.spans, AdapterConfig(**config))


def rids(result: AdapterResult) -> list[str | None]:
    return [t.metadata["response_id"] for t in result.triplets]


def rewards(result: AdapterResult) -> list[float | None]:
    return [t.reward for t in result.triplets]


def issues_about(result: AdapterResult, span_id: str) -> list[str]:
    return [issue for issue in result.issues if span_id in issue]


# --- basics -----------------------------------------------------------------------------------


def test_single_call_with_reward() -> None:
    t = Trace()
    root = t.root()
    call = t.call(root, 1, 2, "r1", prompt=(5, 6, 7), response=(8, 9))
    rew = t.reward(root, 3, 0.75)
    result = run(t)
    assert result.issues == []
    assert result.final_reward == 0.75
    [triplet] = result.triplets
    assert triplet.prompt_token_ids == [5, 6, 7]
    assert triplet.response_token_ids == [8, 9]
    assert triplet.response_logprobs is None
    assert triplet.reward == 0.75
    assert triplet.metadata == {
        "response_id": "r1",
        "span_id": call,
        "sequence_id": 2,
        "span_name": CHAT,
        "agent_name": None,
        "reward_span_id": rew,
        "reward_source": "first_occurrence",
    }


def test_empty_input_gives_empty_result() -> None:
    assert extract_triplets([]) == AdapterResult(triplets=[], final_reward=None, issues=[])
    with pytest.raises(ValueError):
        build_tree([])


def test_default_regex_matches_chat_and_text_completions_only() -> None:
    t = Trace()
    root = t.root()
    t.call(root, 1, 2, "chat", name="openai.chat.completion")
    t.call(root, 3, 4, "text", name="openai.completion")
    t.call(root, 5, 6, "emb", name="openai.embeddings")
    t.call(root, 7, 8, "other", name="chat gpt-4o")
    assert rids(run(t)) == ["chat", "text"]
    assert rids(run(t, llm_call_match=r"openai\.chat\.completion")) == ["chat"]
    assert DEFAULT_LLM_CALL_MATCH == AdapterConfig().llm_call_match


def test_config_validation() -> None:
    assert AdapterConfig(reward_match="first_sibling").reward_match is RewardMatchPolicy.FIRST_SIBLING  # type: ignore[arg-type]
    assert AdapterConfig(reward_match=RewardMatchPolicy.FIRST_SIBLING).reward_match is RewardMatchPolicy.FIRST_SIBLING
    with pytest.raises(ValueError):
        AdapterConfig(reward_match="last_occurrence")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        AdapterConfig(llm_call_match="(")
    with pytest.raises(ValueError):
        AdapterConfig(agent_match="[")
    with pytest.raises(ValueError):
        AdapterConfig(repair_hierarchy="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        AdapterConfig(unknown_option=True)  # type: ignore[call-arg]


def test_logprobs_are_read_from_openai_content() -> None:
    t = Trace()
    root = t.root()
    content = [{"token": "a", "logprob": -0.5, "top_logprobs": []}, {"token": "b", "logprob": -1, "bytes": [98]}]
    t.call(root, 1, 2, "r1", response=(3, 4), attrs={"logprobs.content": json.dumps(content)})
    t.call(root, 3, 4, "r2", attrs={"logprobs.content": "null"})
    result = run(t)
    assert result.issues == []
    assert [tr.response_logprobs for tr in result.triplets] == [[-0.5, -1.0], None]


# --- call order -------------------------------------------------------------------------------


def test_triplets_are_in_call_order_not_tree_order() -> None:
    t = Trace()
    root = t.root()
    agent = t.agent(root, 0.5, 10, "solver")
    t.call(agent, 5, 6, "late")  # first in pre-order: the agent subtree starts first
    t.call(root, 1, 2, "early")
    assert rids(run(t, repair_hierarchy=False)) == ["early", "late"]


def test_equal_start_times_are_ordered_by_sequence_id() -> None:
    t = Trace()
    root = t.root()
    t.call(root, 1, 2, "second", seq=20)
    t.call(root, 1, 3, "first", seq=10)
    assert rids(run(t, repair_hierarchy=False)) == ["first", "second"]


# --- reward matching: first_occurrence --------------------------------------------------------


def test_first_occurrence_gives_each_reward_to_the_newest_finished_call() -> None:
    t = Trace()
    root = t.root()
    t.call(root, 1, 2, "a")
    t.reward(root, 2.5, 0.1)
    t.call(root, 3, 4, "b")
    t.reward(root, 4.5, 0.2)
    result = run(t)
    assert rewards(result) == [0.1, 0.2]
    assert result.final_reward == 0.2


def test_first_occurrence_skips_calls_still_running_when_the_reward_starts() -> None:
    t = Trace()
    root = t.root()
    t.call(root, 1, 2, "a")
    t.call(root, 3, 6, "b")
    t.reward(root, 5, 0.5)  # during b: goes to a
    result = run(t, final_reward_to_last=False)
    assert rewards(result) == [0.5, None]


def test_first_occurrence_second_reward_walks_back_to_an_unrewarded_call() -> None:
    t = Trace()
    root = t.root()
    t.call(root, 1, 2, "a")
    t.call(root, 3, 4, "b")
    t.reward(root, 5, 0.3)
    t.reward(root, 6, 0.9)
    result = run(t)
    assert rewards(result) == [0.9, 0.3]
    assert result.final_reward == 0.9


def test_first_occurrence_ignores_tree_position() -> None:
    t = Trace()
    root = t.root()
    agent = t.agent(root, 0.5, 3, "solver")
    t.call(agent, 1, 2, "a")
    t.reward(root, 4, 1.0)  # not a sibling, still matched
    assert rewards(run(t)) == [1.0]


def test_reward_before_any_call_is_reported_unmatched() -> None:
    t = Trace()
    root = t.root()
    early = t.reward(root, 0.5, 0.4)
    t.call(root, 1, 2, "a")
    result = run(t, final_reward_to_last=False)
    assert rewards(result) == [None]
    assert any("matched no LLM call (first_occurrence)" in issue for issue in issues_about(result, early))


# --- reward matching: first_sibling -----------------------------------------------------------


def test_first_sibling_matches_only_calls_with_the_same_parent() -> None:
    t = Trace()
    root = t.root()
    agent = t.agent(root, 0.5, 5, "solver")
    t.call(agent, 1, 2, "a")
    t.reward(agent, 2.5, 0.6)
    t.call(agent, 3, 4, "b")
    outside = t.reward(root, 6, 0.9)  # b is not its sibling: dropped
    result = run(t, reward_match="first_sibling", final_reward_to_last=False)
    assert rewards(result) == [0.6, None]
    assert any("matched no LLM call (first_sibling)" in issue for issue in issues_about(result, outside))
    assert result.triplets[0].metadata["reward_source"] == "first_sibling"


def test_first_sibling_gives_reward_to_the_latest_earlier_unrewarded_sibling() -> None:
    t = Trace()
    root = t.root()
    t.call(root, 1, 2, "a")
    t.call(root, 3, 4, "b")
    t.reward(root, 5, 0.1)
    t.reward(root, 6, 0.2)
    assert rewards(run(t, reward_match="first_sibling", repair_hierarchy=False)) == [0.2, 0.1]


def test_reward_emitted_during_a_call_is_not_moved_under_it_by_repair() -> None:
    # The seed's repair moved the reward under the call (tightest window), so first_sibling lost it.
    t = Trace()
    root = t.root()
    t.call(root, 1, 2, "a")
    t.call(root, 3, 8, "b")
    t.reward(root, 5, 0.7)
    result = run(t, reward_match="first_sibling", final_reward_to_last=False)
    assert rewards(result) == [0.7, None]


# --- final reward -----------------------------------------------------------------------------


def test_final_reward_goes_on_the_last_triplet_when_it_has_none() -> None:
    t = Trace()
    root = t.root()
    t.call(root, 1, 2, "a")
    agent = t.agent(root, 2.5, 4, "solver")
    t.call(agent, 3, 3.5, "b")
    final = t.reward(root, 5, 1.0)  # a's sibling, not b's
    result = run(t, reward_match="first_sibling", repair_hierarchy=False, final_reward_to_last=True)
    assert result.final_reward == 1.0
    # As the seed's to_trajectory(final_reward=...), the last transition carries the outcome
    # even when matching already gave that reward span to an earlier call; reward_source tells
    # the two apart.
    assert rewards(result) == [1.0, 1.0]
    assert [tr.metadata["reward_source"] for tr in result.triplets] == ["first_sibling", "final_reward"]
    assert result.triplets[-1].metadata["reward_span_id"] == final
    off = run(t, reward_match="first_sibling", repair_hierarchy=False)  # the seed's adapter's default
    assert rewards(off) == [1.0, None]
    assert off.final_reward == 1.0


def test_final_reward_does_not_replace_a_matched_reward() -> None:
    t = Trace()
    root = t.root()
    t.call(root, 1, 2, "a")
    t.call(root, 3, 4, "b")
    t.reward(root, 4.5, 0.2)
    t.reward(root, 5, 0.8)
    result = run(t)
    assert rewards(result) == [0.8, 0.2]
    assert result.final_reward == 0.8


def test_final_reward_is_the_last_emitted_by_sequence_id() -> None:
    t = Trace()
    root = t.root()
    t.reward(root, 5, 0.1, seq=9)
    t.reward(root, 6, 0.2, seq=8)
    assert run(t).final_reward == 0.1


def test_no_reward_spans_means_no_final_reward() -> None:
    t = Trace()
    t.call(t.root(), 1, 2)
    result = run(t)
    assert result.final_reward is None
    assert rewards(result) == [None]


# --- agent_match ------------------------------------------------------------------------------


def test_agent_match_keeps_only_calls_of_matching_agents() -> None:
    t = Trace()
    root = t.root()
    solver = t.agent(root, 1, 5, "solver")
    t.call(solver, 2, 3, "s1")
    critic = t.agent(root, 6, 9, "critic")
    skipped = t.call(critic, 7, 8, "c1")
    result = run(t, agent_match="^solver$")
    assert rids(result) == ["s1"]
    assert result.triplets[0].metadata["agent_name"] == "solver"
    assert any("agent_match" in issue for issue in issues_about(result, skipped))
    assert rids(run(t)) == ["s1", "c1"]
    assert [tr.metadata["agent_name"] for tr in run(t).triplets] == ["solver", "critic"]


def test_nearest_agent_decides() -> None:
    t = Trace()
    root = t.root()
    outer = t.agent(root, 1, 10, "solver")
    inner = t.agent(outer, 2, 5, "tool-agent")
    t.call(inner, 3, 4, "inner")
    t.call(outer, 6, 7, "outer")
    assert rids(run(t, agent_match="solver")) == ["outer"]


def test_calls_outside_any_agent_are_dropped_with_agent_match() -> None:
    t = Trace()
    t.call(t.root(), 1, 2, "loose")
    result = run(t, agent_match="solver")
    assert result.triplets == []
    assert len(result.issues) == 1


@pytest.mark.parametrize(
    ("attributes", "expected"),
    [
        ({"agent.name": "a"}, "a"),
        ({"agentops.span.kind": "agent", "operation.name": "b"}, "b"),
        ({"agentops.span.kind": "task", "operation.name": "b"}, None),
        ({"recipient_agent_type": "c"}, "c"),
        ({"langchain.chain.type": "d"}, "d"),
        ({"executor.id": "e"}, "e"),
        ({"agent.name": "a", "executor.id": "e"}, "a"),
        ({"agent.name": 7}, None),
        ({}, None),
    ],
)
def test_agent_name_detection(attributes: dict[str, Any], expected: str | None) -> None:
    t = Trace()
    t.add("x", 0, 1, attrs=attributes)
    tree = build_tree(t.spans)
    assert agent_name_of(tree.root) == expected


# --- exclude_llm_call_in_reward ---------------------------------------------------------------


def judge_trace() -> tuple[Trace, str]:
    t = Trace()
    root = t.root()
    t.call(root, 1, 2, "policy")
    reward = t.add(
        AGL_ANNOTATION,
        3,
        6,
        root,
        attrs={"agentlightning.reward.0.name": "primary", "agentlightning.reward.0.value": 1.0},
    )
    judge = t.call(reward, 4, 5, "judge")
    return t, judge


def test_llm_calls_under_reward_spans_are_excluded() -> None:
    t, judge = judge_trace()
    result = run(t)
    assert rids(result) == ["policy"]
    assert rewards(result) == [1.0]
    assert any("inside reward span" in issue for issue in issues_about(result, judge))


def test_llm_calls_under_reward_spans_kept_when_not_excluded() -> None:
    t, _ = judge_trace()
    assert rids(run(t, exclude_llm_call_in_reward=False)) == ["policy", "judge"]


def test_llm_calls_under_a_malformed_reward_span_are_still_excluded() -> None:
    t = Trace()
    root = t.root()
    bad = t.add(AGL_ANNOTATION, 3, 6, root, attrs={"agentlightning.reward.0.value": "not a number"})
    t.call(bad, 4, 5, "judge")
    result = run(t)
    assert result.triplets == []
    assert any("malformed reward" in issue for issue in issues_about(result, bad))


# --- dedup ------------------------------------------------------------------------------------


def test_duplicate_response_ids_keep_the_first_call() -> None:
    t = Trace()
    root = t.root()
    t.call(root, 1, 2, "same")
    dup = t.call(root, 3, 4, "same")
    result = run(t)
    assert [tr.metadata["span_id"] for tr in result.triplets] != [dup]
    assert len(result.triplets) == 1
    assert any("duplicate response id" in issue for issue in issues_about(result, dup))
    assert len(run(t, dedup_llm_call=False).triplets) == 2


def test_nested_call_without_response_id_is_dropped_but_different_id_kept() -> None:
    t = Trace()
    root = t.root()
    outer = t.call(root, 1, 5, "outer")
    no_id = t.call(outer, 2, 3, None)
    t.call(outer, 3.5, 4, "other")
    result = run(t)
    assert rids(result) == ["outer", "other"]
    assert any("no response id and nested" in issue for issue in issues_about(result, no_id))
    assert rids(run(t, dedup_llm_call=False)) == ["outer", None, "other"]


def test_top_level_call_without_response_id_is_kept() -> None:
    t = Trace()
    t.call(t.root(), 1, 2, None)
    assert rids(run(t)) == [None]


def test_duplicate_without_tokens_does_not_shadow_the_one_with_tokens() -> None:
    t = Trace()
    root = t.root()
    outer = t.call(root, 1, 5, "same", prompt=None, response=None)
    inner = t.call(outer, 2, 3, "same")
    result = run(t)
    assert [tr.metadata["span_id"] for tr in result.triplets] == [inner]
    assert any("no prompt_token_ids" in issue for issue in issues_about(result, outer))


# --- hierarchy repair -------------------------------------------------------------------------


def floating_call_trace() -> Trace:
    t = Trace()
    root = t.root()
    agent = t.agent(root, 1, 10, "solver")
    t.add("tool", 2, 3, agent)
    t.call(root, 4, 5, "floating")  # recorded by another tracer, no parent link to the agent
    return t


def test_repair_moves_floating_calls_under_the_enclosing_agent() -> None:
    t = floating_call_trace()
    assert rids(run(t, agent_match="solver")) == ["floating"]
    assert rids(run(t, agent_match="solver", repair_hierarchy=False)) == []


def test_repair_descends_through_single_child_wrappers() -> None:
    t = Trace()
    session = t.add("run_one.session", 0, 100)
    inner_root = t.add("workflow", 0.5, 50, session)
    agent = t.agent(inner_root, 1, 10, "solver")
    t.add("tool", 2, 3, agent)
    t.call(inner_root, 4, 5, "floating")
    assert rids(run(t, agent_match="solver")) == ["floating"]


def test_repair_picks_the_tightest_container() -> None:
    t = Trace()
    root = t.root()
    outer = t.add("outer", 1, 20, root)
    tight = t.add("tight", 3, 8, outer)
    call = t.call(root, 4, 5)
    tree = build_tree(t.spans)
    moves = repair_hierarchy(tree.root)
    assert moves == [f"{call} ({CHAT}) moved under {tight} (tight)"]


def test_repair_only_moves_when_the_container_is_strictly_wider() -> None:
    t = Trace()
    root = t.root()
    t.add("a", 1, 5, root)
    t.add("b", 1, 5, root)
    tree = build_tree(t.spans)
    assert repair_hierarchy(tree.root) == []


def test_repair_never_moves_a_span_under_its_own_descendant() -> None:
    # The child is wider than its parent; the seed moved the parent under it, detaching both.
    t = Trace()
    root = t.root()
    parent = t.agent(root, 2, 4, "solver")
    wide = t.add("wide", 1, 5, parent)
    t.call(wide, 2.5, 3, "inside")
    t.call(root, 6, 7, "after")
    result = run(t)
    assert rids(result) == ["inside", "after"]
    tree = build_tree(t.spans)
    repair_hierarchy(tree.root)
    assert len(tree.nodes()) == len(t.spans)


def test_repair_does_not_move_spans_under_llm_calls_but_nests_duplicate_calls() -> None:
    t = Trace()
    root = t.root()
    call = t.call(root, 1, 10, "outer")
    t.add("tool", 2, 3, root)
    twin = t.call(root, 4, 5, None)  # a second instrumentation of the same request
    tree = build_tree(t.spans)
    moves = repair_hierarchy(tree.root, re.compile(DEFAULT_LLM_CALL_MATCH))
    assert moves == [f"{twin} ({CHAT}) moved under {call} ({CHAT})"]
    result = run(t)
    assert rids(result) == ["outer"]


def test_repair_leaves_spans_without_timestamps_alone() -> None:
    t = Trace()
    root = t.root()
    t.add("agent", 1, 10, root)
    t.call(root, None, None, "untimed")
    result = run(t)
    assert rids(result) == ["untimed"]


# --- tree building: missing roots, virtual nodes, cycles --------------------------------------


def test_missing_root_gets_a_virtual_node_and_an_issue() -> None:
    t = Trace()
    lost = sid(999)
    t.call(lost, 1, 2, "a")
    t.reward(lost, 3, 0.5)
    tree = build_tree(t.spans)
    assert tree.root.name == AGL_VIRTUAL
    assert tree.root.id == lost
    assert (tree.root.start, tree.root.end) == (1, 3)
    result = run(t)
    assert rids(result) == ["a"]
    assert rewards(result) == [0.5]
    assert len(issues_about(result, lost)) == 1


def test_several_top_level_nodes_go_under_a_virtual_root_in_time_order() -> None:
    t = Trace()
    t.call(sid(902), 5, 6, "b")
    t.call(sid(901), 1, 2, "a")
    t.add("real-root", 3, 4)
    tree = build_tree(t.spans)
    assert tree.root.id == VIRTUAL_ROOT_ID
    assert tree.root.name == AGL_VIRTUAL
    assert [child.id for child in tree.root.children] == [sid(901), sid(3), sid(902)]
    assert rids(run(t)) == ["a", "b"]


def test_parent_cycles_are_cut_deterministically() -> None:
    t = Trace()
    t.call(sid(2), 1, 5, "a", span_id=sid(1))
    t.call(sid(1), 2, 3, "b", span_id=sid(2))
    t.call(sid(2), 3.5, 4, "c", span_id=sid(3))  # hangs off the cycle
    tree = build_tree(t.spans)
    assert tree.root.id == sid(1)
    assert [node.id for node in tree.root.walk()] == [sid(1), sid(2), sid(3)]
    assert len(tree.issues) == 1 and "cycle" in tree.issues[0]
    assert sorted(str(r) for r in rids(run(t, dedup_llm_call=False))) == ["a", "b", "c"]


def test_self_parent_is_treated_as_top_level() -> None:
    t = Trace()
    t.call(sid(1), 1, 2, "a", span_id=sid(1))
    result = run(t)
    assert rids(result) == ["a"]
    assert any("names itself as parent" in issue for issue in result.issues)


def test_duplicate_span_ids_keep_the_lowest_sequence_id() -> None:
    t = Trace()
    root = t.root()
    t.call(root, 1, 2, "first", span_id=sid(50), seq=5)
    t.call(root, 1, 2, "redelivered", span_id=sid(50), seq=6)
    result = run(t)
    assert rids(result) == ["first"]
    assert any("duplicate span id" in issue for issue in issues_about(result, sid(50)))


# --- skipping calls without usable tokens -----------------------------------------------------


def test_calls_without_token_ids_are_skipped_before_reward_matching() -> None:
    t = Trace()
    root = t.root()
    t.call(root, 1, 2, "a")
    empty = t.call(root, 3, 4, "b", prompt=None, response=None)
    t.reward(root, 5, 0.9)
    result = run(t, final_reward_to_last=False)
    assert rids(result) == ["a"]
    assert rewards(result) == [0.9]  # the skipped call does not absorb the reward
    assert issues_about(result, empty) == [f"span {empty} ({CHAT}, seq 3): skipped: no prompt_token_ids"]


@pytest.mark.parametrize(
    ("prompt", "response", "reason"),
    [
        ([], [1], "prompt_token_ids is empty"),
        ([1], [], "response_token_ids is empty"),
        ([1], None, "no response_token_ids"),
        ([True, False], [1], "prompt_token_ids holds non-integer values (bool)"),
        (["1", "2"], [1], "prompt_token_ids holds non-integer values (str)"),
        ([1], [1.0, 2.0], "response_token_ids holds non-integer values (float)"),
        ([1, None], [1], "prompt_token_ids holds non-integer values (NoneType)"),
        ("[1, 2]", [1], "prompt_token_ids is a str, not a list of integers"),
        (7, [1], "prompt_token_ids is a int, not a list of integers"),
        ([1, -2], [1], "prompt_token_ids holds negative ids"),
    ],
)
def test_bad_token_ids_are_skipped_with_a_reason(prompt: Any, response: Any, reason: str) -> None:
    t = Trace()
    root = t.root()
    good = t.call(root, 1, 2, "good")
    bad = t.call(root, 3, 4, "bad", prompt=prompt, response=response)
    result = run(t)
    assert [tr.metadata["span_id"] for tr in result.triplets] == [good]
    assert issues_about(result, bad) == [f"span {bad} ({CHAT}, seq 3): skipped: {reason}"]


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ("{not json", "is not valid JSON"),
        ('{"content": []}', "is a JSON dict, not a list"),
        ('[{"token": "a", "logprob": "x"}, {"token": "b", "logprob": -1}]', "[0] has no finite numeric logprob"),
        ('[{"token": "a"}, {"token": "b", "logprob": -1}]', "[0] has no finite numeric logprob"),
        ('[{"logprob": -1}, {"logprob": NaN}]', "[1] has no finite numeric logprob"),
        ('[{"logprob": -1}, {"logprob": true}]', "[1] has no finite numeric logprob"),
        ("[1, 2]", "[0] has no finite numeric logprob"),
        ('[{"logprob": -1}]', "has 1 entries for 2 response tokens"),
    ],
)
def test_bad_logprobs_are_dropped_and_the_call_kept_with_a_reason(raw: str, reason: str) -> None:
    t = Trace()
    root = t.root()
    t.call(root, 1, 2, "good")
    bad = t.call(root, 3, 4, "bad", attrs={"logprobs.content": raw})
    t.reward(root, 5, 0.5)
    result = run(t)
    assert rids(result) == ["good", "bad"]  # the sample stays, and its reward with it
    assert rewards(result) == [None, 0.5] and result.triplets[1].response_logprobs is None
    [issue] = issues_about(result, bad)
    assert "logprobs dropped" in issue and "logprobs.content" in issue and reason in issue


def test_logprobs_that_are_not_text_are_rejected() -> None:
    t = Trace()
    bad = t.call(t.root(), 1, 2, "bad", attrs={"logprobs.content": [-0.1, -0.2]})
    result = run(t)
    assert rids(result) == ["bad"] and result.triplets[0].response_logprobs is None
    assert "not JSON text" in issues_about(result, bad)[0]


# --- malformed rewards ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("attributes", "reason"),
    [
        ({"agentlightning.reward.0.name": "primary", "agentlightning.reward.0.value": "high"}, "malformed reward"),
        ({"agentlightning.reward.0.name": "primary"}, "malformed reward"),
        ({"agentlightning.reward.1.name": "x", "agentlightning.reward.1.value": 1.0}, "malformed reward"),
        ({"agentlightning.reward.0.name": "primary", "agentlightning.reward.0.value": math.nan}, "not finite"),
        ({"reward": "0.5"}, "legacy reward value is not a number"),
        ({"agentops.task.output": '{"type": "reward", "value": "good"}'}, "legacy reward value is not a number"),
    ],
)
def test_malformed_reward_spans_are_isolated(attributes: dict[str, Any], reason: str) -> None:
    t = Trace()
    root = t.root()
    t.call(root, 1, 2, "a")
    t.call(root, 3, 4, "b")
    t.reward(root, 4.5, 0.25)
    bad = t.add(AGL_ANNOTATION, 5, 5, root, attrs=attributes)
    result = run(t)
    assert rewards(result) == [None, 0.25]
    assert result.final_reward == 0.25
    [issue] = issues_about(result, bad)
    assert reason in issue


def test_legacy_reward_encodings_still_score() -> None:
    t = Trace()
    root = t.root()
    t.call(root, 1, 2, "a")
    t.add(AGL_ANNOTATION, 3, 3, root, reward=0.5)
    t.call(root, 4, 5, "b")
    t.add("reward_fn", 6, 6, root, attrs={"agentops.task.output": json.dumps({"type": "reward", "value": 1.0})})
    result = run(t)
    assert result.issues == []
    assert rewards(result) == [0.5, 1.0]


# --- determinism ------------------------------------------------------------------------------


def busy_trace() -> Trace:
    t = Trace()
    root = t.root()
    solver = t.agent(root, 1, 30, "solver")
    t.call(solver, 2, 3, "s1")
    t.reward(solver, 3.5, 0.1)
    t.call(root, 4, 5, "float1")
    t.call(root, 4, 5, "float2")
    t.call(sid(700), 6, 7, "orphan-a")
    t.call(sid(701), 6, 7, "orphan-b")
    t.reward(sid(702), 8, 0.3)
    t.call(solver, 9, 10, "s1")  # duplicate response id
    t.call(solver, 11, 12, "bad", prompt=[True])
    t.reward(root, 31, 1.0)
    return t


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("reward_match", ["first_occurrence", "first_sibling"])
def test_shuffled_input_gives_identical_output(seed: int, reward_match: str) -> None:
    t = busy_trace()
    expected = run(t, reward_match=reward_match)
    assert len(expected.triplets) == 5
    shuffled = list(t.spans)
    random.Random(seed).shuffle(shuffled)
    assert extract_triplets(shuffled, AdapterConfig(reward_match=reward_match)) == expected  # type: ignore[arg-type]


@st.composite
def span_forests(draw: st.DrawFn) -> list[Span]:
    """Random traces: parents may be missing or form cycles, times overlap, tokens may be bad."""
    count = draw(st.integers(1, 14))
    ids = [sid(n) for n in range(1, count + 1)]
    spans: list[Span] = []
    for index, span_id in enumerate(ids):
        parent = draw(st.one_of(st.none(), st.sampled_from(ids), st.just(sid(900 + index % 2))))
        kind = draw(st.sampled_from(["call", "reward", "agent", "other"]))
        start = draw(st.one_of(st.none(), st.integers(0, 20).map(float)))
        end = None if start is None else start + draw(st.integers(0, 10))
        attributes: dict[str, Any] = {}
        name = "step"
        if kind == "call":
            name = draw(st.sampled_from([CHAT, "openai.completion"]))
            attributes["gen_ai.response.id"] = draw(st.sampled_from(["r1", "r2", "r3"]))
            attributes["prompt_token_ids"] = draw(st.sampled_from([[1, 2], [], [True]]))
            attributes["response_token_ids"] = [3]
        elif kind == "reward":
            name = AGL_ANNOTATION
            attributes["agentlightning.reward.0.name"] = "primary"
            attributes["agentlightning.reward.0.value"] = draw(st.sampled_from([0.0, 0.5, 1.0, "bad"]))
        elif kind == "agent":
            attributes["agent.name"] = draw(st.sampled_from(["solver", "critic"]))
        spans.append(
            Span(
                rollout_id="ro-000000000001",
                attempt_id="at-00000001",
                sequence_id=index + 1,
                trace_id="ab" * 16,
                span_id=span_id,
                parent_id=parent,
                name=name,
                attributes=attributes,
                start_time=start,
                end_time=end,
            )
        )
    return spans


@settings(max_examples=300, deadline=None)
@given(
    spans=span_forests(),
    order=st.randoms(use_true_random=False),
    repair=st.booleans(),
    reward_match=st.sampled_from(list(RewardMatchPolicy)),
    agent_match=st.sampled_from([None, "solver"]),
)
def test_property_deterministic_total_and_accounted(
    spans: list[Span], order: random.Random, repair: bool, reward_match: RewardMatchPolicy, agent_match: str | None
) -> None:
    config = AdapterConfig(repair_hierarchy=repair, reward_match=reward_match, agent_match=agent_match)
    result = extract_triplets(spans, config)
    shuffled = list(spans)
    order.shuffle(shuffled)
    assert extract_triplets(shuffled, config) == result

    # Every span stays in the tree (repair and cycle cutting lose nothing).
    tree = build_tree(spans)
    if repair:
        repair_hierarchy(tree.root)
    assert {node.id for node in tree.nodes() if node.span is not None} == {s.span_id for s in spans}

    # Every LLM call span either became a triplet or has an issue naming it.
    kept = {t.metadata["span_id"] for t in result.triplets}
    for span in spans:
        if span.name in (CHAT, "openai.completion"):
            assert span.span_id in kept or issues_about(result, span.span_id)

    # Triplets come in call order, and response ids are unique.
    keys = [(_start(spans, t.metadata["span_id"]), t.metadata["sequence_id"]) for t in result.triplets]
    assert keys == sorted(keys)
    ids = [t.metadata["response_id"] for t in result.triplets]
    assert len(ids) == len(set(ids))


def _start(spans: list[Span], span_id: str) -> float:
    span = next(s for s in spans if s.span_id == span_id)
    start = span.start_time if span.start_time is not None else span.end_time
    return math.inf if start is None else start


def test_trace_node_walk_handles_deep_nesting() -> None:
    t = Trace()
    parent: str | None = None
    for depth in range(3000):
        parent = t.add("step", depth, 10_000 - depth, parent)
    t.call(parent, 5000, 5001, "deep")
    assert rids(run(t)) == ["deep"]
    assert isinstance(build_tree(t.spans).root, TraceNode)


# --- traces shaped like the seed's other tracers ------------------------------------------------


@pytest.mark.parametrize("value", [None, 0.25], ids=["without a value", "with a value"])
def test_calls_inside_a_reward_operation_are_judge_calls(value: float | None) -> None:
    t = Trace()
    root = t.root()
    t.call(root, 1, 2, "policy")
    attrs: dict[str, Any] = {"agentlightning.operation.name": "agentlightning.reward"}
    if value is not None:
        attrs.update({"agentlightning.reward.0.name": "primary", "agentlightning.reward.0.value": value})
    judge_scope = t.add("agentlightning.operation", 3, 6, root, attrs=attrs)
    judge = t.call(judge_scope, 4, 5, "judge")
    result = run(t)
    assert rids(result) == ["policy"]
    assert "inside reward span" in issues_about(result, judge)[0]
    assert rewards(result) == [value]
    other = t.add("agentlightning.operation", 7, 9, root, attrs={"agentlightning.operation.name": "tool"})
    t.call(other, 7.5, 8, "under a plain operation")
    assert rids(run(t)) == ["policy", "under a plain operation"]


def test_an_unfinished_call_is_no_sample_and_cannot_take_the_final_reward() -> None:
    t = Trace()
    root = t.root()
    t.call(root, 1, 2, "done")
    open_call = t.call(root, 3, None, "never ended")
    t.reward(root, 1.5, 0.75)  # during "done": matched to nothing, but the trace's final reward
    result = run(t, final_reward_to_last=True)
    assert rids(result) == ["done"] and rewards(result) == [0.75]
    assert "never finished" in issues_about(result, open_call)[0]


def test_weave_token_ids_response_ids_and_agent_names_are_read() -> None:
    t = Trace()
    root = t.root()
    agent = t.add("weave.op", 1, 10, root, attrs={"type": "agent", "agentlightning.operation.input.name": "planner"})
    out = "agentlightning.operation.output"
    t.call(
        agent,
        2,
        3,
        None,
        prompt=None,
        response=None,
        attrs={f"{out}.prompt_token_ids": [5, 6], f"{out}.response_token_ids.0": [7], f"{out}.id": "w-1"},
    )
    t.call(
        agent,
        4,
        5,
        None,
        prompt=None,
        response=None,
        attrs={f"{out}.prompt_token_ids": [8], f"{out}.choices.0.token_ids": [9, 10], f"{out}.id": "w-2"},
    )
    t.call(
        agent,
        6,
        7,
        None,
        prompt=None,
        response=None,
        attrs={
            f"{out}.prompt_token_ids": [1],
            f"{out}.choices.0.provider_specific_fields.token_ids": [2],
            f"{out}.id": "w-3",
        },
    )
    chain = t.add("langchain.Chain.AgentExecutor", 11, 20, root, attrs={"lc_name": "executor"})
    t.call(chain, 12, 13, "lc-1")
    result = run(t)
    assert rids(result) == ["w-1", "w-2", "w-3", "lc-1"]
    assert [tr.prompt_token_ids for tr in result.triplets[:3]] == [[5, 6], [8], [1]]
    assert [tr.response_token_ids for tr in result.triplets[:3]] == [[7], [9, 10], [2]]
    assert [tr.metadata["agent_name"] for tr in result.triplets] == ["planner", "planner", "planner", "executor"]
    assert rids(run(t, agent_match="^exec")) == ["lc-1"]


def test_the_final_reward_goes_to_the_last_call_only_when_asked() -> None:
    t = Trace()
    root = t.root()
    t.call(root, 1, 2, "a")
    t.call(root, 3, 4, "b")
    t.reward(root, 2.5, 1.0)  # a's, by first occurrence
    assert rewards(run(t)) == [1.0, None]  # the seed's adapter
    assert rewards(run(t, final_reward_to_last=True)) == [1.0, 1.0]
