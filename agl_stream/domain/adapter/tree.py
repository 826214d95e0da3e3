"""The span tree of one attempt: building it from a flat span list, and repairing its hierarchy.

Everything here is deterministic: the tree depends only on the set of spans given, never on
their order in the input nor on hash seeds. Children are kept in chronological order
(:func:`node_key`), so any traversal of the tree is reproducible.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from agl_stream.domain.adapter.lean import LeanSpan, lean_span
from agl_stream.models import Span
from agl_stream.wire.semconv import AGL_VIRTUAL

__all__ = [
    "VIRTUAL_ROOT_ID",
    "TraceNode",
    "TraceTree",
    "agent_name_of",
    "build_tree",
    "node_key",
    "repair_hierarchy",
]

VIRTUAL_ROOT_ID = "virtual-root"
"""Id of the synthetic root added above several top-level spans (real span ids are 16 hex digits)."""


@dataclass(eq=False)
class TraceNode:
    """One span in the tree, or a synthetic ``agentlightning.virtual`` node when ``span`` is None.

    ``start``/``end`` are the span's times with a missing one replaced by the other, and
    ``math.inf`` when both are missing: such spans sort last and never contain anything.
    """

    id: str
    name: str
    start: float
    end: float
    sequence_id: int
    span: LeanSpan | None = None
    children: list[TraceNode] = field(default_factory=list)

    @property
    def has_times(self) -> bool:
        return math.isfinite(self.start) and math.isfinite(self.end)

    def walk(self) -> Iterator[TraceNode]:
        """Pre-order traversal (iterative: agent traces can nest deeper than Python's recursion limit)."""
        stack = [self]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children))

    def names_tuple(self) -> tuple[str, list[Any]]:
        """``(name, [children's names_tuple])``: a compact shape of the tree for tests and debugging."""
        return self.name, [child.names_tuple() for child in self.children]

    @property
    def label(self) -> str:
        """How issues name a node: id, name and sequence id, which is what one greps the store for."""
        return f"span {self.id} ({self.name}, seq {self.sequence_id})"


@dataclass
class TraceTree:
    """A built tree and what was wrong with the spans it was built from."""

    root: TraceNode
    issues: list[str] = field(default_factory=list)

    def nodes(self) -> list[TraceNode]:
        return list(self.root.walk())


def node_key(node: TraceNode) -> tuple[float, int, str]:
    """Chronological order: start time, then sequence id, then id (a total order over distinct spans)."""
    return node.start, node.sequence_id, node.id


def _span_times(span: LeanSpan) -> tuple[float, float]:
    start = span.start_time if span.start_time is not None else span.end_time
    end = span.end_time if span.end_time is not None else span.start_time
    if start is None or end is None:
        return math.inf, math.inf
    return start, end


def _span_node(span: LeanSpan) -> TraceNode:
    start, end = _span_times(span)
    return TraceNode(span.span_id, span.name, start, end, span.sequence_id, span)


def _virtual_node(node_id: str, children: list[TraceNode]) -> TraceNode:
    children = sorted(children, key=node_key)
    starts = [child.start for child in children if child.has_times]
    ends = [child.end for child in children if child.has_times]
    return TraceNode(
        id=node_id,
        name=AGL_VIRTUAL,
        start=min(starts) if starts else math.inf,
        end=max(ends) if ends else math.inf,
        sequence_id=min(child.sequence_id for child in children),
        children=children,
    )


_AGENT_NAME_KEYS = ("agent.name", "recipient_agent_type", "langchain.chain.type", "executor.id")
_AGENT_VALUE_KEYS = frozenset({*_AGENT_NAME_KEYS, "operation.name", "agentlightning.operation.input.name", "lc_name"})
"""Every key :func:`agent_name_of` may return the value of."""


def agent_name_of(node: TraceNode) -> str | None:
    """The agent a span stands for, read from the attributes agent frameworks write; None if none.

    Precedence follows the seed: OpenAI Agents SDK ``agent.name``; AgentOps ``@agent`` spans
    (``agentops.span.kind == "agent"`` with ``operation.name``); AutoGen ``recipient_agent_type``;
    LangGraph ``langchain.chain.type``; agent-framework ``executor.id``; Weave agent operations
    (``type == "agent"`` with ``agentlightning.operation.input.name``); Weave's LangChain chains
    (``langchain.Chain.*`` spans with ``lc_name``). Non-string values are ignored rather than
    stringified: they are not names any framework writes.
    """
    if node.span is None:
        return None
    attributes = node.span.attributes
    if attributes.keys().isdisjoint(_AGENT_VALUE_KEYS):
        return None  # most spans (LLM calls, rewards): no candidate below can be a string
    candidates: list[object] = [attributes.get("agent.name")]
    if attributes.get("agentops.span.kind") == "agent":
        candidates.append(attributes.get("operation.name"))
    candidates.extend(attributes.get(key) for key in _AGENT_NAME_KEYS[1:])
    if attributes.get("type") == "agent":
        candidates.append(attributes.get("agentlightning.operation.input.name"))
    if node.span.name.startswith("langchain.Chain."):
        candidates.append(attributes.get("lc_name"))
    for candidate in candidates:
        if isinstance(candidate, str):
            return candidate
    return None


def _dedup_spans(spans: Sequence[LeanSpan], issues: list[str]) -> list[LeanSpan]:
    # The same span can arrive twice (at-least-once delivery); the lowest sequence id wins so
    # the choice does not depend on input order.
    ordered = sorted(spans, key=lambda s: (s.sequence_id, *_span_times(s), s.span_id))
    kept: dict[str, LeanSpan] = {}
    for span in ordered:
        if span.span_id in kept:
            label = f"span {span.span_id} ({span.name}, seq {span.sequence_id})"
            issues.append(f"{label}: skipped: duplicate span id (kept seq {kept[span.span_id].sequence_id})")
        else:
            kept[span.span_id] = span
    return list(kept.values())


def _break_cycles(nodes: dict[str, TraceNode], parent_of: dict[str, str], reached: set[str]) -> list[TraceNode]:
    """Detach one node per parent cycle (unreachable from any root); return the detached nodes.

    The detached node is the earliest (:func:`node_key`) node on the cycle itself, not on a
    branch hanging off it, so the rest of the cycle keeps its recorded nesting.
    """
    detached: list[TraceNode] = []
    for node in sorted(nodes.values(), key=node_key):
        if node.id in reached:
            continue
        path: list[str] = []
        seen: set[str] = set()
        current = node.id
        while current not in seen:
            seen.add(current)
            path.append(current)
            current = parent_of[current]
        cycle = [nodes[node_id] for node_id in path[path.index(current) :]]
        head = min(cycle, key=node_key)
        parent = nodes[parent_of[head.id]]
        parent.children.remove(head)
        detached.append(head)
        reached.update(child.id for child in head.walk())
    return detached


def build_tree(spans: Sequence[Span | LeanSpan]) -> TraceTree:
    """Build the span tree of one attempt (span models are read as their LeanSpans).

    * A span whose parent is not in the list (the top-level session span is often lost) goes
      under a virtual node named ``agentlightning.virtual`` that stands for the missing parent
      and carries its id; the node spans its children's time window.
    * Several top-level nodes (real roots, virtual parents) go under one virtual root
      (id :data:`VIRTUAL_ROOT_ID`); a single one is the root itself.
    * A span naming itself as parent, or a parent cycle, is cut at its earliest span, which
      becomes top-level. Duplicate span ids keep the lowest sequence id.

    Every such fix is recorded in ``issues``.

    Raises:
        ValueError: ``spans`` is empty.
    """
    if not spans:
        raise ValueError("cannot build a trace tree from no spans")
    issues: list[str] = []
    unique = _dedup_spans([lean_span(span) for span in spans], issues)
    nodes = {span.span_id: _span_node(span) for span in unique}
    roots: list[TraceNode] = []
    orphans: dict[str, list[TraceNode]] = {}
    parent_of: dict[str, str] = {}
    for span in unique:
        node = nodes[span.span_id]
        parent_id = span.parent_id
        if parent_id is None:
            roots.append(node)
        elif parent_id == span.span_id:
            issues.append(f"{node.label}: names itself as parent; treated as top-level")
            roots.append(node)
        elif parent_id in nodes:
            nodes[parent_id].children.append(node)
            parent_of[span.span_id] = parent_id
        else:
            orphans.setdefault(parent_id, []).append(node)

    for parent_id in sorted(orphans):
        children = orphans[parent_id]
        labels = ", ".join(child.id for child in sorted(children, key=node_key))
        issues.append(f"parent span {parent_id} is missing; its children ({labels}) go under a virtual node")
        roots.append(_virtual_node(parent_id, children))

    reached = {node.id for root in roots for node in root.walk()}
    for head in _break_cycles(nodes, parent_of, reached):
        issues.append(f"{head.label}: parent cycle cut here; treated as top-level")
        roots.append(head)

    for node in nodes.values():
        node.children.sort(key=node_key)
    roots.sort(key=node_key)
    root = roots[0] if len(roots) == 1 else _virtual_node(VIRTUAL_ROOT_ID, roots)
    return TraceTree(root=root, issues=issues)


def _repair_level(root: TraceNode) -> TraceNode:
    # Tracers that wrap everything in one extra session span (AgentOps does on end_trace) push
    # the floating spans one level down; repair where the tree first branches.
    while len(root.children) == 1:
        root = root.children[0]
    return root


_Candidate = tuple[TraceNode, float, float, bool]
"""A node that may receive a span: (node, start, end, whether it is an LLM call)."""


def _candidates(level: TraceNode, llm_call: re.Pattern[str] | None) -> list[_Candidate]:
    """The nodes under ``level`` with times, in pre-order (the order that breaks ties)."""
    return [
        (node, node.start, node.end, llm_call is not None and llm_call.search(node.name) is not None)
        for node in level.walk()
        if node is not level and node.has_times
    ]


def _tightest_container(
    candidates: list[_Candidate], target: TraceNode, llm_call: re.Pattern[str] | None
) -> TraceNode | None:
    excluded = {node.id for node in target.walk()} if target.children else {target.id}
    target_is_call = llm_call is not None and llm_call.search(target.name) is not None
    calls_excluded = llm_call is not None and not target_is_call
    target_start, target_end = target.start, target.end
    best: TraceNode | None = None
    best_slack = math.inf
    for node, start, end, is_call in candidates:
        if (calls_excluded and is_call) or node.id in excluded:
            continue
        if start <= target_start and end >= target_end:
            slack = (end - target_end) + (target_start - start)
            # Strictly positive: a span with the very same window is a sibling, not a parent.
            # Strictly smaller: among equal candidates the first in pre-order (the outer) wins.
            if 0 < slack < best_slack:
                best, best_slack = node, slack
    return best


def repair_hierarchy(root: TraceNode, llm_call: re.Pattern[str] | None = None) -> list[str]:
    """Re-parent top-level spans under the tightest span whose time window contains them.

    Mixed tracing systems leave spans (typically LLM calls) floating at the top instead of under
    the agent that made them, which breaks ``agent_match``. Where the tree first branches, each
    child (in chronological order) moves under the node with the tightest strictly larger
    window that contains it, among the nodes at that level. Unlike the seed:

    * a span is never moved under one of its own descendants (that made whole subtrees vanish);
    * with ``llm_call`` given, nothing but another LLM call moves under an LLM call span: a
      reward or agent span emitted while a call was in flight belongs beside the call, not in it;
    * spans without timestamps neither move nor receive;
    * children are re-sorted chronologically afterwards, so the result is order-independent.

    Returns:
        One line per move, for debugging.
    """
    level = _repair_level(root)
    moves: list[str] = []
    candidates = _candidates(level, llm_call)  # read once; again only after a move changed the tree
    for child in list(level.children):
        if len(level.children) <= 1:
            break
        if not child.has_times:
            continue
        target = _tightest_container(candidates, child, llm_call)
        if target is None:
            continue
        level.children.remove(child)
        target.children.append(child)
        target.children.sort(key=node_key)
        moves.append(f"{child.id} ({child.name}) moved under {target.id} ({target.name})")
        candidates = _candidates(level, llm_call)
    return moves
