"""Rollouts as training data in the shapes TRL's trainers load: the pure half of ``agl-stream export``.

No I/O here: the command (``agl_stream/cli/export_cmd.py``) reads the chosen rollouts' spans and
writes the rows; everything between is these functions, tested without a stack.

What a rollout becomes:

1. **Which LLM calls.** The trace adapter's own choice (:func:`extract_triplets` under the
   same :class:`AdapterConfig` as the triplet builder): calls nested in reward spans, duplicates
   and unfinished calls are left out exactly as they are from training triplets. The rollout's
   reward is the adapter's final reward, unless the caller gives one (a replay's re-scored record).
2. **Their messages.** Each kept call's span holds what the agent sent and what the model
   answered in the GenAI conventions (``gen_ai.input.messages``, ``gen_ai.output.messages``,
   ``gen_ai.tool.definitions``, written by :mod:`agl_stream.domain.llm_calls`); they are turned
   back into OpenAI chat messages by :func:`agl_stream.domain.agl_v1.openai_message`. The answer is
   the first choice (the one whose token ids the span records). A call without messages (a span
   slimmed for size, or recorded by a tracer that keeps token ids only) is skipped, with a reason.
3. **Conversations.** Calls are taken in call order; a call whose input messages begin with the
   whole conversation so far (the previous call's input and answer), under the same tools,
   continues it; any other call starts a new conversation. An agent that keeps its history
   gives one conversation per rollout, an agent of independent calls one per call.

Shapes (TRL's "conversational" formats):

- SFT: ``{"messages": [...], "tools": <JSON text or None>, "rollout_id", "attempt_id",
  "group_id", "reward", "policy_version"}``; ``tools`` is JSON text (TRL's SFTTrainer parses it),
  since tool schemas of different rows are no one Arrow type.
- DPO: ``{"prompt": [...], "chosen": [...], "rejected": [...], "tools", "group_id",
  "chosen_rollout_id", "rejected_rollout_id", "chosen_reward", "rejected_reward",
  "chosen_policy_version", "rejected_policy_version"}``. Pairing rule (:func:`preference_rows`):
  rollouts of the same task (the GRPO group id: the producer's ``group_id``, else the task
  input and mode) that have a reward and one conversation; the best reward is chosen, the worst
  rejected (ties broken by rollout id), one pair per task, when the rewards differ by more than
  ``min_margin``. The prompt is the messages before the first assistant message, which both
  must share; chosen and rejected are the rest of each conversation.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from agl_stream.domain.adapter import AdapterConfig, extract_triplets
from agl_stream.domain.agl_v1 import openai_message
from agl_stream.domain.llm_calls.messages import json_text, json_value
from agl_stream.domain.llm_calls.spans import INPUT_MESSAGES_KEY, OUTPUT_MESSAGES_KEY, TOOLS_KEY
from agl_stream.errors import AglError
from agl_stream.models import Span

ExportKind = Literal["sft", "dpo"]
EXPORT_KINDS: tuple[ExportKind, ...] = ("sft", "dpo")
FROM_SPANS: Literal["spans"] = "spans"
"""``ExportTrace.reward`` when the reward is the adapter's final reward of the spans."""

SFT_COLUMNS = ("messages", "tools", "rollout_id", "attempt_id", "group_id", "reward", "policy_version")
DPO_COLUMNS = (
    "prompt",
    "chosen",
    "rejected",
    "tools",
    "group_id",
    "chosen_rollout_id",
    "rejected_rollout_id",
    "chosen_reward",
    "rejected_reward",
    "chosen_policy_version",
    "rejected_policy_version",
)


class ExportError(AglError, ValueError):
    """Nothing to export (no rollout matched, or none gave a row), or an export option is wrong."""


@dataclass(frozen=True)
class ExportTrace:
    """One attempt to export: its spans, the task identity it is paired by, its version and reward."""

    rollout_id: str
    attempt_id: str
    group_id: str
    spans: Sequence[Span]
    policy_version: int | None = None
    reward: float | Literal["spans"] | None = FROM_SPANS


@dataclass
class Conversation:
    """A chain of LLM calls of one attempt as one chat: the messages the last call saw, then its answer."""

    rollout_id: str
    attempt_id: str
    group_id: str
    messages: list[dict[str, Any]]
    tools: list[Any] | None
    reward: float | None
    policy_version: int | None
    span_ids: list[str]


@dataclass
class ExportSummary:
    """What an export read and made: ``skipped_calls`` are LLM calls without messages, ``left_out``
    rollouts, conversations or tasks that gave no row (reason -> count)."""

    rollouts: int = 0
    calls: int = 0
    conversations: int = 0
    rows: int = 0
    skipped_calls: Counter[str] = field(default_factory=Counter)
    left_out: Counter[str] = field(default_factory=Counter)

    def absorb(self, other: ExportSummary) -> None:
        self.rollouts += other.rollouts
        self.calls += other.calls
        self.conversations += other.conversations
        self.rows += other.rows
        self.skipped_calls.update(other.skipped_calls)
        self.left_out.update(other.left_out)


def _call_messages(span: Span) -> tuple[list[dict[str, Any]], dict[str, Any], list[Any] | None] | str:
    """(input messages, the answer, tools) of a call's span in OpenAI's chat shape, or why not."""
    attributes = span.attributes
    inputs = json_value(attributes.get(INPUT_MESSAGES_KEY))
    outputs = json_value(attributes.get(OUTPUT_MESSAGES_KEY))
    if attributes.get("agl.truncated") is True and (inputs is None or outputs is None):
        return "messages dropped from a span over the size limit (agl.truncated)"
    if not isinstance(inputs, list) or not inputs:
        return f"no {INPUT_MESSAGES_KEY}"
    if not isinstance(outputs, list) or not outputs or not isinstance(outputs[0], Mapping):
        return f"no {OUTPUT_MESSAGES_KEY}"
    sent = [openai_message(m) for m in inputs if isinstance(m, Mapping)]
    answer = openai_message(outputs[0])
    answer.pop("role", None)
    answer = {"role": "assistant", **answer}
    tools = json_value(attributes.get(TOOLS_KEY))
    return sent, answer, tools if isinstance(tools, list) and tools else None


def conversations_of(
    trace: ExportTrace, adapter: AdapterConfig | None = None
) -> tuple[list[Conversation], ExportSummary]:
    """The conversations of one attempt (see the module's docstring), and what was skipped."""
    summary = ExportSummary(rollouts=1)
    result = extract_triplets(trace.spans, adapter)
    reward = result.final_reward if trace.reward == FROM_SPANS else trace.reward
    by_id = {span.span_id: span for span in trace.spans}
    conversations: list[Conversation] = []
    current: Conversation | None = None
    for triplet in result.triplets:
        versions = [v for v in triplet.policy_versions or [] if v is not None]
        for span_id in triplet.span_ids or []:
            span = by_id.get(span_id)
            if span is None:  # the adapter names only spans it was given
                continue
            summary.calls += 1
            got = _call_messages(span)
            if isinstance(got, str):
                summary.skipped_calls[got] += 1
                continue
            sent, answer, tools = got
            version = trace.policy_version if trace.policy_version is not None else (versions[-1] if versions else None)
            if current is not None and current.tools == tools and sent[: len(current.messages)] == current.messages:
                current.messages = [*sent, answer]
                current.span_ids.append(span_id)
                current.policy_version = version
                continue
            current = Conversation(
                trace.rollout_id,
                trace.attempt_id,
                trace.group_id,
                [*sent, answer],
                tools,
                reward,
                version,
                [span_id],
            )
            conversations.append(current)
    if not conversations:
        summary.left_out["no LLM call with messages"] += 1
    summary.conversations = len(conversations)
    return conversations, summary


def _tools_text(tools: list[Any] | None) -> str | None:
    return json_text(tools) if tools else None


def sft_rows(conversations: Iterable[Conversation], min_reward: float | None = None) -> list[dict[str, Any]]:
    """TRL SFT rows, one per conversation; with ``min_reward``, only conversations rewarded at least that."""
    rows = []
    for c in conversations:
        if min_reward is not None and (c.reward is None or c.reward < min_reward):
            continue
        rows.append(
            {
                "messages": c.messages,
                "tools": _tools_text(c.tools),
                "rollout_id": c.rollout_id,
                "attempt_id": c.attempt_id,
                "group_id": c.group_id,
                "reward": c.reward,
                "policy_version": c.policy_version,
            }
        )
    return rows


def _prompt_length(messages: Sequence[Mapping[str, Any]]) -> int:
    """How many messages come before the first assistant message."""
    for index, message in enumerate(messages):
        if message.get("role") == "assistant":
            return index
    return len(messages)


def preference_rows(
    conversations: Iterable[Conversation], min_margin: float = 0.0
) -> tuple[list[dict[str, Any]], Counter[str]]:
    """TRL DPO rows, one per task whose best and worst rollout differ in reward by more than
    ``min_margin`` (the rule in the module's docstring), and the tasks left out, by reason."""
    if min_margin < 0:
        raise ExportError(f"min_margin must be 0 or more, got {min_margin}")
    per_rollout: dict[str, list[Conversation]] = {}
    for c in conversations:
        per_rollout.setdefault(c.rollout_id, []).append(c)
    skipped: Counter[str] = Counter()
    groups: dict[str, list[Conversation]] = {}
    for rollout_id in sorted(per_rollout):
        found = per_rollout[rollout_id]
        if len(found) != 1:
            skipped["rollout with several conversations (not one answer to pair)"] += 1
        elif found[0].reward is None:
            skipped["rollout without a reward"] += 1
        else:
            groups.setdefault(found[0].group_id, []).append(found[0])
    rows: list[dict[str, Any]] = []
    for group_id in sorted(groups):
        members = groups[group_id]
        if len(members) < 2:
            skipped["task with one rewarded rollout"] += 1
            continue
        best = min(members, key=lambda c: (-(c.reward or 0.0), c.rollout_id))
        worst = min(members, key=lambda c: (c.reward or 0.0, c.rollout_id))
        assert best.reward is not None and worst.reward is not None
        if best.reward - worst.reward <= min_margin:
            skipped["task whose rewards do not differ by more than the margin"] += 1
            continue
        cut = _prompt_length(best.messages)
        if best.messages[:cut] != worst.messages[: _prompt_length(worst.messages)] or best.tools != worst.tools:
            skipped["task whose rollouts saw different prompts or tools"] += 1
            continue
        rows.append(
            {
                "prompt": best.messages[:cut],
                "chosen": best.messages[cut:],
                "rejected": worst.messages[cut:],
                "tools": _tools_text(best.tools),
                "group_id": group_id,
                "chosen_rollout_id": best.rollout_id,
                "rejected_rollout_id": worst.rollout_id,
                "chosen_reward": best.reward,
                "rejected_reward": worst.reward,
                "chosen_policy_version": best.policy_version,
                "rejected_policy_version": worst.policy_version,
            }
        )
    return rows, skipped


def rows_of(
    conversations: Sequence[Conversation],
    kind: ExportKind,
    summary: ExportSummary,
    *,
    min_reward: float | None = None,
    min_margin: float = 0.0,
) -> list[dict[str, Any]]:
    """The SFT or DPO rows of ``conversations``; what gave no row is counted in ``summary``."""
    if kind not in EXPORT_KINDS:
        raise ExportError(f"unknown export kind {kind!r}: use one of {', '.join(EXPORT_KINDS)}")
    if kind == "sft":
        rows = sft_rows(conversations, min_reward)
        below = len(conversations) - len(rows)
        if below:
            summary.left_out[f"conversation rewarded below {min_reward} (or not at all)"] += below
    else:
        rows, skipped = preference_rows(conversations, min_margin)
        summary.left_out.update(skipped)
    summary.rows = len(rows)
    return rows


def export_rows(
    traces: Iterable[ExportTrace],
    kind: ExportKind,
    *,
    adapter: AdapterConfig | None = None,
    min_reward: float | None = None,
    min_margin: float = 0.0,
) -> tuple[list[dict[str, Any]], ExportSummary]:
    """The rows of an export of ``traces`` (SFT or DPO), and its summary: :func:`conversations_of`
    of each, then :func:`rows_of`."""
    summary = ExportSummary()
    conversations: list[Conversation] = []
    for trace in traces:
        found, part = conversations_of(trace, adapter)
        conversations += found
        summary.absorb(part)
    return rows_of(conversations, kind, summary, min_reward=min_reward, min_margin=min_margin), summary
