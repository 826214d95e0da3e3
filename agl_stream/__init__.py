"""agl-stream: Agent Lightning as an event-sourced pipeline over Apache Kafka.

The agent-facing names (models, ``LitAgent`` and ``@rollout``, the emitters) load with the
package; the heavy ones (the algorithms, which load the openai client; the ``Trainer``; the store
client; ``CommandAgent``) load on first use (PEP 562), so a role process or ``--help`` that
never touches them does not pay for them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from agl_stream.agent.emitters import (
    emit_annotation,
    emit_exception,
    emit_message,
    emit_object,
    emit_reward,
    find_final_reward,
    find_reward_spans,
    get_message_value,
    get_object_value,
    get_reward_value,
    get_rewards_from_span,
    is_reward_span,
)
from agl_stream.agent.litagent import (
    FunctionalLitAgent,
    Hook,
    LitAgent,
    NamedResources,
    llm_rollout,
    prompt_rollout,
    rollout,
)
from agl_stream.models import (
    LLM,
    Attempt,
    AttemptStatus,
    OtelResource,
    PromptTemplate,
    ProxyLLM,
    Resource,
    ResourcesUpdate,
    Rollout,
    RolloutConfig,
    RolloutMode,
    RolloutStatus,
    Span,
    SpanContext,
    StatusCode,
    Triplet,
    Worker,
    WorkerStatus,
)
from agl_stream.models import SpanStatus as TraceStatus
from agl_stream.store.types import (
    UNSET,
    AttemptedRollout,
    EnqueueRolloutRequest,
    StoreCapabilities,
    StoreStatistics,
    Task,
    TaskInput,
)

if TYPE_CHECKING:
    from agl_stream.agent.command_agent import CommandAgent
    from agl_stream.algorithm import APO, VERL, Algorithm, Baseline, FastAlgorithm, algo
    from agl_stream.store.client import AglStore, connect
    from agl_stream.trainer import FitResult, Trainer

    LightningStore = AglStore

# name -> (module, attribute) of the names loaded on first use.
_LAZY = {
    **{
        name: ("agl_stream.algorithm", name)
        for name in ("APO", "VERL", "Algorithm", "Baseline", "FastAlgorithm", "algo")
    },
    "CommandAgent": ("agl_stream.agent.command_agent", "CommandAgent"),
    "AglStore": ("agl_stream.store.client", "AglStore"),
    "connect": ("agl_stream.store.client", "connect"),
    # The seed's name for the store: code written against it runs as it is.
    "LightningStore": ("agl_stream.store.client", "AglStore"),
    "FitResult": ("agl_stream.trainer", "FitResult"),
    "Trainer": ("agl_stream.trainer", "Trainer"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'agl_stream' has no attribute {name!r}")
    module, attribute = _LAZY[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # once loaded, an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


# The seed's names for the store's descriptions.
LightningStoreCapabilities = StoreCapabilities
LightningStoreStatistics = StoreStatistics

__all__ = [
    "APO",
    "LLM",
    "UNSET",
    "VERL",
    "AglStore",
    "Algorithm",
    "Attempt",
    "AttemptStatus",
    "AttemptedRollout",
    "Baseline",
    "CommandAgent",
    "EnqueueRolloutRequest",
    "FastAlgorithm",
    "FitResult",
    "FunctionalLitAgent",
    "Hook",
    "LightningStore",
    "LightningStoreCapabilities",
    "LightningStoreStatistics",
    "LitAgent",
    "NamedResources",
    "OtelResource",
    "PromptTemplate",
    "ProxyLLM",
    "Resource",
    "ResourcesUpdate",
    "Rollout",
    "RolloutConfig",
    "RolloutMode",
    "RolloutStatus",
    "Span",
    "SpanContext",
    "StatusCode",
    "Task",
    "TaskInput",
    "TraceStatus",
    "Trainer",
    "Triplet",
    "Worker",
    "WorkerStatus",
    "algo",
    "connect",
    "emit_annotation",
    "emit_exception",
    "emit_message",
    "emit_object",
    "emit_reward",
    "find_final_reward",
    "find_reward_spans",
    "get_message_value",
    "get_object_value",
    "get_reward_value",
    "get_rewards_from_span",
    "is_reward_span",
    "llm_rollout",
    "prompt_rollout",
    "rollout",
]
