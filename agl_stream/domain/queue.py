"""The rollout queue as the processor sees it: which queued rollout a claim gets, and who waits.

Pure bookkeeping, no I/O and no clock (times are arguments). The rollout processor keeps one
:class:`ClaimQueue` for all the partitions it owns and updates it from every state it folds:

* a rollout is *queued* while its status is queuing/requeuing; ``since`` is when it entered the
  queue (its enqueue or requeue event's time), so claims go oldest first across partitions;
* a rollout handed to a claim is *reserved* until the processor folds the AttemptStarted event
  it wrote for that claim (applied or rejected): no second claim gets it meanwhile;
* a claim that finds nothing may *wait* (its ``wait_seconds``); waiting claims are served first
  come, first served as rollouts enter the queue, and answered empty at their deadline;
* a claim *answered empty* is remembered (:data:`EMPTY_MEMORY_S`, at most
  :data:`EMPTY_MEMORY_MAX`): its claimer moved on, so the same request read again (a start-over
  after a failed batch re-reads what was not committed) is answered empty again, never served.

Admission: every queued rollout is held in the processor's memory, so the queue of each
partition of ``agl.rollouts`` is bounded (``Settings.max_queued_per_partition``). The fold
refuses a new rollout (``RolloutEnqueued`` into ``queuing``) when :func:`admission_refusal` says
so, from an :class:`Admission` the processor builds from this queue: the count is per partition,
a function of that partition's log alone, so a replay or another processor reaches the same
answer. An enqueue at or below what the partition's recovered states already cover, that left
no rollout, was refused when first folded and is refused again (``folded_before``). Requeues of
existing rollouts (a retry) are never refused. The refusal's message starts with
:data:`QUEUE_FULL`, which the store client turns into ``QueueFullError``.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = [
    "EMPTY_MEMORY_MAX",
    "EMPTY_MEMORY_S",
    "QUEUE_FULL",
    "Admission",
    "ClaimQueue",
    "WaitingClaim",
    "admission_refusal",
    "claim_attempt_id",
]

T = TypeVar("T")

QUEUE_FULL = "queue full"
"""How every admission refusal's message begins (the store client's cue for ``QueueFullError``)."""

EMPTY_MEMORY_S = 600.0
"""How long a claim answered empty is remembered: well past the ~12 s a broker failover keeps
commits failing (what a start-over reads again), at ~16 idle claims per runner per second."""
EMPTY_MEMORY_MAX = 200_000
"""The most claims answered empty remembered at once (the oldest go first)."""


@dataclass(frozen=True)
class Admission:
    """The queue of an event's partition when the event is folded: what admission decides on."""

    partition: int
    queued: int
    """Rollouts queued (queuing or requeuing) on the partition before the event."""
    limit: int | None
    """The most rollouts queued on one partition (None: no limit)."""
    folded_before: bool = False
    """The event is at or below the offset the partition's recovered states cover and left no
    rollout: it was folded before a restart, and refused."""


def admission_refusal(admission: Admission | None, rollout_id: str) -> str | None:
    """Why a new rollout may not enter the queue, or None when it may."""
    if admission is None or admission.limit is None:
        return None
    if admission.folded_before:
        return (
            f"{QUEUE_FULL}: rollout {rollout_id} was not admitted when its enqueue was first folded "
            f"(partition {admission.partition} of the rollouts topic held {admission.limit:,} queued "
            "rollouts, AGL_MAX_QUEUED_PER_PARTITION); wait for runners to claim queued rollouts, then "
            "enqueue it again"
        )
    if admission.queued >= admission.limit:
        return (
            f"{QUEUE_FULL}: rollout {rollout_id} refused, partition {admission.partition} of the rollouts "
            f"topic holds {admission.queued:,} queued rollouts, the limit (AGL_MAX_QUEUED_PER_PARTITION) is "
            f"{admission.limit:,}; wait for runners to claim queued rollouts (or raise the limit), then "
            "enqueue again"
        )
    return None


def claim_attempt_id(request_id: str) -> str:
    """The attempt id a claim request gets: derived, so a replayed request is recognised."""
    return "at-" + hashlib.sha256(request_id.encode()).hexdigest()[:8]


@dataclass(frozen=True)
class WaitingClaim(Generic[T]):
    """A claim that found nothing queued and may wait until ``deadline``."""

    request: T
    deadline: float


@dataclass
class ClaimQueue(Generic[T]):
    """Queued rollouts oldest first, reservations, and claims waiting for work."""

    _heap: list[tuple[float, int, str]] = field(default_factory=list)
    _since: dict[str, float] = field(default_factory=dict)
    _entry: dict[str, int] = field(default_factory=dict)  # rollout -> its live heap entry's counter
    _counter: int = 0
    _partition: dict[str, int] = field(default_factory=dict)  # queued rollout -> its partition
    _on: dict[int, int] = field(default_factory=dict)  # partition -> queued rollouts
    reserved: set[str] = field(default_factory=set)
    waiting: deque[WaitingClaim[T]] = field(default_factory=deque)
    _empty: dict[str, float] = field(default_factory=dict)  # request id -> answered empty at, oldest first

    def __len__(self) -> int:
        """Queued rollouts that a claim could get now."""
        return len(self._since) - len(self.reserved & self._since.keys())

    def queued_on(self, partition: int) -> int:
        """Queued rollouts of one partition, reserved ones included (still queued in the log)."""
        return self._on.get(partition, 0)

    def queued(self, rollout_id: str, since: float, partition: int = 0) -> None:
        """The rollout is queued (again); a rollout already queued keeps its place."""
        if rollout_id in self._since:
            return
        self._counter += 1
        self._since[rollout_id] = since
        self._partition[rollout_id] = partition
        self._on[partition] = self._on.get(partition, 0) + 1
        self._entry[rollout_id] = self._counter
        heapq.heappush(self._heap, (since, self._counter, rollout_id))

    def left(self, rollout_id: str) -> None:
        """The rollout is no longer queued (claimed, cancelled, forgotten); its heap entry goes stale."""
        if self._since.pop(rollout_id, None) is None:
            return
        self._entry.pop(rollout_id, None)
        partition = self._partition.pop(rollout_id)
        self._on[partition] -= 1

    def take(self) -> str | None:
        """Reserve and return the oldest queued rollout not reserved, or None."""
        while self._heap:
            _, counter, rollout_id = heapq.heappop(self._heap)
            if self._entry.get(rollout_id) != counter or rollout_id in self.reserved:
                continue  # stale: left the queue, queued again under a newer entry, or reserved
            self.reserved.add(rollout_id)  # out of the heap; release() puts it back if need be
            return rollout_id
        return None

    def release(self, rollout_id: str) -> None:
        """The claim event for the rollout was folded: it may be handed out again if still queued."""
        if rollout_id not in self.reserved:
            return
        self.reserved.discard(rollout_id)
        since = self._since.get(rollout_id)
        if since is not None:  # the claim lost (say, a manual attempt won): back in its place
            self._counter += 1
            self._entry[rollout_id] = self._counter
            heapq.heappush(self._heap, (since, self._counter, rollout_id))

    def wait(self, request: T, deadline: float) -> None:
        self.waiting.append(WaitingClaim(request, deadline))

    def expired(self, now: float) -> list[T]:
        """Remove and return the waiting claims whose deadline has passed."""
        kept: deque[WaitingClaim[T]] = deque()
        gone: list[T] = []
        for claim in self.waiting:
            if claim.deadline <= now:
                gone.append(claim.request)
            else:
                kept.append(claim)
        self.waiting = kept
        return gone

    def answered_empty(self, request_id: str, now: float) -> None:
        """The claim was answered empty: remembered, so that it is never served if read again."""
        self._empty.pop(request_id, None)
        self._empty[request_id] = now
        while True:  # the oldest first: O(1) per claim, amortised
            oldest, at = next(iter(self._empty.items()))
            if at >= now - EMPTY_MEMORY_S and len(self._empty) <= EMPTY_MEMORY_MAX:
                break
            del self._empty[oldest]

    def was_answered_empty(self, request_id: str) -> bool:
        return request_id in self._empty

    def next_deadline(self) -> float | None:
        return min((c.deadline for c in self.waiting), default=None)

    def clear(self) -> None:
        self._heap.clear()
        self._since.clear()
        self._entry.clear()
        self._partition.clear()
        self._on.clear()
        self.reserved.clear()
