"""Types of the store API that are not wire records: UNSET, AttemptedRollout, capabilities."""

from __future__ import annotations

from enum import Enum
from typing import Final, TypedDict

from agl_stream.models import Attempt, Rollout


class Unset(Enum):
    """The type of :data:`UNSET`: an argument that was not given, as opposed to an explicit None
    (``update_rollout(id, metadata=None)`` clears the metadata; leaving it out keeps it)."""

    UNSET = "UNSET"

    def __repr__(self) -> str:
        return "UNSET"

    def __bool__(self) -> bool:
        return False


UNSET: Final = Unset.UNSET


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
