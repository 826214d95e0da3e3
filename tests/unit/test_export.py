"""Rollouts -> TRL rows (agl_stream/domain/export.py): conversations, SFT rows, DPO pairs, without I/O."""

from __future__ import annotations

import json

import pytest

from agl_stream.domain.export import (
    DPO_COLUMNS,
    SFT_COLUMNS,
    ExportError,
    ExportTrace,
    conversations_of,
    export_rows,
    preference_rows,
)
from agl_stream.domain.llm_calls import LLMCall, slim
from tests.export_spans import SYSTEM, TOOLS, attempt_spans, chat_call, tool_episode


def _trace(rollout_id: str, calls: list[LLMCall], reward: float | None, group: str = "g-1") -> ExportTrace:
    return ExportTrace(rollout_id, "a-1", group, attempt_spans(rollout_id, calls, reward))


def test_a_tool_using_episode_is_one_conversation_with_its_tool_calls_and_tools() -> None:
    trace = _trace("r1", tool_episode("what is 2+3?", "2+3", "5", "It is 5.", version=3), 1.0)
    [conversation], summary = conversations_of(trace)
    assert [m["role"] for m in conversation.messages] == ["system", "user", "assistant", "tool", "assistant"]
    call = conversation.messages[2]["tool_calls"][0]
    assert call["function"]["name"] == "calculator"
    assert json.loads(call["function"]["arguments"]) == {"expression": "2+3"}
    assert conversation.messages[3] == {"role": "tool", "tool_call_id": "call_1", "content": "5"}
    assert conversation.messages[-1] == {"role": "assistant", "content": "It is 5."}
    assert conversation.tools == TOOLS
    assert (conversation.reward, conversation.policy_version) == (1.0, 3)
    assert summary.calls == 2 and summary.conversations == 1 and not summary.skipped_calls


def test_independent_calls_are_separate_conversations() -> None:
    calls = [
        chat_call([{"role": "user", "content": "q1"}], {"content": "a1"}, start=1.0),
        chat_call([{"role": "user", "content": "q2"}], {"content": "a2"}, start=2.0),
    ]
    conversations, _ = conversations_of(_trace("r1", calls, 0.5))
    assert [c.messages for c in conversations] == [
        [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}],
        [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}],
    ]
    assert [c.reward for c in conversations] == [0.5, 0.5]


def test_a_call_without_messages_is_skipped_with_its_reason() -> None:
    spans = attempt_spans("r1", [chat_call([{"role": "user", "content": "q"}], {"content": "a"})], 1.0)
    spans[0] = slim(spans[0])  # what the proxy writes when a span is over the broker's size limit
    conversations, summary = conversations_of(ExportTrace("r1", "a-1", "g", spans))
    assert conversations == []
    assert list(summary.skipped_calls) == ["messages dropped from a span over the size limit (agl.truncated)"]
    assert summary.left_out == {"no LLM call with messages": 1}


def test_a_given_reward_replaces_the_spans_and_the_rollouts_version_wins() -> None:
    spans = attempt_spans("r1", tool_episode("q", "1+1", "2", "2", version=1), 1.0)
    trace = ExportTrace("r1", "a-1", "g", spans, policy_version=7, reward=0.25)
    [conversation], _ = conversations_of(trace)
    assert (conversation.reward, conversation.policy_version) == (0.25, 7)


def test_sft_rows_have_trl_columns_and_min_reward_filters() -> None:
    traces = [
        _trace("r1", tool_episode("q", "1+1", "2", "2"), 1.0),
        _trace("r2", tool_episode("q", "1+1", "2", "3"), 0.0),
        _trace("r3", tool_episode("q", "1+1", "2", "?"), None),
    ]
    rows, summary = export_rows(traces, "sft")
    assert [tuple(r) for r in rows] == [SFT_COLUMNS] * 3
    assert [r["reward"] for r in rows] == [1.0, 0.0, None]
    assert json.loads(rows[0]["tools"]) == TOOLS
    kept, summary = export_rows(traces, "sft", min_reward=0.5)
    assert [r["rollout_id"] for r in kept] == ["r1"]
    assert summary.rows == 1 and sum(summary.left_out.values()) == 2


def test_dpo_pairs_best_and_worst_of_each_task() -> None:
    traces = [
        _trace("r1", tool_episode("2+3?", "2+3", "5", "5"), 1.0, group="g-a"),
        _trace("r2", tool_episode("2+3?", "2+3", "5", "6"), 0.0, group="g-a"),
        _trace("r3", tool_episode("2+3?", "2+3", "5", "5!"), 0.5, group="g-a"),
        _trace("r4", tool_episode("1+1?", "1+1", "2", "2"), 1.0, group="g-b"),  # alone: no pair
        _trace("r5", tool_episode("7*6?", "7*6", "42", "42"), 1.0, group="g-c"),
        _trace("r6", tool_episode("7*6?", "7*6", "42", "42."), 1.0, group="g-c"),  # a tie: no pair
    ]
    rows, summary = export_rows(traces, "dpo")
    [row] = rows
    assert tuple(row) == DPO_COLUMNS
    assert row["prompt"] == [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "2+3?"}]
    assert (row["chosen_rollout_id"], row["rejected_rollout_id"]) == ("r1", "r2")
    assert (row["chosen_reward"], row["rejected_reward"]) == (1.0, 0.0)
    assert row["chosen"][-1] == {"role": "assistant", "content": "5"}
    assert row["rejected"][-1] == {"role": "assistant", "content": "6"}
    assert [m["role"] for m in row["chosen"]] == ["assistant", "tool", "assistant"]
    assert summary.left_out == {
        "task with one rewarded rollout": 1,
        "task whose rewards do not differ by more than the margin": 1,
    }


def test_dpo_margin_prompts_and_unrewarded_rollouts() -> None:
    traces = [
        _trace("r1", tool_episode("q", "1", "1", "a"), 0.6),
        _trace("r2", tool_episode("q", "1", "1", "b"), 0.5),
        _trace("r3", tool_episode("q", "1", "1", "c"), None),
    ]
    conversations = [c for t in traces for c in conversations_of(t)[0]]
    rows, skipped = preference_rows(conversations, min_margin=0.2)
    assert rows == []
    assert skipped == {"rollout without a reward": 1, "task whose rewards do not differ by more than the margin": 1}
    assert [r["chosen_rollout_id"] for r in preference_rows(conversations)[0]] == ["r1"]
    other = _trace("r4", tool_episode("another prompt", "1", "1", "d"), 0.0)
    rows, skipped = preference_rows([*conversations[:1], *conversations_of(other)[0]])
    assert rows == [] and skipped == {"task whose rollouts saw different prompts or tools": 1}
    with pytest.raises(ExportError):
        preference_rows(conversations, min_margin=-1)


def test_an_unknown_kind_is_a_typed_error() -> None:
    with pytest.raises(ExportError, match="unknown export kind"):
        export_rows([], "kto")  # type: ignore[arg-type]
