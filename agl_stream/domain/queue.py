"""The rollout queue as the processor sees it: which queued rollout a claim gets, and who waits.

Pure bookkeeping, no I/O and no clock (times are arguments). The rollout processor keeps one
:class:`ClaimQueue` for all the partitions it owns and updates it from every state it folds:

* a rollout is *queued* while its status is queuing/requeuing; ``since`` is when it entered the
  queue (its enqueue or requeue event's time), so claims go oldest first across partitions;
* a rollout handed to a claim is *reserved* until the processor folds the AttemptStarted event
  it wrote for that claim (applied or rejected): no second claim gets it meanwhile;
* a claim that finds nothing may *wait* (its ``wait_seconds``); waiting claims are served first
  come, first served as rollouts enter the queue, and answered empty at their deadline.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["ClaimQueue", "WaitingClaim", "claim_attempt_id"]

T = TypeVar("T")


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
    reserved: set[str] = field(default_factory=set)
    waiting: deque[WaitingClaim[T]] = field(default_factory=deque)

    def __len__(self) -> int:
        """Queued rollouts that a claim could get now."""
        return len(self._since) - len(self.reserved & self._since.keys())

    def queued(self, rollout_id: str, since: float) -> None:
        """The rollout is queued (again); a rollout already queued keeps its place."""
        if rollout_id in self._since:
            return
        self._counter += 1
        self._since[rollout_id] = since
        self._entry[rollout_id] = self._counter
        heapq.heappush(self._heap, (since, self._counter, rollout_id))

    def left(self, rollout_id: str) -> None:
        """The rollout is no longer queued (claimed, cancelled, forgotten); its heap entry goes stale."""
        self._since.pop(rollout_id, None)
        self._entry.pop(rollout_id, None)

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

    def next_deadline(self) -> float | None:
        return min((c.deadline for c in self.waiting), default=None)

    def clear(self) -> None:
        self._heap.clear()
        self._since.clear()
        self._entry.clear()
        self.reserved.clear()
