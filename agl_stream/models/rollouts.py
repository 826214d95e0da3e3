"""Rollouts, attempts and workers."""

from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import Field

from agl_stream.models.base import (
    AglModel,
    AttemptStatus,
    Int32,
    JsonObject,
    JsonValue,
    RolloutMode,
    RolloutStatus,
    StoredSeconds,
    WorkerStatus,
)


class RolloutConfig(AglModel):
    """Retry and liveness policy of a rollout."""

    avro_name: ClassVar[str] = "agl.RolloutConfig"

    timeout_seconds: float | None = None
    unresponsive_seconds: float | None = None
    max_attempts: Annotated[Int32, Field(ge=1)] = 1
    retry_condition: list[AttemptStatus] = Field(default_factory=list)


class Rollout(AglModel):
    """A task to run."""

    avro_name: ClassVar[str] = "agl.Rollout"

    rollout_id: str
    input: JsonValue
    start_time: StoredSeconds
    end_time: StoredSeconds | None = None
    mode: RolloutMode | None = None
    resources_id: str | None = None
    status: RolloutStatus = "queuing"
    config: RolloutConfig = Field(default_factory=RolloutConfig)
    metadata: JsonObject | None = None


class Attempt(AglModel):
    """One execution of a rollout."""

    avro_name: ClassVar[str] = "agl.Attempt"

    rollout_id: str
    attempt_id: str
    sequence_id: int = Field(ge=1)
    start_time: StoredSeconds
    end_time: StoredSeconds | None = None
    status: AttemptStatus = "preparing"
    worker_id: str | None = None
    last_heartbeat_time: StoredSeconds | None = None
    metadata: JsonObject | None = None


class Worker(AglModel):
    """A runner's liveness and current assignment (topic agl.workers)."""

    avro_name: ClassVar[str] = "agl.Worker"

    worker_id: str
    status: WorkerStatus = "unknown"
    heartbeat_stats: JsonObject | None = None
    last_heartbeat_time: StoredSeconds | None = None
    last_dequeue_time: StoredSeconds | None = None
    last_busy_time: StoredSeconds | None = None
    last_idle_time: StoredSeconds | None = None
    current_rollout_id: str | None = None
    current_attempt_id: str | None = None


WORKER_STOPPED = "stopped"
"""The key of ``Worker.heartbeat_stats`` that a runner sets (``true``) in its last heartbeat as it
stops cleanly: the seed's WorkerStatus has no value for a worker that left, so its stats say it."""
