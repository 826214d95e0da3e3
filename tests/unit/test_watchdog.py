"""Watchdog verdicts and deadlines (agl_stream.domain.watchdog): pure arithmetic, no Kafka."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agl_stream.domain.fold import fold
from agl_stream.domain.rollout_core import Folded, RolloutCore
from agl_stream.domain.watchdog import due_verdicts, next_deadline, verdict_for
from agl_stream.models import (
    Attempt,
    AttemptStatus,
    Rollout,
    RolloutConfig,
    RolloutEnqueued,
    RolloutEvent,
    RolloutState,
)
from agl_stream.models.base import stored_seconds
from agl_stream.wire.codec import Codec

RID = "ro-0123456789ab"
T0 = 1_700_000_000.0


def make_state(
    *attempts: Attempt,
    timeout: float | None = None,
    unresponsive: float | None = None,
) -> RolloutState:
    config = RolloutConfig(timeout_seconds=timeout, unresponsive_seconds=unresponsive)
    rollout = Rollout(rollout_id=RID, input=None, start_time=T0, status="running", config=config)
    return RolloutState(rollout=rollout, attempts=list(attempts), version=1, cause_event_id="ev", cause_time=T0)


def make_attempt(
    seq: int = 1, status: AttemptStatus = "running", start: float = T0, heartbeat: float | None = None
) -> Attempt:
    return Attempt(
        rollout_id=RID,
        attempt_id=f"at-{seq:08x}",
        sequence_id=seq,
        start_time=start,
        status=status,
        last_heartbeat_time=heartbeat,
    )


def verdicts(state: RolloutState, now: float) -> list[tuple[str, str, float | None]]:
    return [(v.attempt_id, v.status, v.observed_heartbeat_time) for v in due_verdicts(state, now)]


# --------------------------------------------------------------------------------------------
# due_verdicts
# --------------------------------------------------------------------------------------------


def test_nothing_configured_nothing_due() -> None:
    state = make_state(make_attempt())
    assert due_verdicts(state, T0 + 1e9) == []
    assert next_deadline(state) is None


def test_timeout_is_strictly_after_the_budget() -> None:
    state = make_state(make_attempt(), timeout=10.0)
    assert verdicts(state, T0 + 10.0) == []
    assert verdicts(state, T0 + 10.5) == [("at-00000001", "timeout", None)]


def test_unresponsive_measured_from_start_without_heartbeat() -> None:
    state = make_state(make_attempt(), unresponsive=5.0)
    assert verdicts(state, T0 + 5.0) == []
    assert verdicts(state, T0 + 5.25) == [("at-00000001", "unresponsive", None)]


def test_unresponsive_measured_from_last_heartbeat() -> None:
    state = make_state(make_attempt(heartbeat=T0 + 100.0), unresponsive=5.0)
    assert verdicts(state, T0 + 104.0) == []
    assert verdicts(state, T0 + 105.5) == [("at-00000001", "unresponsive", T0 + 100.0)]


def test_heartbeat_at_time_zero_counts() -> None:
    """A heartbeat at 0.0 is a heartbeat (no `or` falsiness)."""
    state = make_state(make_attempt(start=0.0, heartbeat=0.0), unresponsive=5.0)
    assert verdicts(state, 4.0) == []
    assert next_deadline(state) == pytest.approx(5.0)


def test_timeout_wins_over_unresponsive() -> None:
    state = make_state(make_attempt(), timeout=10.0, unresponsive=5.0)
    assert verdicts(state, T0 + 7.0) == [("at-00000001", "unresponsive", None)]
    assert verdicts(state, T0 + 11.0) == [("at-00000001", "timeout", None)]


def test_heartbeats_do_not_postpone_timeout() -> None:
    state = make_state(make_attempt(heartbeat=T0 + 9.0), timeout=10.0, unresponsive=5.0)
    assert verdicts(state, T0 + 11.0) == [("at-00000001", "timeout", T0 + 9.0)]


@pytest.mark.parametrize("status", ["succeeded", "failed", "timeout", "unresponsive"])
def test_finished_attempts_are_not_watched(status: AttemptStatus) -> None:
    state = make_state(make_attempt(status=status), timeout=1.0, unresponsive=1.0)
    assert due_verdicts(state, T0 + 100.0) == []
    assert next_deadline(state) is None
    assert verdict_for(state.attempts[0], state.rollout.config, T0 + 100.0) is None


@pytest.mark.parametrize("status", ["preparing", "running"])
def test_live_attempts_are_watched(status: AttemptStatus) -> None:
    state = make_state(make_attempt(status=status), timeout=1.0)
    assert verdicts(state, T0 + 2.0) == [("at-00000001", "timeout", None)]


def test_one_verdict_per_live_attempt_in_order() -> None:
    state = make_state(
        make_attempt(1, "running", start=T0),
        make_attempt(2, "failed", start=T0 + 1),
        make_attempt(3, "preparing", start=T0 + 2, heartbeat=T0 + 3),
        timeout=100.0,
        unresponsive=5.0,
    )
    assert verdicts(state, T0 + 20.0) == [
        ("at-00000001", "unresponsive", None),
        ("at-00000003", "unresponsive", T0 + 3),
    ]
    assert verdicts(state, T0 + 200.0) == [("at-00000001", "timeout", None), ("at-00000003", "timeout", T0 + 3)]


def test_a_cancelled_rollouts_live_attempt_is_still_watched() -> None:
    state = make_state(make_attempt(), timeout=1.0)
    state = state.model_copy(update={"rollout": state.rollout.model_copy(update={"status": "cancelled"})})
    assert verdicts(state, T0 + 2.0) == [("at-00000001", "timeout", None)]


# --------------------------------------------------------------------------------------------
# next_deadline
# --------------------------------------------------------------------------------------------


def test_next_deadline_is_the_earliest_of_all_watched_limits() -> None:
    state = make_state(
        make_attempt(1, "running", start=T0, heartbeat=T0 + 50),
        make_attempt(2, "preparing", start=T0 + 10),
        make_attempt(3, "succeeded", start=T0 - 1000),
        timeout=100.0,
        unresponsive=30.0,
    )
    # attempt 1: timeout T0+100, silent T0+80; attempt 2: timeout T0+110, silent T0+40.
    deadline = next_deadline(state)
    assert deadline is not None
    assert deadline == pytest.approx(T0 + 40.0)
    assert deadline > T0 + 40.0  # strictly after: the comparison is strict
    assert verdicts(state, deadline) == [("at-00000002", "unresponsive", None)]
    assert verdicts(state, math.nextafter(deadline, -math.inf)) == []


def test_next_deadline_timeout_only() -> None:
    state = make_state(make_attempt(heartbeat=T0 + 5), timeout=60.0)
    deadline = next_deadline(state)
    assert deadline == pytest.approx(T0 + 60.0)


def test_next_deadline_unresponsive_only_follows_heartbeats() -> None:
    state = make_state(make_attempt(heartbeat=T0 + 5), unresponsive=60.0)
    assert next_deadline(state) == pytest.approx(T0 + 65.0)


def test_next_deadline_none_without_live_attempts() -> None:
    assert next_deadline(make_state(timeout=1.0, unresponsive=1.0)) is None


def test_infinite_or_nan_limits_never_fire() -> None:
    assert next_deadline(make_state(make_attempt(), timeout=math.inf)) is None
    assert next_deadline(make_state(make_attempt(), unresponsive=math.nan)) is None
    assert due_verdicts(make_state(make_attempt(), timeout=math.inf, unresponsive=math.nan), 1e300) == []


def test_zero_and_negative_limits() -> None:
    state = make_state(make_attempt(), timeout=0.0)
    deadline = next_deadline(state)
    assert deadline == math.nextafter(T0, math.inf)
    state = make_state(make_attempt(), timeout=-5.0)
    deadline = next_deadline(state)
    assert deadline is not None and deadline <= T0 - 5.0 + 1e-6
    assert verdicts(state, deadline) != []


def test_a_negative_limit_as_large_as_the_start_time_terminates() -> None:
    state = make_state(make_attempt(start=1e9), timeout=-1e9)
    deadline = next_deadline(state)
    assert deadline is not None
    assert verdicts(state, deadline) != []


times = st.floats(min_value=0.0, max_value=4e9, allow_nan=False)
limits = st.none() | st.floats(min_value=0.0, max_value=1e7, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(
    start=times,
    heartbeat_delta=st.none() | st.floats(min_value=0.0, max_value=1e6),
    timeout=limits,
    unresponsive=limits,
    status=st.sampled_from(["preparing", "running", "succeeded", "failed", "timeout", "unresponsive"]),
)
def test_next_deadline_is_exactly_the_first_due_time(
    start: float,
    heartbeat_delta: float | None,
    timeout: float | None,
    unresponsive: float | None,
    status: AttemptStatus,
) -> None:
    heartbeat = None if heartbeat_delta is None else start + heartbeat_delta
    state = make_state(
        make_attempt(status=status, start=start, heartbeat=heartbeat), timeout=timeout, unresponsive=unresponsive
    )
    deadline = next_deadline(state)
    watched = status in ("preparing", "running") and (timeout is not None or unresponsive is not None)
    if not watched:
        assert deadline is None
        return
    assert deadline is not None
    assert due_verdicts(state, deadline) != []
    assert due_verdicts(state, math.nextafter(deadline, -math.inf)) == []
    # and it stays due afterwards (the conditions are monotone in time)
    assert due_verdicts(state, deadline + 1.0) != []


# --------------------------------------------------------------------------------------------
# the processor's verdicts, folded
# --------------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    start=st.floats(T0, T0 + 10_000.0).map(stored_seconds),
    timeout=st.floats(0.001, 100.0) | st.integers(1, 100).map(float),
    late=st.floats(0.0, 2e-6),
)
def test_a_verdict_the_processor_makes_is_one_the_fold_applies(start: float, timeout: float, late: float) -> None:
    """The processor judges at the time its event will carry (to the microsecond), the time the
    fold judges at: a verdict it sends is never one the fold finds not yet due."""
    core = RolloutCore(Codec.default(), retention_s=3600.0, watchdog_interval_s=0.1, max_queued=None)
    rollout = Rollout(
        rollout_id=RID, input=None, start_time=start, status="queuing", config=RolloutConfig(timeout_seconds=timeout)
    )
    attempt = Attempt(rollout_id=RID, attempt_id="at-00000001", sequence_id=1, start_time=start)
    enqueued = RolloutEvent(
        event_id="ev-1",
        rollout_id=RID,
        time=start,
        writer="test",
        payload=RolloutEnqueued(rollout=rollout, attempt=attempt),
    )
    assert core.fold_event(enqueued, 0, 0, None, False, Folded()) is None
    state = core.states[RID]
    deadline = core.deadlines[RID]
    events = core.watchdog_events(deadline + late)
    for event in events:
        assert fold(state, event).outcome == "applied", (event.time, state.attempts[0].start_time)
    if not events:  # not yet due at the microsecond its event would carry: it is at the next one
        [event] = core.watchdog_events(deadline + 1e-6)
        assert fold(state, event).outcome == "applied"
