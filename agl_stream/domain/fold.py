"""The rollout state machine: one pure function, ``fold(state, event, admission) -> FoldResult``.

The rollout processor folds every event of ``agl.rollouts`` into the rollout's
:class:`RolloutState`, in partition order. The fold does no I/O and reads no clock: "now" is the
event's ``time``, so replaying the topic rebuilds the same states. An event
is *applied* (new state), *rejected* (state unchanged, ``error``
says why: the writer's API raises it, the processor records it) or *ignored* (state unchanged,
no error: a watchdog verdict that something newer voided).

Every applied event bumps ``version`` by 1 (the first state has version 1), sets
``cause_event_id``/``cause_time`` and clears ``reserved_sequence_id`` (except a span sequence
reservation, which sets it). The input state is never mutated; the new state shares unchanged
sub-objects with it, so treat states as immutable.

Every event but RolloutEnqueued is rejected while the rollout does not exist ("unknown rollout
id ..."), and every event keyed by another rollout id than the state's is rejected. ``watchers`` (reply topics
the processor notifies when the rollout finishes) are the processor's business: carried over.

Rules applied to every status change of the rollout, whatever the event:

* into a terminal status (succeeded, failed, cancelled) from another status: ``end_time`` and
  ``finished_time`` = event time; out of a terminal status: both cleared. ``finished_time`` is
  ``None`` whenever the rollout is not terminal.
* into ``queuing``/``requeuing`` from a status that is neither (a new rollout included): the
  rollout enters its partition's queue (the processor's ClaimQueue follows the states, and
  ``admission`` bounds it); a rollout already waiting does not enter twice, and a claim of a
  rollout that left the queue is rejected.

Rollout status transitions (rows: event; columns: rollout status before; ``-`` = rejected,
``=`` = applied, status unchanged, ``ign`` = ignored):

    event / rollout before    none          queuing  requeuing  preparing  running  succeeded  failed  cancelled
    RolloutEnqueued           queuing[1]    -        -          -          -        -          -       -
    AttemptStarted (claim)    -             prep     prep       -          -        -          -       -
    AttemptStarted (manual)   -             prep     prep       prep       prep     prep       prep    prep
    AttemptHeartbeat          -             =        running[2] running[2] =        =          =       =
    AttemptUpdated            -             [3]      [3]        [3]        [3]      =          =       =
    WatchdogFired             -             [3]/ign  [3]/ign    [3]/ign    [3]/ign  =/ign      =/ign   =/ign
    RolloutUpdated(status=S)  -             S[4]     S[4]       S[4]       S[4]     S[4]       S[4]    S[4]
    RolloutCancelled          -             cancel   cancel     cancel     cancel   -          -       -
    SpanSequenceRequested     -             =[5]     =[5]       =[5]       =[5]     =          =       =

    [1] preparing when it carries an attempt (start_rollout).
    [2] when the heartbeat's attempt is the latest one and is running after it.
    [3] a status change of the latest attempt propagates (last table); else ``=``.
    [4] S = preparing/running is rejected while the rollout has no attempt.
    [5] as AttemptHeartbeat when it carries a span_count.

Attempt status transitions (rows: event; columns: attempt status before; "finished" =
succeeded, failed, timeout, unresponsive; "live" = preparing, running):

    event / attempt before    preparing  running   succeeded/failed/timeout  unresponsive
    AttemptHeartbeat          running    =         =                         running if latest, R not terminal; else =
    AttemptUpdated(status=S)  S          S         S if finished, else -     S if finished or running, else -
    WatchdogFired(V)          V if due   V if due  ign                       ign

Notes, per event:

* RolloutEnqueued: rejected if the rollout exists, its id is not the event key, it is not
  ``queuing`` or the attempt names another rollout. With an attempt (start_rollout): attempt
  #1, ``preparing``, started at event time, no task. The rollout's ``end_time`` is cleared.
  Without one it enters the queue, and ``admission`` (the queue of the event's partition,
  ``agl_stream.domain.queue.Admission``) may refuse it: rejected with a reason that starts with
  ``queue full`` (``admission_refusal``). No other event is refused for a full queue.
* AttemptStarted: a claim (``manual=false``) needs ``queuing``/``requeuing`` (else "another
  worker claimed it" / "it has already finished"); manual (start_attempt) works on any
  rollout and reopens a terminal one. Both reject a duplicate attempt id or an attempt of
  another rollout. The attempt gets sequence_id n+1 (the writer's is ignored), ``preparing``,
  start_time = event time, heartbeat and end cleared, worker = the event's else the attempt's.
* AttemptHeartbeat: unknown attempt rejected. last_heartbeat_time = event time, worker if
  given, next sequence id raised to max_sequence_id + 1, ``span_counts[attempt]`` += span_count
  (how many spans the triplet builder waits for once the attempt finished). ``preparing`` -> ``running``;
  ``unresponsive`` -> ``running`` (revived, end_time cleared) only for the latest attempt of a
  non-terminal rollout; other statuses only record the time. When the latest attempt is now
  ``running``, a ``preparing``/``requeuing`` rollout becomes ``running`` (its pending task is
  stale).
* AttemptUpdated: ``"latest"`` = highest sequence_id (rejected without attempts); unknown
  attempt rejected. A finished attempt (succeeded/failed/timeout/unresponsive) cannot return
  to preparing/running ("illegal transition failed -> running"), except unresponsive ->
  running; finished -> finished is allowed. Into a finished status: end_time = event time unless
  set; back to live: end_time cleared unless set. A *change* of the latest attempt's status
  propagates (table below); re-setting the same status does nothing more.
* RolloutUpdated: sets fields; ``preparing``/``running`` rejected while there is no attempt.
  Attempts are untouched.
* RolloutCancelled: rejected when terminal ("already succeeded"). Attempts are untouched: a
  live one stays live until its runner notices (or the watchdog closes it).
* SpanSequenceRequested: unknown attempt rejected; reserved_sequence_id = next (default 1);
  next += count. With span_count > 0 (a writer about to write spans it numbered with these
  ids) it is that attempt's heartbeat too, as AttemptHeartbeat(span_count, max_sequence_id)
  after the reservation, in the one new state.
* WatchdogFired: a status other than timeout/unresponsive is rejected. *Ignored* when the
  attempt is unknown, not preparing/running, its last_heartbeat_time differs from the observed
  one (a newer heartbeat voids the verdict) or the verdict is not due at event time
  (``due_verdicts``): so one attempt is judged once. Else as AttemptUpdated(status=verdict).

Propagation of the latest attempt's status change to the rollout (never onto a terminal
rollout, never from an older attempt):

    attempt becomes          rollout becomes
    preparing                preparing, if queuing/requeuing
    running                  running, if queuing/requeuing/preparing
    succeeded                succeeded
    failed/timeout/          unchanged if queuing/requeuing (a retry is already pending); else
      unresponsive           requeuing (+ task) if the status is in config.retry_condition and
                             attempts < config.max_attempts; else failed
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from agl_stream.domain.ingress import is_copy
from agl_stream.domain.queue import Admission, admission_refusal
from agl_stream.domain.watchdog import due_verdicts
from agl_stream.models.base import QUEUING_STATUSES, RUNNING_STATUSES, TERMINAL_STATUSES, AttemptStatus
from agl_stream.models.events import (
    AttemptHeartbeat,
    AttemptStarted,
    AttemptUpdated,
    RolloutCancelled,
    RolloutEnqueued,
    RolloutEvent,
    RolloutState,
    RolloutUpdated,
    SpanSequenceRequested,
    WatchdogFired,
)
from agl_stream.models.rollouts import Attempt, Rollout

__all__ = [
    "ATTEMPT_FINISHED_STATUSES",
    "WATCHDOG_STATUSES",
    "FoldResult",
    "Outcome",
    "fold",
    "latest_attempt",
    "may_queue",
]

Outcome = Literal["applied", "rejected", "ignored"]

ATTEMPT_FINISHED_STATUSES: frozenset[str] = frozenset({"succeeded", "failed", "timeout", "unresponsive"})
"""Attempt statuses that end an attempt (``end_time`` set); only unresponsive can revive."""
WATCHDOG_STATUSES: frozenset[str] = frozenset({"timeout", "unresponsive"})
"""The statuses a watchdog verdict may carry."""


@dataclass(frozen=True)
class FoldResult:
    """What folding one event did."""

    outcome: Outcome
    state: RolloutState | None = None
    """The new state when applied; ``None`` otherwise."""
    error: str | None = None
    """Why the event was rejected (user-facing); ``None`` otherwise."""


def latest_attempt(state: RolloutState) -> Attempt | None:
    """The attempt with the highest sequence_id, or ``None`` before the first."""
    index = _latest_index(state.attempts)
    return None if index is None else state.attempts[index]


def fold(state: RolloutState | None, event: RolloutEvent, admission: Admission | None = None) -> FoldResult:
    """Fold one event into the rollout's state (``None`` before the rollout exists).

    ``admission``: the queue of the event's partition, which a new queued rollout must fit in
    (None: no limit, as for a replay that derives what was admitted from the states).
    """
    payload = event.payload
    if state is not None and event.rollout_id != state.rollout.rollout_id:
        return _rejected(
            f"event {event.event_id} is for rollout {event.rollout_id}, "
            f"but was folded into rollout {state.rollout.rollout_id}"
        )
    if isinstance(payload, RolloutEnqueued):
        return _enqueued(state, event, payload, admission)
    if state is None:
        return _rejected(f"unknown rollout id {event.rollout_id}")
    if isinstance(payload, AttemptStarted):
        return _attempt_started(state, event, payload)
    if isinstance(payload, AttemptHeartbeat):
        return _heartbeat(state, event, payload)
    if isinstance(payload, AttemptUpdated):
        return _attempt_updated(state, event, payload)
    if isinstance(payload, RolloutUpdated):
        return _rollout_updated(state, event, payload)
    if isinstance(payload, RolloutCancelled):
        return _cancelled(state, event)
    if isinstance(payload, SpanSequenceRequested):
        return _sequence_requested(state, event, payload)
    if isinstance(payload, WatchdogFired):
        return _watchdog_fired(state, event, payload)
    raise TypeError(f"fold does not know the event payload {type(payload).__name__}")  # pragma: no cover


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------

_IGNORED = FoldResult(outcome="ignored")


def may_queue(payload: object) -> bool:
    """Whether folding an event with this payload can put its rollout in a queue (the tables
    above): an enqueue without an attempt, a rollout set to queuing/requeuing, an attempt
    ending any other way than succeeded (a retry). Anything unknown counts as able to."""
    if isinstance(payload, RolloutEnqueued):
        return payload.attempt is None
    if isinstance(payload, RolloutUpdated):
        return payload.status in QUEUING_STATUSES
    if isinstance(payload, AttemptUpdated):
        return payload.status in ATTEMPT_FINISHED_STATUSES - {"succeeded"}
    return not isinstance(payload, (AttemptStarted, AttemptHeartbeat, RolloutCancelled, SpanSequenceRequested))


def _rejected(error: str) -> FoldResult:
    return FoldResult(outcome="rejected", error=error)


def _latest_index(attempts: list[Attempt]) -> int | None:
    if not attempts:
        return None
    return max(range(len(attempts)), key=lambda i: attempts[i].sequence_id)


def _find_attempt(state: RolloutState, attempt_id: str) -> int | None:
    for index, attempt in enumerate(state.attempts):
        if attempt.attempt_id == attempt_id:
            return index
    return None


def _unknown_attempt(state: RolloutState, attempt_id: str) -> FoldResult:
    return _rejected(f"unknown attempt id {attempt_id} in rollout {state.rollout.rollout_id}")


def _replace(attempts: list[Attempt], index: int, attempt: Attempt) -> list[Attempt]:
    return [attempt if i == index else a for i, a in enumerate(attempts)]


def _commit(
    old: RolloutState | None,
    event: RolloutEvent,
    rollout: Rollout,
    attempts: list[Attempt],
    next_sequence_ids: dict[str, int],
    reserved_sequence_id: int | None = None,
    span_counts: dict[str, int] | None = None,
) -> FoldResult:
    """Build the applied state: version, cause, end/finished times of the new status."""
    old_status = old.rollout.status if old is not None else None
    status = rollout.status
    finished_time: float | None = None
    if status != old_status:
        if status in TERMINAL_STATUSES:
            rollout = rollout.model_copy(update={"end_time": event.time})
        elif old_status in TERMINAL_STATUSES:
            rollout = rollout.model_copy(update={"end_time": None})
    if status in TERMINAL_STATUSES:
        finished_time = old.finished_time if old is not None and status == old_status else event.time
    state = RolloutState(
        rollout=rollout,
        attempts=attempts,
        version=old.version + 1 if old is not None else 1,
        cause_event_id=event.event_id,
        cause_time=event.time,
        next_sequence_ids=next_sequence_ids,
        reserved_sequence_id=reserved_sequence_id,
        finished_time=finished_time,
        span_counts=span_counts if span_counts is not None else (old.span_counts if old is not None else {}),
        watchers=old.watchers if old is not None else [],
    )
    return FoldResult(outcome="applied", state=state)


def _propagate(rollout: Rollout, attempt_status: AttemptStatus, attempt_count: int) -> Rollout:
    """The rollout after its latest attempt changed to ``attempt_status``."""
    current = rollout.status
    if current in TERMINAL_STATUSES:
        return rollout
    if attempt_status == "preparing":
        target = "preparing" if current in QUEUING_STATUSES else current
    elif attempt_status == "running":
        target = "running" if current in QUEUING_STATUSES or current == "preparing" else current
    elif attempt_status == "succeeded":
        target = "succeeded"
    elif current in QUEUING_STATUSES:
        target = current
    elif attempt_status in rollout.config.retry_condition and attempt_count < rollout.config.max_attempts:
        target = "requeuing"
    else:
        target = "failed"
    return rollout if target == current else rollout.model_copy(update={"status": target})


# --------------------------------------------------------------------------------------------
# One function per event
# --------------------------------------------------------------------------------------------


def _enqueued(
    state: RolloutState | None, event: RolloutEvent, payload: RolloutEnqueued, admission: Admission | None
) -> FoldResult:
    rollout = payload.rollout
    if state is not None:
        # A copy of the enqueue that made it (a producer re-sending after a crash) changes nothing
        # and is answered; another rollout under the same id is refused.
        if is_copy(state.rollout, rollout):
            return _IGNORED
        return _rejected(f"rollout {state.rollout.rollout_id} already exists (with another input)")
    if rollout.rollout_id != event.rollout_id:
        return _rejected(
            f"event {event.event_id} is keyed by rollout {event.rollout_id} but enqueues {rollout.rollout_id}"
        )
    if rollout.status != "queuing":
        return _rejected(f"a new rollout must be queuing, not {rollout.status} (rollout {rollout.rollout_id})")
    if rollout.end_time is not None:  # a new rollout has not ended (a copy only when one says so)
        rollout = rollout.model_copy(update={"end_time": None})
    attempts: list[Attempt] = []
    if payload.attempt is not None:
        if payload.attempt.rollout_id != rollout.rollout_id:
            return _rejected(
                f"attempt {payload.attempt.attempt_id} belongs to rollout {payload.attempt.rollout_id}, "
                f"not {rollout.rollout_id}"
            )
        attempts = [_fresh_attempt(payload.attempt, 1, event.time, payload.attempt.worker_id)]
        rollout = rollout.model_copy(update={"status": "preparing"})
    else:
        refusal = admission_refusal(admission, rollout.rollout_id)
        if refusal is not None:
            return _rejected(refusal)
    return _commit(None, event, rollout, attempts, {})


def _fresh_attempt(attempt: Attempt, sequence_id: int, now: float, worker_id: str | None) -> Attempt:
    return attempt.model_copy(
        update={
            "sequence_id": sequence_id,
            "status": "preparing",
            "start_time": now,
            "end_time": None,
            "last_heartbeat_time": None,
            "worker_id": worker_id,
        }
    )


def _attempt_started(state: RolloutState, event: RolloutEvent, payload: AttemptStarted) -> FoldResult:
    rollout = state.rollout
    attempt = payload.attempt
    if attempt.rollout_id != rollout.rollout_id:
        return _rejected(
            f"attempt {attempt.attempt_id} belongs to rollout {attempt.rollout_id}, not {rollout.rollout_id}"
        )
    if _find_attempt(state, attempt.attempt_id) is not None:
        return _rejected(f"attempt {attempt.attempt_id} already exists in rollout {rollout.rollout_id}")
    if not payload.manual and rollout.status not in QUEUING_STATUSES:
        why = "another worker claimed it" if rollout.status in RUNNING_STATUSES else "it has already finished"
        return _rejected(f"rollout {rollout.rollout_id} is {rollout.status}, not queued: {why}")
    worker_id = payload.worker_id if payload.worker_id is not None else attempt.worker_id
    new_attempt = _fresh_attempt(attempt, len(state.attempts) + 1, event.time, worker_id)
    return _commit(
        state,
        event,
        rollout.model_copy(update={"status": "preparing"}),
        [*state.attempts, new_attempt],
        dict(state.next_sequence_ids),
    )


def _heartbeat(
    state: RolloutState,
    event: RolloutEvent,
    payload: AttemptHeartbeat,
    next_ids: dict[str, int] | None = None,
    reserved_sequence_id: int | None = None,
) -> FoldResult:
    """``next_ids``/``reserved_sequence_id``: a reservation folded in the same event (a
    SpanSequenceRequested that is the heartbeat of its spans too)."""
    index = _find_attempt(state, payload.attempt_id)
    if index is None:
        return _unknown_attempt(state, payload.attempt_id)
    attempt = state.attempts[index]
    rollout = state.rollout
    is_latest = index == _latest_index(state.attempts)
    update: dict[str, Any] = {"last_heartbeat_time": event.time}
    if payload.worker_id is not None:
        update["worker_id"] = payload.worker_id
    if attempt.status == "preparing":
        update["status"] = "running"
    elif attempt.status == "unresponsive" and is_latest and rollout.status not in TERMINAL_STATUSES:
        update["status"] = "running"
        update["end_time"] = None
    new_attempt = attempt.model_copy(update=update)
    if is_latest and new_attempt.status == "running" and rollout.status in ("preparing", "requeuing"):
        rollout = rollout.model_copy(update={"status": "running"})
    next_ids = dict(state.next_sequence_ids) if next_ids is None else next_ids
    if payload.max_sequence_id is not None:
        next_ids[attempt.attempt_id] = max(next_ids.get(attempt.attempt_id, 1), payload.max_sequence_id + 1)
    counts = state.span_counts
    if payload.span_count:
        counts = {**counts, attempt.attempt_id: counts.get(attempt.attempt_id, 0) + payload.span_count}
    attempts = _replace(state.attempts, index, new_attempt)
    return _commit(state, event, rollout, attempts, next_ids, reserved_sequence_id, span_counts=counts)


def _attempt_updated(state: RolloutState, event: RolloutEvent, payload: AttemptUpdated) -> FoldResult:
    if payload.attempt_id == "latest":
        index = _latest_index(state.attempts)
        if index is None:
            return _rejected(f"rollout {state.rollout.rollout_id} has no attempts, so it has no latest attempt")
    else:
        index = _find_attempt(state, payload.attempt_id)
        if index is None:
            return _unknown_attempt(state, payload.attempt_id)
    return _update_attempt(state, event, index, payload.changes())


def _update_attempt(state: RolloutState, event: RolloutEvent, index: int, changes: dict[str, Any]) -> FoldResult:
    """Set fields of one attempt (AttemptUpdated, WatchdogFired) and propagate its status."""
    attempt = state.attempts[index]
    update = dict(changes)
    old_status = attempt.status
    new_status: AttemptStatus = changes.get("status", old_status)
    if (
        old_status in ATTEMPT_FINISHED_STATUSES
        and new_status in RUNNING_STATUSES
        and not (old_status == "unresponsive" and new_status == "running")
    ):
        return _rejected(f"illegal transition {old_status} -> {new_status} for attempt {attempt.attempt_id}")
    if new_status != old_status and "end_time" not in changes:
        if new_status in ATTEMPT_FINISHED_STATUSES:
            update["end_time"] = event.time
        elif old_status in ATTEMPT_FINISHED_STATUSES:
            update["end_time"] = None
    rollout = state.rollout
    if new_status != old_status and index == _latest_index(state.attempts):
        rollout = _propagate(rollout, new_status, len(state.attempts))
    return _commit(
        state,
        event,
        rollout,
        _replace(state.attempts, index, attempt.model_copy(update=update)),
        dict(state.next_sequence_ids),
    )


def _rollout_updated(state: RolloutState, event: RolloutEvent, payload: RolloutUpdated) -> FoldResult:
    changes = payload.changes()
    status = changes.get("status")
    if status in RUNNING_STATUSES and not state.attempts:
        return _rejected(
            f"rollout {state.rollout.rollout_id} has no attempt, so it cannot be {status}: "
            "claim it or start an attempt instead"
        )
    return _commit(
        state, event, state.rollout.model_copy(update=changes), list(state.attempts), dict(state.next_sequence_ids)
    )


def _cancelled(state: RolloutState, event: RolloutEvent) -> FoldResult:
    rollout = state.rollout
    if rollout.status in TERMINAL_STATUSES:
        return _rejected(f"rollout {rollout.rollout_id} already {rollout.status}")
    return _commit(
        state,
        event,
        rollout.model_copy(update={"status": "cancelled"}),
        list(state.attempts),
        dict(state.next_sequence_ids),
    )


def _sequence_requested(state: RolloutState, event: RolloutEvent, payload: SpanSequenceRequested) -> FoldResult:
    if _find_attempt(state, payload.attempt_id) is None:
        return _unknown_attempt(state, payload.attempt_id)
    next_ids = dict(state.next_sequence_ids)
    reserved = next_ids.get(payload.attempt_id, 1)
    next_ids[payload.attempt_id] = reserved + payload.count
    if payload.span_count:
        beat = AttemptHeartbeat(
            attempt_id=payload.attempt_id, span_count=payload.span_count, max_sequence_id=payload.max_sequence_id
        )
        return _heartbeat(state, event, beat, next_ids, reserved)
    return _commit(state, event, state.rollout, list(state.attempts), next_ids, reserved_sequence_id=reserved)


def _watchdog_fired(state: RolloutState, event: RolloutEvent, payload: WatchdogFired) -> FoldResult:
    if payload.status not in WATCHDOG_STATUSES:
        return _rejected(f"a watchdog verdict must be timeout or unresponsive, not {payload.status}")
    index = _find_attempt(state, payload.attempt_id)
    if index is None:
        return _IGNORED
    attempt = state.attempts[index]
    if attempt.status not in RUNNING_STATUSES or attempt.last_heartbeat_time != payload.observed_heartbeat_time:
        return _IGNORED
    due = due_verdicts(state, event.time)
    if not any(v.attempt_id == attempt.attempt_id and v.status == payload.status for v in due):
        return _IGNORED
    return _update_attempt(state, event, index, {"status": payload.status})
