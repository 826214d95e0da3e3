"""Trace -> triplet adapter: pure functions from the spans of one attempt to training triplets.

No I/O here: the triplet processor feeds spans in and publishes what comes out.
"""

from agl_stream.domain.adapter.trajectory import (
    AGGREGATIONS,
    BRANCH,
    DRIFT,
    REWRITTEN,
    Aggregated,
    Aggregation,
    aggregate_triplets,
    break_reason,
)
from agl_stream.domain.adapter.tree import (
    VIRTUAL_ROOT_ID,
    TraceNode,
    TraceTree,
    agent_name_of,
    build_tree,
    repair_hierarchy,
)
from agl_stream.domain.adapter.triplets import (
    DEFAULT_LLM_CALL_MATCH,
    AdapterConfig,
    AdapterResult,
    RewardMatchPolicy,
    extract_triplets,
)

__all__ = [
    "AGGREGATIONS",
    "BRANCH",
    "DEFAULT_LLM_CALL_MATCH",
    "DRIFT",
    "REWRITTEN",
    "VIRTUAL_ROOT_ID",
    "AdapterConfig",
    "AdapterResult",
    "Aggregated",
    "Aggregation",
    "RewardMatchPolicy",
    "TraceNode",
    "TraceTree",
    "agent_name_of",
    "aggregate_triplets",
    "break_reason",
    "build_tree",
    "extract_triplets",
    "repair_hierarchy",
]
