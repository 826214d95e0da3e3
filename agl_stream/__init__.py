"""agl-stream: Agent Lightning as an event-sourced pipeline over Apache Kafka.

``import agl_stream as agl`` offers the agent-facing API (models, ``LitAgent`` and ``@rollout``,
the emitters, the store client, the algorithms, the ``Trainer``). Every name loads on first use
(PEP 562): importing the package, or any module under it (the CLI answering ``--help``, a role
process), loads none of pydantic's models, the tracing stack, the openai client or torch until
something asks for them. ``from agl_stream import X`` works as for an ordinary attribute.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from agl_stream.agent.command_agent import CommandAgent
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
    from agl_stream.algorithm import APO, VERL, Algorithm, Baseline, FastAlgorithm, algo
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
    from agl_stream.store.client import AglStore, connect
    from agl_stream.store.types import (
        UNSET,
        AttemptedRollout,
        EnqueueRolloutRequest,
        StoreCapabilities,
        StoreStatistics,
        Task,
        TaskInput,
    )
    from agl_stream.trainer import FitResult, Trainer

    # The seed's names for the store and its descriptions: code written against them runs as it is.
    LightningStore = AglStore
    LightningStoreCapabilities = StoreCapabilities
    LightningStoreStatistics = StoreStatistics


def _from(module: str, *names: str) -> dict[str, tuple[str, str]]:
    return {name: (module, name) for name in names}


# name -> (module, attribute): where each public name lives; loaded on first use.
_LAZY: dict[str, tuple[str, str]] = {
    **_from(
        "agl_stream.agent.emitters",
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
    ),
    **_from(
        "agl_stream.agent.litagent",
        "FunctionalLitAgent",
        "Hook",
        "LitAgent",
        "NamedResources",
        "llm_rollout",
        "prompt_rollout",
        "rollout",
    ),
    **_from(
        "agl_stream.models",
        "LLM",
        "Attempt",
        "AttemptStatus",
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
        "Triplet",
        "Worker",
        "WorkerStatus",
    ),
    "TraceStatus": ("agl_stream.models", "SpanStatus"),
    **_from(
        "agl_stream.store.types",
        "UNSET",
        "AttemptedRollout",
        "EnqueueRolloutRequest",
        "StoreCapabilities",
        "StoreStatistics",
        "Task",
        "TaskInput",
    ),
    "LightningStoreCapabilities": ("agl_stream.store.types", "StoreCapabilities"),
    "LightningStoreStatistics": ("agl_stream.store.types", "StoreStatistics"),
    **_from("agl_stream.algorithm", "APO", "VERL", "Algorithm", "Baseline", "FastAlgorithm", "algo"),
    "CommandAgent": ("agl_stream.agent.command_agent", "CommandAgent"),
    **_from("agl_stream.store.client", "AglStore", "connect"),
    "LightningStore": ("agl_stream.store.client", "AglStore"),
    **_from("agl_stream.trainer", "FitResult", "Trainer"),
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
    "StoreCapabilities",
    "StoreStatistics",
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
