"""The rollout state machine (agl_stream.domain.fold): every transition, without Kafka."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, get_args

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agl_stream.domain.fold import FoldResult, fold, latest_attempt, may_queue
from agl_stream.domain.watchdog import due_verdicts
from agl_stream.models import (
    QUEUING_STATUSES,
    TERMINAL_STATUSES,
    Attempt,
    AttemptHeartbeat,
    AttemptStarted,
    AttemptStatus,
    AttemptUpdated,
    Rollout,
    RolloutCancelled,
    RolloutConfig,
    RolloutEnqueued,
    RolloutEvent,
    RolloutEventPayload,
    RolloutState,
    RolloutStatus,
    RolloutUpdated,
    SpanSequenceRequested,
    WatchdogFired,
)
from agl_stream.models.base import stored_seconds

RID = "ro-0123456789ab"
OTHER_RID = "ro-ba9876543210"
T0 = 1_700_000_000.0

ROLLOUT_STATUSES: tuple[RolloutStatus, ...] = get_args(RolloutStatus)
ATTEMPT_STATUSES: tuple[AttemptStatus, ...] = get_args(AttemptStatus)
FINISHED: frozenset[str] = frozenset({"succeeded", "failed", "timeout", "unresponsive"})
LIVE: frozenset[str] = frozenset({"preparing", "running"})

_event_ids = itertools.count(1)


# --------------------------------------------------------------------------------------------
# Builders
# --------------------------------------------------------------------------------------------


def aid(n: int) -> str:
    return f"at-{n:08x}"


def make_rollout(status: RolloutStatus = "queuing", config: RolloutConfig | None = None, **fields: Any) -> Rollout:
    return Rollout(
        rollout_id=RID,
        input={"q": 1},
        start_time=T0,
        status=status,
        config=config or RolloutConfig(),
        **fields,
    )


def make_attempt(n: int = 1, status: AttemptStatus = "preparing", **fields: Any) -> Attempt:
    fields.setdefault("start_time", T0 + n)
    return Attempt(rollout_id=RID, attempt_id=aid(n), sequence_id=n, status=status, **fields)


def make_state(
    status: RolloutStatus,
    attempts: Sequence[AttemptStatus] = (),
    config: RolloutConfig | None = None,
    **fields: Any,
) -> RolloutState:
    """A state built directly (not folded): rollout ``status`` with attempts 1..n."""
    end = T0 + 50 if status in TERMINAL_STATUSES else None
    built = [
        make_attempt(i, s, end_time=T0 + 40 + i if s in FINISHED else None) for i, s in enumerate(attempts, start=1)
    ]
    fields.setdefault("finished_time", end)
    return RolloutState(
        rollout=make_rollout(status, config, end_time=end),
        attempts=built,
        version=7,
        cause_event_id="ev-previous",
        cause_time=T0 + 50,
        **fields,
    )


def make_event(payload: RolloutEventPayload, time: float = T0 + 100, rollout_id: str = RID) -> RolloutEvent:
    return RolloutEvent(
        event_id=f"ev-{next(_event_ids)}", rollout_id=rollout_id, time=time, writer="test", payload=payload
    )


def claim(n: int, worker: str | None = "w-1", manual: bool = False, sequence_id: int = 1) -> AttemptStarted:
    attempt = Attempt(rollout_id=RID, attempt_id=aid(n), sequence_id=sequence_id, start_time=0.0)
    return AttemptStarted(attempt=attempt, worker_id=worker, manual=manual)


def run(state: RolloutState | None, payload: RolloutEventPayload, time: float = T0 + 100) -> FoldResult:
    """Fold one event and check what must hold for every outcome."""
    before = state.model_dump() if state is not None else None
    event = make_event(payload, time)
    result = fold(state, event)
    if state is not None:
        assert state.model_dump() == before, "fold mutated its input state"
    assert fold(state, event) == result, "fold is not deterministic"
    if result.outcome == "applied":
        new = result.state
        assert new is not None and result.error is None
        assert new.version == (state.version + 1 if state is not None else 1)
        assert new.cause_event_id == event.event_id and new.cause_time == event.time
        if not isinstance(payload, SpanSequenceRequested):
            assert new.reserved_sequence_id is None
        terminal = new.rollout.status in TERMINAL_STATUSES
        assert (new.finished_time is not None) == terminal
        assert (new.rollout.end_time is not None) == terminal
        assert [a.sequence_id for a in new.attempts] == list(range(1, len(new.attempts) + 1))
    elif result.outcome == "rejected":
        assert result.state is None and result.error
    else:
        assert result.state is None and result.error is None
    return result


def applied(state: RolloutState | None, payload: RolloutEventPayload, time: float = T0 + 100) -> RolloutState:
    result = run(state, payload, time)
    assert result.outcome == "applied", result.error
    assert result.state is not None
    return result.state


def rejected(state: RolloutState | None, payload: RolloutEventPayload, time: float = T0 + 100) -> str:
    result = run(state, payload, time)
    assert result.outcome == "rejected", result
    assert result.error is not None
    return result.error


# --------------------------------------------------------------------------------------------
# The rollout transition table: event kind x rollout status
# --------------------------------------------------------------------------------------------

# A realistic attempt list for each rollout status (the latest attempt is the last one).
ATTEMPTS_FOR: dict[RolloutStatus, tuple[AttemptStatus, ...]] = {
    "queuing": (),
    "requeuing": ("failed",),
    "preparing": ("preparing",),
    "running": ("failed", "running"),
    "succeeded": ("succeeded",),
    "failed": ("failed",),
    "cancelled": ("running",),
}

# Rollout status after each event, "-" = rejected. The heartbeat and the attempt events target
# the latest attempt; AttemptUpdated sets "succeeded".
TRANSITIONS: dict[str, dict[RolloutStatus, str]] = {
    "enqueue": {s: "-" for s in ROLLOUT_STATUSES},
    "claim": {
        "queuing": "preparing",
        "requeuing": "preparing",
        "preparing": "-",
        "running": "-",
        "succeeded": "-",
        "failed": "-",
        "cancelled": "-",
    },
    "manual": {s: "preparing" for s in ROLLOUT_STATUSES},
    "heartbeat": {
        "queuing": "-",  # no attempt to beat for
        "requeuing": "requeuing",  # the latest attempt failed: a late heartbeat only records time
        "preparing": "running",
        "running": "running",
        "succeeded": "succeeded",
        "failed": "failed",
        "cancelled": "cancelled",
    },
    "attempt_succeeded": {
        "queuing": "-",  # no attempt
        "requeuing": "succeeded",  # failed -> succeeded is allowed, and the rollout follows
        "preparing": "succeeded",
        "running": "succeeded",
        "succeeded": "succeeded",
        "failed": "failed",  # never propagated onto a terminal rollout
        "cancelled": "cancelled",
    },
    "cancel": {
        "queuing": "cancelled",
        "requeuing": "cancelled",
        "preparing": "cancelled",
        "running": "cancelled",
        "succeeded": "-",
        "failed": "-",
        "cancelled": "-",
    },
    "reserve": {s: ("-" if not ATTEMPTS_FOR[s] else s) for s in ROLLOUT_STATUSES},
    "metadata": {s: s for s in ROLLOUT_STATUSES},
}


def payload_for(kind: str, state: RolloutState) -> RolloutEventPayload:
    latest = state.attempts[-1].attempt_id if state.attempts else aid(1)
    new = len(state.attempts) + 1
    payloads: dict[str, RolloutEventPayload] = {
        "enqueue": RolloutEnqueued(rollout=make_rollout().model_copy(update={"input": {"q": 2}})),  # a copy is answered
        "claim": claim(new),
        "manual": claim(new, manual=True),
        "heartbeat": AttemptHeartbeat(attempt_id=latest, worker_id="w-1"),
        "attempt_succeeded": AttemptUpdated.of(latest, status="succeeded"),
        "cancel": RolloutCancelled(reason="stop"),
        "reserve": SpanSequenceRequested(attempt_id=latest, count=3),
        "metadata": RolloutUpdated.of(metadata={"k": "v"}),
    }
    return payloads[kind]


@pytest.mark.parametrize("status", ROLLOUT_STATUSES)
@pytest.mark.parametrize("kind", list(TRANSITIONS))
def test_rollout_transition_table(kind: str, status: RolloutStatus) -> None:
    state = make_state(status, ATTEMPTS_FOR[status])
    expected = TRANSITIONS[kind][status]
    result = run(state, payload_for(kind, state))
    if expected == "-":
        assert result.outcome == "rejected"
    else:
        assert result.outcome == "applied", result.error
        assert result.state is not None
        assert result.state.rollout.status == expected


@pytest.mark.parametrize("kind", [k for k in TRANSITIONS if k != "enqueue"])
def test_every_event_on_an_unknown_rollout_is_rejected(kind: str) -> None:
    payload = payload_for(kind, make_state("running", ("running",)))
    error = rejected(None, payload)
    assert error == f"unknown rollout id {RID}"


@pytest.mark.parametrize("kind", list(TRANSITIONS))
def test_events_keyed_by_another_rollout_are_rejected(kind: str) -> None:
    state = make_state("running", ("running",))
    result = fold(state, make_event(payload_for(kind, state), rollout_id=OTHER_RID))
    assert result.outcome == "rejected"
    assert result.error is not None and OTHER_RID in result.error


def test_watchdog_on_unknown_rollout_is_rejected() -> None:
    assert rejected(None, WatchdogFired(attempt_id=aid(1), status="timeout")).startswith("unknown rollout id")


# --------------------------------------------------------------------------------------------
# RolloutEnqueued
# --------------------------------------------------------------------------------------------


def test_enqueue_queues_the_rollout() -> None:
    event = make_event(RolloutEnqueued(rollout=make_rollout(metadata={"a": 1})), time=T0 + 3)
    assert may_queue(event.payload)
    result = fold(None, event)
    assert result.outcome == "applied" and result.state is not None
    state = result.state
    assert state.rollout.status == "queuing" and state.attempts == [] and state.version == 1
    assert state.rollout.start_time == T0 and state.rollout.end_time is None
    assert state.finished_time is None and state.next_sequence_ids == {}
    assert state.cause_event_id == event.event_id and state.rollout.metadata == {"a": 1}


def test_start_rollout_creates_the_first_attempt_and_skips_the_queue() -> None:
    given_attempt = Attempt(
        rollout_id=RID, attempt_id=aid(9), sequence_id=5, start_time=1.0, status="running", worker_id="w-9"
    )
    result = run(None, RolloutEnqueued(rollout=make_rollout(), attempt=given_attempt), time=T0 + 3)
    assert result.outcome == "applied" and result.state is not None
    state = result.state
    assert state.rollout.status == "preparing"
    (attempt,) = state.attempts
    assert attempt.attempt_id == aid(9) and attempt.sequence_id == 1 and attempt.status == "preparing"
    assert attempt.start_time == T0 + 3 and attempt.worker_id == "w-9" and attempt.end_time is None


def test_a_copy_of_an_enqueue_is_answered_and_another_rollout_under_its_id_refused() -> None:
    state = applied(None, RolloutEnqueued(rollout=make_rollout()))
    assert run(state, RolloutEnqueued(rollout=make_rollout()), T0 + 100).outcome == "ignored"  # a re-send
    other = make_rollout().model_copy(update={"input": {"q": 2}})
    assert rejected(state, RolloutEnqueued(rollout=other)) == f"rollout {RID} already exists (with another input)"


@pytest.mark.parametrize("status", [s for s in ROLLOUT_STATUSES if s != "queuing"])
def test_a_new_rollout_must_be_queuing(status: RolloutStatus) -> None:
    assert "must be queuing" in rejected(None, RolloutEnqueued(rollout=make_rollout(status)))


def test_enqueue_keyed_by_another_rollout_is_rejected() -> None:
    result = fold(None, make_event(RolloutEnqueued(rollout=make_rollout()), rollout_id=OTHER_RID))
    assert result.outcome == "rejected"


def test_start_rollout_with_an_attempt_of_another_rollout_is_rejected() -> None:
    attempt = Attempt(rollout_id=OTHER_RID, attempt_id=aid(1), sequence_id=1, start_time=T0)
    assert "belongs to rollout" in rejected(None, RolloutEnqueued(rollout=make_rollout(), attempt=attempt))


def test_enqueue_clears_a_stray_end_time() -> None:
    state = applied(None, RolloutEnqueued(rollout=make_rollout(end_time=T0 + 1)))
    assert state.rollout.end_time is None


# --------------------------------------------------------------------------------------------
# AttemptStarted
# --------------------------------------------------------------------------------------------


def test_claim_creates_the_next_attempt() -> None:
    state = make_state("requeuing", ("failed",))
    new = applied(state, claim(2, worker="w-2", sequence_id=99), time=T0 + 123)
    assert new.rollout.status == "preparing"
    assert new.attempts[0] == state.attempts[0]
    attempt = new.attempts[1]
    assert attempt.attempt_id == aid(2) and attempt.sequence_id == 2
    assert attempt.status == "preparing" and attempt.start_time == T0 + 123 and attempt.worker_id == "w-2"


def test_claim_takes_the_attempts_worker_when_the_event_names_none() -> None:
    attempt = Attempt(rollout_id=RID, attempt_id=aid(1), sequence_id=1, start_time=T0, worker_id="w-a")
    new = applied(make_state("queuing"), AttemptStarted(attempt=attempt))
    assert new.attempts[0].worker_id == "w-a"


def test_two_claims_of_one_queued_rollout_second_rejected() -> None:
    state = applied(None, RolloutEnqueued(rollout=make_rollout()))
    state = applied(state, claim(1, worker="w-1"))
    error = rejected(state, claim(2, worker="w-2"))
    assert error == f"rollout {RID} is preparing, not queued: another worker claimed it"


@pytest.mark.parametrize("status", sorted(TERMINAL_STATUSES))
def test_claim_of_a_finished_rollout_says_so(status: RolloutStatus) -> None:
    error = rejected(make_state(status, ("succeeded",)), claim(2))
    assert error == f"rollout {RID} is {status}, not queued: it has already finished"


def test_duplicate_attempt_id_is_rejected() -> None:
    state = make_state("running", ("running",))
    assert rejected(state, claim(1, manual=True)) == f"attempt {aid(1)} already exists in rollout {RID}"


def test_attempt_of_another_rollout_is_rejected() -> None:
    attempt = Attempt(rollout_id=OTHER_RID, attempt_id=aid(2), sequence_id=1, start_time=T0)
    assert "belongs to rollout" in rejected(make_state("queuing"), AttemptStarted(attempt=attempt))


def test_manual_start_attempt_on_a_succeeded_rollout_reopens_it() -> None:
    state = make_state("succeeded", ("succeeded",))
    assert state.rollout.end_time is not None and state.finished_time is not None
    result = run(state, claim(2, manual=True), time=T0 + 200)
    assert result.outcome == "applied" and result.state is not None
    new = result.state
    assert new.rollout.status == "preparing" and new.rollout.end_time is None and new.finished_time is None
    assert [a.status for a in new.attempts] == ["succeeded", "preparing"]
    assert latest_attempt(new) == new.attempts[1]
    # The new attempt runs and succeeds again.
    new = applied(new, AttemptHeartbeat(attempt_id=aid(2)), time=T0 + 201)
    new = applied(new, AttemptUpdated.of("latest", status="succeeded"), time=T0 + 202)
    assert new.rollout.status == "succeeded" and new.rollout.end_time == T0 + 202 and new.finished_time == T0 + 202


def test_manual_start_while_an_attempt_runs_keeps_the_old_attempt() -> None:
    state = make_state("running", ("running",))
    new = applied(state, claim(2, manual=True))
    assert [a.status for a in new.attempts] == ["running", "preparing"]
    # The old attempt no longer drives the rollout.
    newer = applied(new, AttemptUpdated.of(aid(1), status="failed"))
    assert newer.rollout.status == "preparing"


def test_manual_start_on_a_queued_rollout_makes_its_task_stale() -> None:
    state = applied(None, RolloutEnqueued(rollout=make_rollout()))
    state = applied(state, claim(1, manual=True))
    assert "another worker claimed it" in rejected(state, claim(2))


# --------------------------------------------------------------------------------------------
# AttemptHeartbeat
# --------------------------------------------------------------------------------------------

# attempt status before -> (attempt after, rollout after) for the latest attempt of a running /
# preparing / requeuing rollout.
HEARTBEAT_LATEST: dict[tuple[AttemptStatus, RolloutStatus], tuple[AttemptStatus, RolloutStatus]] = {
    ("preparing", "preparing"): ("running", "running"),
    ("running", "running"): ("running", "running"),
    ("running", "preparing"): ("running", "running"),
    ("running", "queuing"): ("running", "queuing"),
    ("unresponsive", "requeuing"): ("running", "running"),  # revived
    ("unresponsive", "failed"): ("unresponsive", "failed"),  # terminal rollout: only the time
    ("unresponsive", "cancelled"): ("unresponsive", "cancelled"),
    ("preparing", "cancelled"): ("running", "cancelled"),
    ("succeeded", "succeeded"): ("succeeded", "succeeded"),
    ("failed", "requeuing"): ("failed", "requeuing"),
    ("failed", "failed"): ("failed", "failed"),
    ("timeout", "requeuing"): ("timeout", "requeuing"),
    ("timeout", "failed"): ("timeout", "failed"),
}


@pytest.mark.parametrize(("before", "after"), list(HEARTBEAT_LATEST.items()))
def test_heartbeat_of_the_latest_attempt(
    before: tuple[AttemptStatus, RolloutStatus], after: tuple[AttemptStatus, RolloutStatus]
) -> None:
    attempt_status, rollout_status = before
    state = make_state(rollout_status, (attempt_status,))
    new = applied(state, AttemptHeartbeat(attempt_id=aid(1), worker_id="w-7"), time=T0 + 300)
    attempt = new.attempts[0]
    assert (attempt.status, new.rollout.status) == after
    assert attempt.last_heartbeat_time == T0 + 300 and attempt.worker_id == "w-7"
    assert (attempt.end_time is None) == (attempt.status in LIVE)


@pytest.mark.parametrize("status", ATTEMPT_STATUSES)
def test_heartbeat_of_an_older_attempt_does_not_touch_the_rollout(status: AttemptStatus) -> None:
    state = make_state("requeuing", (status, "unresponsive"))
    new = applied(state, AttemptHeartbeat(attempt_id=aid(1)))
    assert new.rollout.status == "requeuing"
    expected = "running" if status in LIVE else status
    assert new.attempts[0].status == expected
    assert new.attempts[1] == state.attempts[1]


def test_heartbeat_keeps_worker_when_none_given() -> None:
    state = make_state("running", ())
    state = state.model_copy(update={"attempts": [make_attempt(1, "running", worker_id="w-1")]})
    new = applied(state, AttemptHeartbeat(attempt_id=aid(1)))
    assert new.attempts[0].worker_id == "w-1"


def test_heartbeat_of_unknown_attempt_is_rejected() -> None:
    error = rejected(make_state("running", ("running",)), AttemptHeartbeat(attempt_id=aid(5)))
    assert error == f"unknown attempt id {aid(5)} in rollout {RID}"


def test_revived_rollout_makes_its_retry_task_stale() -> None:
    config = RolloutConfig(unresponsive_seconds=10, max_attempts=2, retry_condition=["unresponsive"])
    state = applied(None, RolloutEnqueued(rollout=make_rollout(config=config)), time=T0)
    state = applied(state, claim(1), time=T0 + 1)
    result = run(state, WatchdogFired(attempt_id=aid(1), status="unresponsive"), time=T0 + 20)
    assert result.outcome == "applied" and result.state is not None
    assert result.state.rollout.status == "requeuing"
    state = applied(result.state, AttemptHeartbeat(attempt_id=aid(1)), time=T0 + 21)
    assert state.rollout.status == "running" and state.attempts[0].status == "running"
    assert state.attempts[0].end_time is None
    assert "another worker claimed it" in rejected(state, claim(2), time=T0 + 22)


# --------------------------------------------------------------------------------------------
# Span sequence ids
# --------------------------------------------------------------------------------------------


def test_sequence_reservations_are_strictly_increasing() -> None:
    state = make_state("running", ("running", "running"))
    seen = []
    for count in (1, 1, 5, 2):
        result = run(state, SpanSequenceRequested(attempt_id=aid(1), count=count))
        assert result.state is not None
        state = result.state
        assert state.reserved_sequence_id is not None
        seen.append(state.reserved_sequence_id)
    assert seen == [1, 2, 3, 8]
    assert state.next_sequence_ids == {aid(1): 10}
    # Another attempt has its own counter.
    state = applied(state, SpanSequenceRequested(attempt_id=aid(2)))
    assert state.reserved_sequence_id == 1
    # Any other applied event clears the reservation.
    state = applied(state, RolloutUpdated.of(metadata={}))
    assert state.reserved_sequence_id is None


def test_reservations_move_past_heartbeat_max_sequence_id() -> None:
    state = make_state("running", ("running",))
    state = applied(state, SpanSequenceRequested(attempt_id=aid(1), count=2))
    assert state.reserved_sequence_id == 1
    state = applied(state, AttemptHeartbeat(attempt_id=aid(1), span_count=50, max_sequence_id=41))
    assert state.next_sequence_ids[aid(1)] == 42
    state = applied(state, SpanSequenceRequested(attempt_id=aid(1)))
    assert state.reserved_sequence_id == 42
    # An older max_sequence_id never moves the counter back.
    state = applied(state, AttemptHeartbeat(attempt_id=aid(1), max_sequence_id=7))
    assert state.next_sequence_ids[aid(1)] == 43
    state = applied(state, AttemptHeartbeat(attempt_id=aid(1)))
    assert state.next_sequence_ids[aid(1)] == 43


def test_heartbeats_add_up_span_counts_per_attempt_and_other_events_keep_them() -> None:
    state = make_state("running", ("failed", "running"))
    state = applied(state, AttemptHeartbeat(attempt_id=aid(2), span_count=3, max_sequence_id=3))
    state = applied(state, AttemptHeartbeat(attempt_id=aid(1), span_count=2))
    state = applied(state, AttemptHeartbeat(attempt_id=aid(2), span_count=4))
    state = applied(state, AttemptHeartbeat(attempt_id=aid(2)))  # a liveness beat reports no spans
    assert state.span_counts == {aid(2): 7, aid(1): 2}
    state = applied(state, SpanSequenceRequested(attempt_id=aid(2), count=5))
    state = applied(state, AttemptUpdated.of(aid(2), status="succeeded"))
    assert state.span_counts == {aid(2): 7, aid(1): 2}


def test_a_reservation_with_a_span_count_is_also_the_heartbeat_of_those_spans() -> None:
    state = make_state("preparing", ("preparing",))
    before = state.version
    payload = SpanSequenceRequested(attempt_id=aid(1), count=3, span_count=5, max_sequence_id=40)
    result = run(state, payload, time=T0 + 7)
    assert result.outcome == "applied" and result.state is not None
    state = result.state
    assert state.version == before + 1  # one event, one new state
    assert state.reserved_sequence_id == 1  # ids 1-3 for the spans without their own
    assert state.next_sequence_ids[aid(1)] == 41  # past the highest id a span brought itself
    assert state.span_counts == {aid(1): 5}
    [attempt] = state.attempts
    assert (attempt.status, attempt.last_heartbeat_time, state.rollout.status) == ("running", T0 + 7, "running")
    # The same as a reservation followed by the heartbeat, bar the version and the reservation.
    reserved = applied(make_state("preparing", ("preparing",)), SpanSequenceRequested(attempt_id=aid(1), count=3))
    beat = run(reserved, AttemptHeartbeat(attempt_id=aid(1), span_count=5, max_sequence_id=40), time=T0 + 7).state
    assert beat is not None
    assert (beat.attempts, beat.rollout, beat.span_counts, beat.next_sequence_ids) == (
        state.attempts,
        state.rollout,
        state.span_counts,
        state.next_sequence_ids,
    )
    # A plain reservation is no heartbeat.
    plain = applied(make_state("preparing", ("preparing",)), SpanSequenceRequested(attempt_id=aid(1), count=3))
    assert plain.attempts[0].status == "preparing" and plain.span_counts == {}


def test_heartbeat_max_sequence_id_zero_or_first() -> None:
    state = make_state("running", ("running",))
    state = applied(state, AttemptHeartbeat(attempt_id=aid(1), max_sequence_id=0))
    assert state.next_sequence_ids[aid(1)] == 1


def test_sequence_request_for_unknown_attempt_is_rejected() -> None:
    assert "unknown attempt id" in rejected(make_state("running", ("running",)), SpanSequenceRequested(attempt_id="x"))


@pytest.mark.parametrize("status", ATTEMPT_STATUSES)
def test_sequence_ids_are_served_for_every_attempt_status(status: AttemptStatus) -> None:
    state = applied(make_state("running", (status,)), SpanSequenceRequested(attempt_id=aid(1)))
    assert state.reserved_sequence_id == 1


# --------------------------------------------------------------------------------------------
# AttemptUpdated: the attempt transition table and propagation
# --------------------------------------------------------------------------------------------


def _legal(before: AttemptStatus, after: AttemptStatus) -> bool:
    if before in FINISHED and after in LIVE:
        return before == "unresponsive" and after == "running"
    return True


@pytest.mark.parametrize("after", ATTEMPT_STATUSES)
@pytest.mark.parametrize("before", ATTEMPT_STATUSES)
def test_attempt_transition_table(before: AttemptStatus, after: AttemptStatus) -> None:
    # An older attempt: no propagation, so only the attempt's own rules show.
    state = make_state("running", (before, "running"))
    result = run(state, AttemptUpdated.of(aid(1), status=after), time=T0 + 400)
    if not _legal(before, after):
        assert result.outcome == "rejected"
        assert result.error == f"illegal transition {before} -> {after} for attempt {aid(1)}"
        return
    assert result.outcome == "applied" and result.state is not None
    attempt = result.state.attempts[0]
    assert attempt.status == after
    assert result.state.rollout.status == "running"
    if after == before:
        assert attempt.end_time == state.attempts[0].end_time
    elif after in FINISHED:
        assert attempt.end_time == T0 + 400
    else:
        assert attempt.end_time is None


def test_explicit_end_time_wins() -> None:
    state = make_state("running", ("running",))
    new = applied(state, AttemptUpdated.of(aid(1), status="failed", end_time=T0 + 1.5))
    assert new.attempts[0].end_time == T0 + 1.5


# (rollout before, attempt becomes) -> rollout after; the latest attempt was "preparing" when it
# becomes running, else "running". config: max_attempts=2, retry_condition=[failed], 1 attempt.
PROPAGATION: dict[tuple[RolloutStatus, AttemptStatus], RolloutStatus] = {
    ("queuing", "preparing"): "preparing",
    ("queuing", "running"): "running",
    ("queuing", "succeeded"): "succeeded",
    ("queuing", "failed"): "queuing",
    ("queuing", "timeout"): "queuing",
    ("queuing", "unresponsive"): "queuing",
    ("requeuing", "preparing"): "preparing",
    ("requeuing", "running"): "running",
    ("requeuing", "succeeded"): "succeeded",
    ("requeuing", "failed"): "requeuing",
    ("requeuing", "timeout"): "requeuing",
    ("requeuing", "unresponsive"): "requeuing",
    ("preparing", "preparing"): "preparing",
    ("preparing", "running"): "running",
    ("preparing", "succeeded"): "succeeded",
    ("preparing", "failed"): "requeuing",
    ("preparing", "timeout"): "failed",
    ("preparing", "unresponsive"): "failed",
    ("running", "preparing"): "running",
    ("running", "running"): "running",
    ("running", "succeeded"): "succeeded",
    ("running", "failed"): "requeuing",
    ("running", "timeout"): "failed",
    ("running", "unresponsive"): "failed",
    **{(r, a): r for r in ("succeeded", "failed", "cancelled") for a in ATTEMPT_STATUSES},
}


@pytest.mark.parametrize(("before", "expected"), list(PROPAGATION.items()))
def test_propagation_table(before: tuple[RolloutStatus, AttemptStatus], expected: RolloutStatus) -> None:
    rollout_status, attempt_becomes = before
    attempt_was: AttemptStatus = "preparing" if attempt_becomes == "running" else "running"
    config = RolloutConfig(max_attempts=2, retry_condition=["failed"])
    state = make_state(rollout_status, (attempt_was,), config)
    result = run(state, AttemptUpdated.of("latest", status=attempt_becomes), time=T0 + 500)
    assert result.outcome == "applied" and result.state is not None
    assert result.state.rollout.status == expected
    assert result.state.attempts[0].status == attempt_becomes
    if expected == "requeuing" and rollout_status != "requeuing":
        assert len(result.state.attempts) == 1  # back in the queue for its second attempt
    if expected in TERMINAL_STATUSES and rollout_status not in TERMINAL_STATUSES:
        assert result.state.rollout.end_time == T0 + 500 and result.state.finished_time == T0 + 500
    if rollout_status in TERMINAL_STATUSES:
        assert result.state.rollout == state.rollout and result.state.finished_time == state.finished_time


def test_repeating_a_status_does_not_propagate_twice() -> None:
    config = RolloutConfig(max_attempts=3, retry_condition=["failed"])
    state = make_state("running", ("running",), config)
    result = run(state, AttemptUpdated.of("latest", status="failed"))
    assert result.state is not None and result.state.rollout.status == "requeuing"
    again = run(result.state, AttemptUpdated.of("latest", status="failed"))
    assert again.outcome == "applied" and again.state is not None
    assert again.state.rollout.status == "requeuing" and again.state.attempts == result.state.attempts


def test_latest_is_the_highest_sequence_id() -> None:
    state = make_state("running", ("failed", "failed", "running"))
    new = applied(state, AttemptUpdated.of("latest", status="succeeded", metadata={"m": 1}))
    assert [a.status for a in new.attempts] == ["failed", "failed", "succeeded"]
    assert new.attempts[2].metadata == {"m": 1}
    assert new.rollout.status == "succeeded"


def test_latest_without_attempts_is_rejected() -> None:
    error = rejected(make_state("queuing"), AttemptUpdated.of("latest", status="running"))
    assert error == f"rollout {RID} has no attempts, so it has no latest attempt"


def test_attempt_update_of_unknown_attempt_is_rejected() -> None:
    error = rejected(make_state("running", ("running",)), AttemptUpdated.of(aid(3), status="failed"))
    assert error == f"unknown attempt id {aid(3)} in rollout {RID}"


def test_attempt_update_without_status_sets_only_the_given_fields() -> None:
    state = make_state("running", ())
    state = state.model_copy(update={"attempts": [make_attempt(1, "running", worker_id="w-1", metadata={"x": 1})]})
    new = applied(state, AttemptUpdated.of(aid(1), last_heartbeat_time=T0 + 9, metadata=None))
    attempt = new.attempts[0]
    assert attempt.last_heartbeat_time == T0 + 9 and attempt.metadata is None
    assert attempt.worker_id == "w-1" and attempt.status == "running"
    assert new.rollout == state.rollout


def test_unresponsive_attempt_revived_by_update() -> None:
    state = make_state("requeuing", ("unresponsive",))
    new = applied(state, AttemptUpdated.of(aid(1), status="running"))
    assert new.attempts[0].status == "running" and new.attempts[0].end_time is None
    assert new.rollout.status == "running"


# --------------------------------------------------------------------------------------------
# RolloutUpdated
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("after", ROLLOUT_STATUSES)
@pytest.mark.parametrize("before", ROLLOUT_STATUSES)
@pytest.mark.parametrize("with_attempt", [True, False])
def test_rollout_status_table(before: RolloutStatus, after: RolloutStatus, with_attempt: bool) -> None:
    attempts: tuple[AttemptStatus, ...] = ("running",) if with_attempt else ()
    state = make_state(before, attempts)
    result = run(state, RolloutUpdated.of(status=after), time=T0 + 600)
    if after in ("preparing", "running") and not with_attempt:
        assert result.outcome == "rejected"
        assert (
            result.error
            == f"rollout {RID} has no attempt, so it cannot be {after}: claim it or start an attempt instead"
        )
        return
    assert result.outcome == "applied" and result.state is not None
    new = result.state
    assert new.rollout.status == after
    assert new.attempts == state.attempts  # attempts are never touched
    if after in TERMINAL_STATUSES:
        expected_end = state.rollout.end_time if after == before else T0 + 600
        assert new.rollout.end_time == expected_end and new.finished_time == expected_end
    else:
        assert new.rollout.end_time is None and new.finished_time is None


def test_requeue_by_update_is_enqueued_exactly_once() -> None:
    state = make_state("failed", ("failed",))
    result = run(state, RolloutUpdated.of(status="requeuing"))
    assert result.state is not None
    assert result.state.rollout.status == "requeuing" and len(result.state.attempts) == 1
    for status in ("requeuing", "queuing", "requeuing"):
        again = run(result.state, RolloutUpdated.of(status=status))
        assert again.outcome == "applied" and again.state is not None
        assert again.state.attempts == result.state.attempts and again.state.rollout.status == status
        result = again


def test_unset_semantics() -> None:
    config = RolloutConfig(timeout_seconds=5)
    state = make_state(
        "running",
        ("running",),
        config,
    )
    state = state.model_copy(
        update={
            "rollout": state.rollout.model_copy(update={"metadata": {"a": 1}, "mode": "train", "resources_id": "rs-1"})
        }
    )
    new = applied(state, RolloutUpdated.of(metadata=None))
    assert new.rollout.metadata is None
    assert new.rollout.model_dump(exclude={"metadata"}) == state.rollout.model_dump(exclude={"metadata"})
    new = applied(new, RolloutUpdated.of(mode=None, input=None))
    assert new.rollout.mode is None and new.rollout.input is None
    assert new.rollout.resources_id == "rs-1" and new.rollout.config == config and new.rollout.status == "running"
    new = applied(new, RolloutUpdated.of())
    assert new.rollout == applied(new, RolloutUpdated.of()).rollout
    new = applied(new, RolloutUpdated.of(config=RolloutConfig(max_attempts=4), resources_id="rs-2"))
    assert new.rollout.config.max_attempts == 4 and new.rollout.resources_id == "rs-2"
    assert new.rollout.mode is None and new.rollout.metadata is None


# --------------------------------------------------------------------------------------------
# RolloutCancelled
# --------------------------------------------------------------------------------------------


def test_cancel_leaves_a_live_attempt_alone() -> None:
    state = make_state("running", ("running",))
    new = applied(state, RolloutCancelled(reason="user"), time=T0 + 700)
    assert new.rollout.status == "cancelled" and new.rollout.end_time == T0 + 700 and new.finished_time == T0 + 700
    assert new.attempts == state.attempts
    # The runner's final word does not un-cancel the rollout.
    newer = applied(new, AttemptUpdated.of("latest", status="succeeded"))
    assert newer.rollout.status == "cancelled" and newer.attempts[0].status == "succeeded"
    assert newer.finished_time == T0 + 700


@pytest.mark.parametrize("status", sorted(TERMINAL_STATUSES))
def test_cancel_of_a_finished_rollout_is_rejected(status: RolloutStatus) -> None:
    assert rejected(make_state(status, ("succeeded",)), RolloutCancelled()) == f"rollout {RID} already {status}"


def test_a_cancelled_rollouts_pending_task_is_stale() -> None:
    state = applied(None, RolloutEnqueued(rollout=make_rollout()))
    state = applied(state, RolloutCancelled())
    assert "it has already finished" in rejected(state, claim(1))


# --------------------------------------------------------------------------------------------
# Retries end to end
# --------------------------------------------------------------------------------------------


def test_retry_path_until_max_attempts() -> None:
    config = RolloutConfig(max_attempts=3, retry_condition=["failed"])
    t = T0
    result = run(None, RolloutEnqueued(rollout=make_rollout(config=config)), time=t)
    assert result.state is not None
    assert result.state.rollout.status == "queuing" and result.state.attempts == []
    state = result.state
    for n in (1, 2, 3):
        t += 10
        state = applied(state, claim(n, worker=f"w-{n}"), time=t)
        assert state.rollout.status == "preparing" and state.attempts[-1].sequence_id == n
        state = applied(state, AttemptHeartbeat(attempt_id=aid(n)), time=t + 1)
        assert state.rollout.status == "running"
        result = run(state, AttemptUpdated.of(aid(n), status="failed"), time=t + 2)
        assert result.state is not None
        state = result.state
        if n < 3:
            assert state.rollout.status == "requeuing" and state.finished_time is None
            assert len(state.attempts) == n  # its next claim starts attempt n + 1
    assert state.rollout.status == "failed" and state.rollout.end_time == t + 2 and state.finished_time == t + 2
    assert [(a.sequence_id, a.status, a.worker_id) for a in state.attempts] == [
        (1, "failed", "w-1"),
        (2, "failed", "w-2"),
        (3, "failed", "w-3"),
    ]
    assert state.version == 1 + 3 * 3
    assert "it has already finished" in rejected(state, claim(4))


def test_status_not_in_retry_condition_fails_at_once() -> None:
    config = RolloutConfig(max_attempts=3, retry_condition=["failed"])
    state = applied(None, RolloutEnqueued(rollout=make_rollout(config=config)))
    state = applied(state, claim(1))
    result = run(state, AttemptUpdated.of(aid(1), status="timeout"))
    assert result.state is not None and result.state.rollout.status == "failed"


def test_watchdog_timeout_retries_when_configured() -> None:
    config = RolloutConfig(timeout_seconds=30, max_attempts=2, retry_condition=["timeout"])
    state = applied(None, RolloutEnqueued(rollout=make_rollout(config=config)), time=T0)
    state = applied(state, claim(1), time=T0)
    result = run(state, WatchdogFired(attempt_id=aid(1), status="timeout"), time=T0 + 31)
    assert result.state is not None
    assert result.state.rollout.status == "requeuing" and result.state.attempts[0].status == "timeout"
    assert result.state.attempts[0].end_time == T0 + 31
    assert result.state is not None and len(result.state.attempts) == 1  # queued again for attempt 2


# --------------------------------------------------------------------------------------------
# WatchdogFired
# --------------------------------------------------------------------------------------------

WATCHED = RolloutConfig(timeout_seconds=100, unresponsive_seconds=10)


def watched_state(attempt_status: AttemptStatus = "running", heartbeat: float | None = None) -> RolloutState:
    state = make_state("running", (), WATCHED)
    attempt = make_attempt(1, attempt_status, start_time=T0, last_heartbeat_time=heartbeat)
    return state.model_copy(update={"attempts": [attempt]})


def test_watchdog_verdict_applies_when_due() -> None:
    state = watched_state(heartbeat=T0 + 5)
    verdict = WatchdogFired(attempt_id=aid(1), status="unresponsive", observed_heartbeat_time=T0 + 5)
    new = applied(state, verdict, time=T0 + 16)
    assert new.attempts[0].status == "unresponsive" and new.attempts[0].end_time == T0 + 16
    assert new.rollout.status == "failed"


def test_watchdog_verdict_after_a_newer_heartbeat_is_ignored() -> None:
    state = watched_state(heartbeat=T0 + 5)
    state = applied(state, AttemptHeartbeat(attempt_id=aid(1)), time=T0 + 14)
    verdict = WatchdogFired(attempt_id=aid(1), status="unresponsive", observed_heartbeat_time=T0 + 5)
    assert run(state, verdict, time=T0 + 16).outcome == "ignored"


def test_the_same_verdict_twice_second_ignored() -> None:
    state = watched_state()
    verdict = WatchdogFired(attempt_id=aid(1), status="timeout")
    state = applied(state, verdict, time=T0 + 101)
    assert state.attempts[0].status == "timeout"
    assert run(state, verdict, time=T0 + 102).outcome == "ignored"
    assert run(state, WatchdogFired(attempt_id=aid(1), status="unresponsive"), time=T0 + 102).outcome == "ignored"


def test_verdict_not_yet_due_is_ignored() -> None:
    state = watched_state()
    assert run(state, WatchdogFired(attempt_id=aid(1), status="unresponsive"), time=T0 + 10).outcome == "ignored"
    assert run(state, WatchdogFired(attempt_id=aid(1), status="timeout"), time=T0 + 50).outcome == "ignored"


def test_verdict_superseded_by_timeout_is_ignored() -> None:
    """Past the time budget the due verdict is timeout: a stale unresponsive verdict yields."""
    state = watched_state()
    assert run(state, WatchdogFired(attempt_id=aid(1), status="unresponsive"), time=T0 + 101).outcome == "ignored"


def test_verdict_for_config_without_limits_is_ignored() -> None:
    state = make_state("running", ("running",))
    assert run(state, WatchdogFired(attempt_id=aid(1), status="timeout"), time=T0 + 1e6).outcome == "ignored"


@pytest.mark.parametrize("status", sorted(FINISHED))
def test_verdict_on_finished_attempt_is_ignored(status: AttemptStatus) -> None:
    result = run(watched_state(status), WatchdogFired(attempt_id=aid(1), status="timeout"), time=T0 + 200)
    assert result.outcome == "ignored"


def test_verdict_on_unknown_attempt_is_ignored() -> None:
    result = run(watched_state(), WatchdogFired(attempt_id=aid(9), status="timeout"), time=T0 + 200)
    assert result.outcome == "ignored"


@pytest.mark.parametrize("status", ["preparing", "running", "succeeded", "failed"])
def test_verdict_with_a_non_watchdog_status_is_rejected(status: AttemptStatus) -> None:
    error = rejected(watched_state(), WatchdogFired(attempt_id=aid(1), status=status), time=T0 + 200)
    assert error == f"a watchdog verdict must be timeout or unresponsive, not {status}"


def test_verdict_on_an_older_attempt_does_not_propagate() -> None:
    state = make_state("running", (), WATCHED)
    attempts = [make_attempt(1, "running", start_time=T0), make_attempt(2, "running", start_time=T0 + 95)]
    state = state.model_copy(update={"attempts": attempts})
    new = applied(state, WatchdogFired(attempt_id=aid(1), status="timeout"), time=T0 + 101)
    assert [a.status for a in new.attempts] == ["timeout", "running"] and new.rollout.status == "running"


def test_verdict_on_a_cancelled_rollout_closes_the_attempt_only() -> None:
    state = applied(watched_state(), RolloutCancelled(), time=T0 + 1)
    new = applied(state, WatchdogFired(attempt_id=aid(1), status="timeout"), time=T0 + 101)
    assert new.attempts[0].status == "timeout" and new.rollout.status == "cancelled"
    assert new.finished_time == T0 + 1


# --------------------------------------------------------------------------------------------
# Property tests: random event streams
# --------------------------------------------------------------------------------------------

ATTEMPT_IDS = [aid(n) for n in range(1, 5)]
attempt_ids = st.sampled_from([*ATTEMPT_IDS, "at-ffffffff"])
configs = st.builds(
    RolloutConfig,
    timeout_seconds=st.none() | st.sampled_from([5.0, 30.0]),
    unresponsive_seconds=st.none() | st.sampled_from([3.0, 10.0]),
    max_attempts=st.integers(1, 4),
    retry_condition=st.lists(st.sampled_from(["failed", "timeout", "unresponsive"]), unique=True),
)


def _claim_payload(n: int, manual: bool, worker: str | None) -> AttemptStarted:
    return claim(n, worker=worker, manual=manual)


payloads: st.SearchStrategy[RolloutEventPayload] = st.one_of(
    st.builds(_claim_payload, st.integers(1, 4), st.booleans(), st.sampled_from([None, "w-1", "w-2"])),
    st.builds(
        AttemptHeartbeat,
        attempt_id=attempt_ids,
        max_sequence_id=st.none() | st.integers(0, 30),
    ),
    st.builds(
        lambda a, s: AttemptUpdated.of(a, status=s),
        st.sampled_from([*ATTEMPT_IDS, "latest"]),
        st.sampled_from(ATTEMPT_STATUSES),
    ),
    st.builds(lambda s: RolloutUpdated.of(status=s), st.sampled_from(ROLLOUT_STATUSES)),
    st.builds(lambda: RolloutUpdated.of(metadata={"k": 1})),
    st.builds(RolloutCancelled),
    st.builds(SpanSequenceRequested, attempt_id=attempt_ids, count=st.integers(1, 5)),
    st.builds(
        WatchdogFired,
        attempt_id=attempt_ids,
        status=st.sampled_from(["timeout", "unresponsive"]),
        observed_heartbeat_time=st.none() | st.sampled_from([T0 + 1.0, T0 + 2.0]),
    ),
    st.builds(lambda: RolloutEnqueued(rollout=make_rollout())),
)


def draw_payload(data: st.DataObject, state: RolloutState, now: float) -> RolloutEventPayload:
    """A payload that often names an existing attempt, and a verdict that is often due."""
    known = [a.attempt_id for a in state.attempts]
    some_attempt = attempt_ids
    if known and data.draw(st.integers(0, 4)) > 0:
        some_attempt = st.sampled_from(known)
    kind = data.draw(st.sampled_from(["claim", "heartbeat", "update", "reserve", "watchdog", "other"]))
    if kind == "claim":
        return claim(len(state.attempts) + data.draw(st.integers(0, 1)) or 1, manual=data.draw(st.booleans()))
    if kind == "heartbeat":
        return AttemptHeartbeat(
            attempt_id=data.draw(some_attempt), max_sequence_id=data.draw(st.none() | st.integers(0, 30))
        )
    if kind == "update":
        target = data.draw(some_attempt | st.just("latest"))
        return AttemptUpdated.of(target, status=data.draw(st.sampled_from(ATTEMPT_STATUSES)))
    if kind == "reserve":
        return SpanSequenceRequested(attempt_id=data.draw(some_attempt), count=data.draw(st.integers(1, 5)))
    if kind == "watchdog":
        due = due_verdicts(state, now)
        if len(due) > 0 and data.draw(st.booleans()):
            return due[0]
        return WatchdogFired(
            attempt_id=data.draw(some_attempt),
            status=data.draw(st.sampled_from(["timeout", "unresponsive"])),
            observed_heartbeat_time=data.draw(st.none() | st.just(T0 + 1.0)),
        )
    return data.draw(payloads)


@settings(max_examples=300, deadline=None)
@given(config=configs, start=st.booleans(), data=st.data())
def test_random_streams_keep_the_invariants(config: RolloutConfig, start: bool, data: st.DataObject) -> None:
    first_attempt = Attempt(rollout_id=RID, attempt_id=aid(1), sequence_id=1, start_time=T0) if start else None
    t = T0
    state = applied(None, RolloutEnqueued(rollout=make_rollout(config=config), attempt=first_attempt), time=t)
    reserved: dict[str, int] = {}
    for _ in range(data.draw(st.integers(0, 30))):
        # the time the event carries (to the microsecond), which the fold judges verdicts at
        t = stored_seconds(t + data.draw(st.floats(0.0, 8.0)))
        payload = draw_payload(data, state, t)
        result = run(state, payload, time=t)  # checks version, no mutation, determinism
        if result.outcome != "applied":
            if isinstance(payload, WatchdogFired) and result.outcome == "ignored":
                # an ignored verdict names no live attempt with that heartbeat and due verdict
                assert payload not in due_verdicts(state, t)
            continue
        new = result.state
        assert new is not None
        if new.rollout.status in QUEUING_STATUSES and state.rollout.status not in QUEUING_STATUSES:
            assert may_queue(payload)  # a client that wrote it lets its polls ask again
        if isinstance(payload, AttemptStarted) and not payload.manual:
            assert state.rollout.status in QUEUING_STATUSES
        if isinstance(payload, SpanSequenceRequested):
            assert new.reserved_sequence_id is not None
            previous = reserved.get(payload.attempt_id)
            assert previous is None or new.reserved_sequence_id > previous
            reserved[payload.attempt_id] = new.reserved_sequence_id + payload.count - 1
        if isinstance(payload, AttemptHeartbeat) and payload.max_sequence_id is not None:
            assert new.next_sequence_ids[payload.attempt_id] > payload.max_sequence_id
            reserved[payload.attempt_id] = max(reserved.get(payload.attempt_id, 0), payload.max_sequence_id)
        if isinstance(payload, WatchdogFired):
            # applied at most once per attempt: the attempt is finished now
            judged = next(a for a in new.attempts if a.attempt_id == payload.attempt_id)
            assert judged.status == payload.status
            assert fold(new, make_event(payload, time=t)).outcome == "ignored"
        for old_attempt in state.attempts:
            # Finished attempts never go live again, except unresponsive ones revived.
            now = next(a for a in new.attempts if a.attempt_id == old_attempt.attempt_id)
            if old_attempt.status in FINISHED and now.status in LIVE:
                assert old_attempt.status == "unresponsive" and now.status == "running"
        for attempt in new.attempts:
            assert (attempt.end_time is None) == (attempt.status in LIVE)
        assert len({a.attempt_id for a in new.attempts}) == len(new.attempts)
        state = new


@settings(max_examples=100, deadline=None)
@given(steps=st.lists(st.tuples(payloads, st.floats(0.0, 8.0)), max_size=20))
def test_replay_gives_the_same_states(steps: list[tuple[RolloutEventPayload, float]]) -> None:
    t = T0
    events = [make_event(RolloutEnqueued(rollout=make_rollout()), time=t)]
    for payload, delta in steps:
        t += delta
        events.append(make_event(payload, time=t))

    def replay() -> list[FoldResult]:
        state: RolloutState | None = None
        results = []
        for event in events:
            result = fold(state, event)
            results.append(result)
            if result.state is not None:
                state = result.state
        return results

    assert replay() == replay()


def test_events_that_cannot_queue_a_rollout_are_told_apart() -> None:
    """What a client's polls rely on: only these leave what they know of the queues alone."""
    assert not may_queue(RolloutEnqueued(rollout=make_rollout(), attempt=claim(1).attempt))  # start_rollout
    assert not may_queue(AttemptUpdated.of(aid(1), status="succeeded"))
    assert not may_queue(AttemptUpdated.of(aid(1), metadata={"k": 1}))
    assert not may_queue(AttemptHeartbeat(attempt_id=aid(1)))
    assert not may_queue(RolloutUpdated.of(status="running"))
    assert not may_queue(RolloutCancelled())
    assert may_queue(AttemptUpdated.of(aid(1), status="failed"))  # a retry
    assert may_queue(RolloutUpdated.of(status="requeuing"))


def test_a_reservation_counting_negative_spans_is_refused_when_decoded() -> None:
    """A hostile writer's event never reaches the fold: it fails to decode (the processor
    dead-letters such records with the reason)."""
    from agl_stream.errors import CodecError
    from agl_stream.wire.codec import Codec

    codec = Codec.default()
    payload = SpanSequenceRequested.model_construct(attempt_id=aid(1), count=1, span_count=-3, max_sequence_id=None)
    event = make_event(SpanSequenceRequested(attempt_id=aid(1), span_count=3), T0)
    written = codec.encode(event.model_copy(update={"payload": payload}))
    with pytest.raises(CodecError, match="span_count"):
        codec.decode(written, RolloutEvent)
    assert codec.decode(codec.encode(event), RolloutEvent) == event
