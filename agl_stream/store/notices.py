"""What a store client knows without asking: the processor's notices on its reply topic.

Concurrency model: both classes belong to one store client and its event loop. The client's
ReplyChannel task calls their hooks (``heard``, ``on_queue``) as answers and notices arrive;
the client's coroutines read them concurrently. Nothing in them is thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from agl_stream.logs import get_logger
from agl_stream.models import Rollout
from agl_stream.models.base import TERMINAL_STATUSES
from agl_stream.models.replies import Reply
from agl_stream.store.writes import remember

log = get_logger("agl.store")

REWATCH_S = 30.0
"""A rollout watched this long ago, not finished since, is watched again by the next wait."""
EMPTY_HOLD_S = 0.02
"""How long a poll of a known-empty queue waits for work before it answers None: about what
asking the processor took, so callers' polling loops keep their pace."""
EMPTY_TTL_S = 1.0
"""How long a poll trusts that a partition's queue is empty without asking (a lost notice that
work arrived costs a poller at most this long)."""
_FINISHED_MEMORY = 20_000
"""Finished rollouts a client remembers for wait_for_rollouts (older ones are asked again; a
wait keeps what it saw finish itself). At 200,000 a runner, which never waits, grew by ~1 KB a
rollout for its first 200,000 (benchmarks/soak.py), more with large inputs."""


class FinishedRollouts:
    """Rollouts this client heard finish, and rollouts it will hear of when they do: the
    processor sends a notice to a rollout's enqueuer and to every client that watches it."""

    def __init__(self) -> None:
        self._finished: dict[str, Rollout] = {}
        self._watched: dict[str, float] = {}  # rollout id -> when hearing of it was last confirmed
        self._waits: list[_Wait] = []  # the waits in progress, each told of what it waits for
        self._reported_unknown: set[str] = set()  # ids a wait warned about once

    def heard(self, rollout: Rollout) -> bool:
        """A state the processor sent (an answer or a notice); whether the rollout finished."""
        if rollout.status not in TERMINAL_STATUSES:
            self._finished.pop(rollout.rollout_id, None)
            return False
        remember(self._finished, {rollout.rollout_id: rollout}, _FINISHED_MEMORY)
        self._watched.pop(rollout.rollout_id, None)  # nothing more to hear of it
        for waiting in self._waits:
            waiting.heard(rollout)
        return True

    def watching(self, rollout_id: str) -> None:
        """The processor will tell this client when the rollout finishes."""
        if rollout_id not in self._finished:  # finished ones were heard already
            self._watched[rollout_id] = time.monotonic()

    def watched(self, rollout_ids: Sequence[str], answers: Sequence[Reply]) -> list[str]:
        """The answers to watches of ``rollout_ids``; the ids the processor does not hold
        (finished and forgotten, or unknown), for the caller to look up."""
        forgotten = []
        for rid, answer in zip(rollout_ids, answers, strict=True):
            if answer.outcome == "unknown":
                forgotten.append(rid)
            else:
                self.watching(rid)
        return forgotten

    def looked_up(self, forgotten: Sequence[str], found: Iterable[Rollout]) -> None:
        """What the read side holds of the ``forgotten`` ids: the finished ones are heard; one not
        finished was enqueued but not folded yet (the next wait asks again); the rest are
        unknown, warned about once and left out of the answer."""
        known = {rollout.rollout_id: rollout for rollout in found}
        for rollout in known.values():
            if rollout.status in TERMINAL_STATUSES:
                self.heard(rollout)
        fresh = [rid for rid in forgotten if rid not in known and rid not in self._reported_unknown]
        if fresh:
            self._reported_unknown.update(fresh)
            log.warning("wait_for_rollouts: no such rollouts; left out of the answer", rollout_ids=fresh[:20])

    def unseen(self, rollout_ids: Iterable[str]) -> list[str]:
        """Those never seen, or watched long ago without a word since: a notice can be lost while
        a broker fails over, and watching again (the answer carries the state) makes up for it."""
        stale_before = time.monotonic() - REWATCH_S
        return [
            rid for rid in rollout_ids if rid not in self._finished and self._watched.get(rid, -1e18) < stale_before
        ]

    async def wait(self, rollout_ids: Sequence[str], timeout: float | None) -> dict[str, Rollout]:
        """Those of ``rollout_ids`` heard finished before ``timeout``, by id. A notice costs the
        waits in progress one set lookup each, whatever the number of ids they wait for (the
        seed's algorithm waits on thousands at once, and each notice used to rescan them all)."""
        waiting = _Wait({rid: self._finished[rid] for rid in rollout_ids if rid in self._finished})
        waiting.missing.update(rid for rid in rollout_ids if rid not in waiting.got)
        if not waiting.missing or (timeout is not None and timeout <= 0):
            return waiting.got
        self._waits.append(waiting)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waiting.all_heard.wait(), timeout)
        finally:
            self._waits.remove(waiting)
        return waiting.got


@dataclass
class _Wait:
    """One wait_for_rollouts in progress: what it got, and the ids it still waits for."""

    got: dict[str, Rollout]  # kept here: the memory of finished ones is bounded
    missing: set[str] = field(default_factory=set)
    all_heard: asyncio.Event = field(default_factory=asyncio.Event)

    def heard(self, rollout: Rollout) -> None:
        if rollout.rollout_id in self.missing:
            self.missing.discard(rollout.rollout_id)
            self.got[rollout.rollout_id] = rollout
            if not self.missing:
                self.all_heard.set()


class ClaimQueues:
    """The processors' queues, per agl.store-requests partition: those a claim found empty and
    no notice of work reached since (a poll skips them: an idle runner's polls cost no round
    trip), and the partition to ask first (the last one that had work)."""

    def __init__(self) -> None:
        self._empty_at: dict[int, float] = {}  # partition -> when a claim found it empty (monotonic)
        self._woken: set[int] = set()  # partitions noticed to have work, not yet asked by a poll
        self._work_queued = asyncio.Event()
        self._first = 0

    def on_queue(self, reply: Reply) -> None:
        """A claim answer that left its processor's partitions empty (answered empty, or served the
        last queued rollout) marks them empty; its notice that work was queued clears them. All
        arrive on the reply topic in the order the processor sent them, and are heard here in
        that order (a poll that reads its answer later must not mark anything itself)."""
        if reply.outcome != "notice":
            now = time.monotonic()
            for partition in reply.covered_partitions:
                self._empty_at[partition] = now
            self._woken.difference_update(reply.covered_partitions)
        else:
            # One poll of this client asks (not every idle runner at once): if it gets a
            # rollout, the marks go and every poll asks again (more may be queued).
            self._woken.update(reply.covered_partitions)
            self._work_queued.set()  # wakes the polls holding on a known-empty queue
            self._work_queued = asyncio.Event()

    def ask_all(self) -> None:
        """Work may be queued (this client wrote an event that may queue it): every poll asks."""
        self._empty_at.clear()

    async def skipped(self, partitions: Sequence[int]) -> set[int]:
        """The partitions a poll skips. When that is all of them, the poll first waits for a
        notice of work as long as asking would take (so a loop of polls neither spins nor
        starves the loop). A mark expires, in case its notice was lost (a processor that
        restarted). The partitions not skipped count as asked from here on."""
        skipped = self._known_empty(partitions)
        if len(skipped) == len(partitions):
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._work_queued.wait(), EMPTY_HOLD_S)
            skipped = self._known_empty(partitions)
        self._woken.difference_update(set(partitions) - skipped)
        return skipped

    def _known_empty(self, partitions: Sequence[int]) -> set[int]:
        now = time.monotonic()
        return {
            p for p in partitions if p not in self._woken and now - self._empty_at.get(p, -EMPTY_TTL_S) < EMPTY_TTL_S
        }

    def next(self, partitions: Sequence[int], covered: set[int]) -> int:
        """The partition to ask next: the first not ``covered``, round from the one to ask first."""
        n = len(partitions)
        return next(p for p in (partitions[(self._first + i) % n] for i in range(n)) if p not in covered)

    def answered(self, partition: int, *, found_work: bool, left_empty: bool = False) -> None:
        """A poll's answer from ``partition``'s processor: a rollout (``found_work``; and
        ``left_empty`` when the answer said the queue is empty now), or none."""
        if found_work:
            if not left_empty:
                self._empty_at.clear()  # more may be queued: every poll asks
            self._first = partition  # a processor with work: ask it first next time
        else:
            self._first = partition + 1
