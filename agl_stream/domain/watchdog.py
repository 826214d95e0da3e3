"""Watchdog verdicts: which live attempts of a rollout are over their time budget or silent.

Pure functions of a :class:`RolloutState` and a time; the rollout processor calls
:func:`next_deadline` to schedule one timer per rollout and :func:`due_verdicts` when it fires,
then appends the verdicts to ``agl.rollouts`` as :class:`WatchdogFired` events. The fold
re-checks every verdict against the state it meets (see ``agl_stream.domain.fold``), so a verdict
that a heartbeat overtook, or a second copy of one, is ignored there.

Rules, for every attempt in ``preparing`` or ``running`` (the rollout's status does not matter:
the attempts of a cancelled rollout are still closed by the watchdog):

    verdict        due when (comparisons are strict)                                checked
    timeout        timeout_seconds is set and now - start_time > timeout_seconds      first
    unresponsive   unresponsive_seconds is set and                                   if not timed out
                   now - (last_heartbeat_time, else start_time) > unresponsive_seconds

At most one verdict per attempt; ``observed_heartbeat_time`` is the attempt's
``last_heartbeat_time`` (``None`` before the first heartbeat).
"""

from __future__ import annotations

import math
import sys
from typing import Literal

from agl_stream.models.base import RUNNING_STATUSES
from agl_stream.models.events import RolloutState, WatchdogFired
from agl_stream.models.rollouts import Attempt, RolloutConfig

Verdict = Literal["timeout", "unresponsive"]

__all__ = ["Verdict", "due_verdicts", "next_deadline", "verdict_for"]


def _liveness_base(attempt: Attempt) -> float:
    """The time silence is measured from: the last heartbeat, else the attempt's start."""
    return attempt.last_heartbeat_time if attempt.last_heartbeat_time is not None else attempt.start_time


def verdict_for(attempt: Attempt, config: RolloutConfig, now: float) -> Verdict | None:
    """The verdict due for one attempt at ``now``, or ``None`` (also for finished attempts)."""
    if attempt.status not in RUNNING_STATUSES:
        return None
    if config.timeout_seconds is not None and now - attempt.start_time > config.timeout_seconds:
        return "timeout"
    if config.unresponsive_seconds is not None and now - _liveness_base(attempt) > config.unresponsive_seconds:
        return "unresponsive"
    return None


def due_verdicts(state: RolloutState, now: float) -> list[WatchdogFired]:
    """The verdicts due at ``now``, one per live attempt at most, in attempt order."""
    config = state.rollout.config
    verdicts: list[WatchdogFired] = []
    for attempt in state.attempts:
        status = verdict_for(attempt, config, now)
        if status is not None:
            verdicts.append(
                WatchdogFired(
                    attempt_id=attempt.attempt_id,
                    status=status,
                    observed_heartbeat_time=attempt.last_heartbeat_time,
                )
            )
    return verdicts


def _first_time_over(base: float, limit: float) -> float | None:
    """The smallest float ``t`` with ``t - base > limit`` (``None`` if there is none).

    ``base + limit`` itself is not due (the comparison is strict) unless rounding pushed it
    up, so this steps to the next representable floats; a timer set to the returned time finds
    the verdict due, and one set any earlier finds nothing.
    """
    if math.isnan(limit) or math.isnan(base) or limit == math.inf:
        return None
    if limit == -math.inf:
        return -sys.float_info.max
    t = base + limit
    if not math.isfinite(t):
        return None
    for _ in range(4):
        if t - base > limit:
            return t
        t = math.nextafter(t, math.inf)
    # Degenerate magnitudes (a limit of the order of -base, say): widen the step until it is due.
    step = math.ulp(max(abs(base), abs(limit), abs(t)))
    while not t - base > limit:
        t += step
        step *= 2
        if not math.isfinite(t):
            return None
    return t


def next_deadline(state: RolloutState) -> float | None:
    """The earliest time at which :func:`due_verdicts` would report a verdict, if nothing else
    happens first (a heartbeat only moves it later); ``None`` when no live attempt is watched.

    ``due_verdicts(state, next_deadline(state))`` is never empty, and is empty for any earlier
    time: fire the timer at this time exactly, no margin needed.
    """
    config = state.rollout.config
    earliest: float | None = None
    for attempt in state.attempts:
        if attempt.status not in RUNNING_STATUSES:
            continue
        candidates: list[float | None] = []
        if config.timeout_seconds is not None:
            candidates.append(_first_time_over(attempt.start_time, config.timeout_seconds))
        if config.unresponsive_seconds is not None:
            candidates.append(_first_time_over(_liveness_base(attempt), config.unresponsive_seconds))
        for deadline in candidates:
            if deadline is not None and (earliest is None or deadline < earliest):
                earliest = deadline
    return earliest
