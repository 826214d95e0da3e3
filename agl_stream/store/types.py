"""Types of the store API that are not wire records: UNSET (and ``given``), AttemptedRollout, capabilities."""

from __future__ import annotations

from enum import Enum
from typing import Any, Final, TypedDict

from pydantic import BaseModel, Field

from agl_stream.models import Attempt, Rollout, RolloutConfig
from agl_stream.models.base import RolloutMode


class Unset(Enum):
    """The type of :data:`UNSET`: an argument that was not given, as opposed to an explicit None
    (``update_rollout(id, metadata=None)`` clears the metadata; leaving it out keeps it)."""

    UNSET = "UNSET"

    def __repr__(self) -> str:
        return "UNSET"

    def __bool__(self) -> bool:
        return False


UNSET: Final = Unset.UNSET


def given(**arguments: Any) -> dict[str, Any]:
    """The arguments that were given: those not :data:`UNSET`."""
    return {name: value for name, value in arguments.items() if value is not UNSET}


TaskInput = Any
"""What a rollout's ``input`` may be: any JSON value (the seed's name)."""


class EnqueueRolloutRequest(BaseModel):
    """One rollout to queue with ``enqueue_many_rollouts``: ``enqueue_rollout``'s arguments."""

    input: TaskInput
    mode: RolloutMode | None = None
    resources_id: str | None = None
    config: RolloutConfig | None = None
    metadata: dict[str, Any] | None = None


class Task(BaseModel):
    """A rollout as the seed's legacy HTTP client served it to agents (kept for code that reads
    these fields; the store's own methods return :class:`Rollout`)."""

    rollout_id: str
    input: TaskInput
    mode: RolloutMode | None = None
    resources_id: str | None = None
    create_time: float | None = None
    last_claim_time: float | None = None
    num_claims: int | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class AttemptedRollout(Rollout):
    """A rollout with the attempt a worker is running (returned by dequeue and start_*)."""

    attempt: Attempt


class StoreCapabilities(TypedDict, total=False):
    thread_safe: bool
    async_safe: bool
    zero_copy: bool
    otlp_traces: bool


class StoreStatistics(TypedDict, total=False):
    name: str
    total_rollouts: int
    total_attempts: int
    total_spans: int
    total_resources: int
    total_workers: int
    uptime: float
