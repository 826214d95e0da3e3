"""agl-stream: Agent Lightning as an event-sourced pipeline over Apache Kafka."""

__version__ = "0.1.0"

from agl_stream.algorithm import APO, VERL, Algorithm, Baseline, FastAlgorithm, algo
from agl_stream.emitters import (
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
from agl_stream.litagent import (
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

# The seed's names for the store and its descriptions: code written against it runs as it is.
LightningStore = AglStore
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
