"""The pure half of APO (:mod:`agl_stream.algorithm.apo`): no I/O, tested without a stack.

What is decided here:

* the parameters (:func:`check_parameters`: every bad one named in one AlgorithmConfigError);
* which tasks each batch runs (:func:`index_batches`: every task once per pass, seeded);
* which prompts go on (:func:`parents_for_round`, :func:`select_beam`);
* what the critique model reads (:func:`rollout_result` from a rollout's spans,
  :func:`critique_messages`) and what the edit model is asked (:func:`edit_messages`);
* what an edit answer means (:func:`parse_edit`, :func:`check_template`: a candidate that
  loses or invents a placeholder would fail every rollout, so it is refused before it runs);
* a candidate's score from the SQL report of its rollouts (:func:`score_of`).

Stateless: functions of their arguments (the random generator is the caller's).
"""

from __future__ import annotations

import json
import random
import re
import string
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agl_stream.algorithm.report import REWARD_VALUE_KEY, ModeReport
from agl_stream.errors import AlgorithmConfigError
from agl_stream.models import PromptTemplate, Span
from agl_stream.wire.semconv import AGL_EXCEPTION, LightningSpanAttributes

NOTE_CHARS = 600
"""Characters of one logged item (a message, a model answer) shown to the critique model."""
NOTES_PER_RUN = 12
"""Logged items per rollout shown to the critique model (the first ones: where runs go wrong)."""
TASK_CHARS = 1_000
"""Characters of a task's JSON shown to the critique model."""

# The LLM proxy's messages (agl_stream.domain.llm_calls), and the keys spans recorded before it
# wrote the GenAI conventions' current ones.
_PROMPT_KEYS = ("gen_ai.input.messages", "gen_ai.prompt")
_COMPLETION_KEYS = ("gen_ai.output.messages", "gen_ai.completion")
_MESSAGE_BODY = LightningSpanAttributes.MESSAGE_BODY.value
_EDIT_BLOCK = re.compile(r"<prompt>(.*?)</prompt>", re.DOTALL | re.IGNORECASE)
_FENCED = re.compile(r"```[\w+-]*[ \t]*\n(.*?)```", re.DOTALL)


# -- parameters ----------------------------------------------------------------------------------


def check_parameters(values: Mapping[str, Any]) -> None:
    """AlgorithmConfigError naming every APO parameter in ``values`` with a bad value."""
    problems: dict[str, str] = {}
    for name in ("beam_width", "branch_factor", "beam_rounds", "gradient_batch_size", "val_batch_size"):
        value = values.get(name)
        if name in values and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            problems[name] = f"a positive integer, got {value!r}"
    if "diversity_temperature" in values:
        value = values["diversity_temperature"]
        if not _number(value) or not 0.0 <= value <= 2.0:
            problems["diversity_temperature"] = f"a number from 0 to 2 (OpenAI's range), got {value!r}"
    if "rollout_batch_timeout" in values:
        value = values["rollout_batch_timeout"]
        if value is not None and (not _number(value) or value <= 0):
            problems["rollout_batch_timeout"] = f"seconds above 0 (or None: no limit), got {value!r}"
    if "request_timeout" in values:
        value = values["request_timeout"]
        if not _number(value) or value <= 0:
            problems["request_timeout"] = f"seconds above 0, got {value!r}"
    for name in ("gradient_model", "apply_edit_model"):
        value = values.get(name)
        if name in values and (not isinstance(value, str) or not value.strip()):
            problems[name] = f"a model name, got {value!r}"
    for name in ("gradient_base_url", "apply_edit_base_url"):
        value = values.get(name)
        if value is not None and (not isinstance(value, str) or not re.match(r"^https?://[^\s/]+", value)):
            problems[name] = f"an http(s) URL of an OpenAI-compatible API (such as http://host:8000/v1), got {value!r}"
    if problems:
        raise AlgorithmConfigError("APO", problems)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# -- batches and the beam --------------------------------------------------------------------------


def index_batches(size: int, batch_size: int, rng: random.Random) -> Iterator[list[int]]:
    """Endless batches of indices of a dataset of ``size`` tasks.

    Each pass over the dataset is a new shuffle taken in order, so every task runs as often as
    any other (give or take one); a batch that straddles two passes never holds a task twice
    (the repeat waits for the next batch). ``batch_size >= size``: every batch is the
    whole dataset (shuffled), so scores of different rounds compare on the same tasks.
    """
    if size < 1:
        raise ValueError("a dataset of at least one task")
    if batch_size >= size:
        while True:
            order = list(range(size))
            rng.shuffle(order)
            yield order
    stream: deque[int] = deque()  # the passes, one shuffle after another
    while True:
        batch: list[int] = []
        deferred: list[int] = []
        while len(batch) < batch_size:
            if not stream:
                order = list(range(size))
                rng.shuffle(order)
                stream.extend(order)
            index = stream.popleft()
            # The batch began in the previous pass: a task it holds waits for the next batch.
            (deferred if index in batch else batch).append(index)
        stream.extendleft(reversed(deferred))
        yield batch


def parents_for_round(beam: Sequence[Candidate], beam_width: int) -> list[Candidate]:
    """``beam_width`` parents: the beam in order, repeated when it holds fewer (each parent then
    branches again, as a short beam in the seed does)."""
    if not beam:
        raise ValueError("an empty beam has no parents")
    return [beam[i % len(beam)] for i in range(beam_width)]


@dataclass(frozen=True)
class Candidate:
    """A prompt of the search, published as its own resources snapshot.

    ``round``: the round that made it (0: the seed prompt); ``parent``: the resources id of the
    prompt it was edited from; ``resources``: the whole snapshot its rollouts run with.
    """

    resources_id: str
    prompt: PromptTemplate
    resources: Mapping[str, Any]
    round: int
    parent: str | None = None


def select_beam(
    candidates: Sequence[Candidate], scores: Mapping[str, float | None], beam_width: int
) -> list[Candidate]:
    """The ``beam_width`` best candidates, best first.

    ``scores`` by resources id. Ties keep the earlier candidate (the beam comes before its
    children, so an edit must do better, not as well, to displace its parent); an unscored one
    ranks last; the same template text twice counts once.
    """
    seen: set[str] = set()
    unique = []
    for candidate in candidates:
        if candidate.prompt.template not in seen:
            seen.add(candidate.prompt.template)
            unique.append(candidate)

    def rank(item: tuple[int, Candidate]) -> tuple[bool, float, int]:
        score = scores.get(item[1].resources_id)
        return score is None, -(score or 0.0), item[0]

    return [candidate for _, candidate in sorted(enumerate(unique), key=rank)[:beam_width]]


def score_of(report: ModeReport | None, rollouts: int) -> float:
    """A candidate's score: the mean final reward over the ``rollouts`` it ran, a rollout
    without a reward (failed, timed out) counting 0, as the seed counts it. ``report``: its
    rollouts' row of :func:`agl_stream.algorithm.report.rewards_by_mode` (the SQL read side)."""
    if report is None or report.mean_reward is None or rollouts < 1:
        return 0.0
    return report.mean_reward * report.rewarded / rollouts


# -- what the critique model reads -------------------------------------------------------------------


@dataclass(frozen=True)
class RolloutResult:
    """One rollout as the critique model sees it: the task, how it ended, its final reward (None:
    it reported none) and what it logged (messages, model calls, errors), in order."""

    task: Any
    status: str
    reward: float | None
    notes: tuple[str, ...] = ()


def rollout_result(task: Any, status: str, spans: Sequence[Span]) -> RolloutResult:
    """The result of a rollout from its latest attempt's spans (in sequence-id order).

    The reward is the final one (:func:`final_reward`), as the SQL score reads it. The notes
    are the agent's messages, the model calls the LLM proxy recorded (prompt and answer) and
    recorded exceptions, each cut to ``NOTE_CHARS``.
    """
    notes: list[str] = []
    for span in spans:
        attributes = span.attributes or {}
        body = attributes.get(_MESSAGE_BODY)
        if isinstance(body, str):
            notes.append(f"message: {_cut(body, NOTE_CHARS)}")
        if span.name == AGL_EXCEPTION:
            kind, text = attributes.get("exception.type", "Exception"), attributes.get("exception.message", "")
            notes.append(f"error: {kind}: {_cut(str(text), NOTE_CHARS)}")
        prompt = next((attributes[k] for k in _PROMPT_KEYS if k in attributes), None)
        completion = next((attributes[k] for k in _COMPLETION_KEYS if k in attributes), None)
        if isinstance(prompt, str):
            notes.append(f"model asked: {_cut(_chat_text(prompt), NOTE_CHARS)}")
        if isinstance(completion, str):
            notes.append(f"model answered: {_cut(_chat_text(completion), NOTE_CHARS)}")
    return RolloutResult(task=task, status=status, reward=final_reward(spans), notes=tuple(notes[:NOTES_PER_RUN]))


def final_reward(spans: Sequence[Span]) -> float | None:
    """The primary value of the last span that has one: what the SQL score reads (the
    ``agentlightning.reward.0.value`` with the highest sequence id), a malformed span aside."""
    for span in sorted(spans, key=lambda s: s.sequence_id, reverse=True):
        value = (span.attributes or {}).get(REWARD_VALUE_KEY)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                continue
    return None


def _chat_text(value: str) -> str:
    """The text of the proxy's JSON messages attribute (the text of each message, joined)."""
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    if isinstance(parsed, list):
        parts = []
        for entry in parsed:
            if isinstance(entry, Mapping):
                message = entry.get("message", entry)
                content = message.get("content") if isinstance(message, Mapping) else None
                role = message.get("role", "") if isinstance(message, Mapping) else ""
                if isinstance(message, Mapping) and isinstance(message.get("parts"), list):  # GenAI messages
                    texts = [p.get("content") for p in message["parts"] if isinstance(p, Mapping)]
                    content = " ".join(t for t in texts if isinstance(t, str)) or None
                if isinstance(content, str):
                    parts.append(f"[{role}] {content}" if role else content)
            elif isinstance(entry, str):
                parts.append(entry)
        if parts:
            return " | ".join(parts)
    return value if not isinstance(parsed, str) else parsed


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


ChatMessage = dict[str, str]
"""An OpenAI chat message: ``{"role": ..., "content": ...}``."""

CRITIQUE_SYSTEM = (
    "You review the prompt template that drives an AI agent. You see the template and some "
    "recorded runs of the agent with it: for each run the task it got, how the run ended, the "
    "reward it earned (higher is better; 1 is a perfect run) and what it logged.\n"
    "Work out why the runs with low rewards went wrong, and what in the template caused or "
    "allowed that: a missing instruction, an ambiguous one, a missing output format, a wrong "
    "assumption about the tasks. Runs that went well show what to keep.\n"
    "Answer with a short numbered list. Each item names one problem of the template and the "
    "concrete change that fixes it. Do not write the revised template yourself."
)

EDIT_SYSTEM = (
    "You revise prompt templates. You get a template and a reviewer's advice on it. Apply the "
    "advice and answer with the complete revised template, and only the template, between "
    "<prompt> and </prompt>.\n"
    "The agent fills the placeholders in braces, such as {question}: keep each one exactly as "
    "written and add none. Keep what works and change what the advice asks for; the result must "
    "read as one clear prompt, not as notes about one."
)


def critique_messages(template: str, results: Sequence[RolloutResult]) -> list[ChatMessage]:
    """The chat the critique (textual gradient) model answers: the template and the runs."""
    rewards = [r.reward for r in results]
    mean = sum(r or 0.0 for r in rewards) / len(rewards) if rewards else 0.0
    lines = [
        "The template under review:",
        "<template>",
        template,
        "</template>",
        "",
        f"Runs of the agent with it: {len(results)}, mean reward {mean:.3f}.",
    ]
    for number, result in enumerate(results, start=1):
        reward = "none reported" if result.reward is None else f"{result.reward:g}"
        lines += [
            "",
            f"### Run {number}",
            f"Task: {_cut(_json(result.task), TASK_CHARS)}",
            f"Ended: {result.status}; reward: {reward}",
        ]
        if result.notes:
            lines.append("Logged:")
            lines += [f"- {note}" for note in result.notes]
        else:
            lines.append("Logged: nothing")
    return [{"role": "system", "content": CRITIQUE_SYSTEM}, {"role": "user", "content": "\n".join(lines)}]


def edit_messages(template: str, critique: str, *, engine: str = "f-string") -> list[ChatMessage]:
    """The chat the edit model answers: the template, the critique, the placeholders to keep."""
    lines = ["The current template:", "<template>", template, "</template>", ""]
    fields = sorted(template_fields(template)) if engine == "f-string" else []
    if fields:
        lines += ["Placeholders to keep, each exactly once or more: " + ", ".join(f"{{{f}}}" for f in fields), ""]
    lines += ["The reviewer's advice:", critique.strip()]
    return [{"role": "system", "content": EDIT_SYSTEM}, {"role": "user", "content": "\n".join(lines)}]


def _json(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)
    except ValueError:  # a circular structure: tasks are JSON, so this is only a fallback
        return repr(value)


# -- what an edit answer means ------------------------------------------------------------------------


def parse_edit(answer: str | None) -> str | None:
    """The revised template in the edit model's answer, or None when it holds none.

    The last non-empty ``<prompt>...</prompt>`` block (a model may quote the instruction's tags
    before answering); else the last fenced code block; else the whole answer. Surrounding
    blank lines and spaces are dropped.
    """
    if not answer or not answer.strip():
        return None
    for pattern in (_EDIT_BLOCK, _FENCED):
        blocks = [block.strip() for block in pattern.findall(answer) if block.strip()]
        if blocks:
            return blocks[-1]
        if pattern is _EDIT_BLOCK and re.search(r"</?prompt>", answer, re.IGNORECASE):
            return None  # tags, but empty or unclosed: a cut-off answer, not a template
    return answer.strip()


def template_fields(template: str) -> set[str]:
    """The names an f-string template fills (``{text}``, ``{task[text]}`` -> ``task``), or
    ValueError when the braces do not parse."""
    names = set()
    for _, field, _, _ in string.Formatter().parse(template):
        if field is None:
            continue
        names.add(re.split(r"[.\[]", field, maxsplit=1)[0])
    return names


def check_template(parent: PromptTemplate, text: str) -> str | None:
    """Why ``text`` cannot replace ``parent``'s template, or None when it can.

    An f-string template must parse and fill the same placeholders as its parent: the agent
    formats it with the task's values, so a lost placeholder drops the input and a new or
    positional one raises in every rollout.
    """
    if parent.engine != "f-string":
        return None
    try:
        fields = template_fields(text)
    except ValueError as error:
        return f"its braces do not parse ({error}); write a literal brace as {{{{ or }}}}"
    expected = template_fields(parent.template)
    positional = sorted(f for f in fields if f == "" or f.isdigit())
    if positional:
        shown = ", ".join("{" + f + "}" for f in positional)
        return f"it has positional placeholders ({shown}), which the agent fills by name only"
    lost, added = sorted(expected - fields), sorted(fields - expected)
    problems = []
    if lost:
        problems.append("it drops " + ", ".join(f"{{{f}}}" for f in lost))
    if added:
        problems.append("it adds " + ", ".join(f"{{{f}}}" for f in added))
    return "; ".join(problems) or None
