"""Types of the store API that are not wire records: UNSET, AttemptedRollout, capabilities."""

from __future__ import annotations

from typing import Any, TypedDict

from agl_stream.models import Attempt, Rollout


class _UnsetType:
    """The value of an argument that was not given (as opposed to an explicit None)."""

    __slots__ = ()
    _instance: _UnsetType | None = None

    def __new__(cls) -> _UnsetType:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNSET"

    def __bool__(self) -> bool:
        return False

    def __reduce__(self) -> tuple[Any, ...]:
        return (_UnsetType, ())


UNSET: Any = _UnsetType()
Unset = _UnsetType


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
