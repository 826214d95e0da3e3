"""Wire records as pydantic models, one per Avro record in ``schemas/`` (same names, same fields).

Every model has ``avro_name`` (the Avro full name) and forbids unknown fields. Encode and decode
them with :class:`agl_stream.wire.codec.Codec`.
"""

from __future__ import annotations

from agl_stream.models.base import (
    AVRO_CONTEXT,
    QUEUING_STATUSES,
    RUNNING_STATUSES,
    TERMINAL_STATUSES,
    TYPE_KEY,
    AglModel,
    AttemptStatus,
    JsonObject,
    JsonValue,
    RolloutMode,
    RolloutStatus,
    StatusCode,
    UnionMember,
    WorkerStatus,
)
from agl_stream.models.dlq import DlqRecord
from agl_stream.models.events import (
    PAYLOAD_TYPES,
    AttemptHeartbeat,
    AttemptStarted,
    AttemptUpdated,
    RolloutCancelled,
    RolloutEnqueued,
    RolloutEvent,
    RolloutEventPayload,
    RolloutState,
    RolloutUpdated,
    SpanSequenceRequested,
    WatchdogFired,
)
from agl_stream.models.replies import Reply, ReplyOutcome, StoreRequest, StoreRequestKind
from agl_stream.models.resources import (
    LLM,
    ModelCheckpoint,
    PromptTemplate,
    ProxyLLM,
    Resource,
    ResourcesUpdate,
)
from agl_stream.models.rollouts import Attempt, Rollout, RolloutConfig, Worker
from agl_stream.models.spans import (
    Attributes,
    AttributeScalar,
    AttributeValue,
    OtelResource,
    Span,
    SpanBatch,
    SpanContext,
    SpanEvent,
    SpanLink,
    SpanStatus,
)
from agl_stream.models.tasks import TaskRequest
from agl_stream.models.training import TrainerStep, Triplet, TripletBatch, TripletRecord

RECORD_MODELS: tuple[type[AglModel], ...] = (
    RolloutConfig,
    Rollout,
    Attempt,
    Worker,
    LLM,
    ProxyLLM,
    PromptTemplate,
    ModelCheckpoint,
    ResourcesUpdate,
    SpanContext,
    SpanStatus,
    SpanEvent,
    SpanLink,
    OtelResource,
    Span,
    SpanBatch,
    *PAYLOAD_TYPES,
    RolloutEvent,
    RolloutState,
    TaskRequest,
    Triplet,
    TripletRecord,
    TrainerStep,
    TripletBatch,
    DlqRecord,
    StoreRequest,
    Reply,
)
"""Every wire record model; each mirrors ``schemas/<Name>.avsc``."""

MODELS: dict[str, type[AglModel]] = {model.avro_name: model for model in RECORD_MODELS}
"""Models by Avro full name (``"agl.Span"`` -> Span)."""

__all__ = [
    "AVRO_CONTEXT",
    "LLM",
    "MODELS",
    "PAYLOAD_TYPES",
    "QUEUING_STATUSES",
    "RECORD_MODELS",
    "RUNNING_STATUSES",
    "TERMINAL_STATUSES",
    "TYPE_KEY",
    "AglModel",
    "Attempt",
    "AttemptHeartbeat",
    "AttemptStarted",
    "AttemptStatus",
    "AttemptUpdated",
    "AttributeScalar",
    "AttributeValue",
    "Attributes",
    "DlqRecord",
    "JsonObject",
    "JsonValue",
    "ModelCheckpoint",
    "OtelResource",
    "PromptTemplate",
    "ProxyLLM",
    "Reply",
    "ReplyOutcome",
    "Resource",
    "ResourcesUpdate",
    "Rollout",
    "RolloutCancelled",
    "RolloutConfig",
    "RolloutEnqueued",
    "RolloutEvent",
    "RolloutEventPayload",
    "RolloutMode",
    "RolloutState",
    "RolloutStatus",
    "RolloutUpdated",
    "Span",
    "SpanBatch",
    "SpanContext",
    "SpanEvent",
    "SpanLink",
    "SpanSequenceRequested",
    "SpanStatus",
    "StatusCode",
    "StoreRequest",
    "StoreRequestKind",
    "TaskRequest",
    "TrainerStep",
    "Triplet",
    "TripletBatch",
    "TripletRecord",
    "UnionMember",
    "WatchdogFired",
    "Worker",
    "WorkerStatus",
]
