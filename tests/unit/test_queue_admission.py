"""Admission to the rollout queue (agl_stream.domain.queue, agl_stream.domain.fold): a bounded
queue per partition, decided by the pure fold, without Kafka."""

from __future__ import annotations

import pytest

from agl_stream.domain.fold import fold
from agl_stream.domain.queue import QUEUE_FULL, Admission, ClaimQueue, admission_refusal
from agl_stream.models import (
    Attempt,
    AttemptUpdated,
    Rollout,
    RolloutConfig,
    RolloutEnqueued,
    RolloutEvent,
    RolloutEventPayload,
    RolloutState,
    RolloutUpdated,
)

RID = "ro-0123456789ab"
T0 = 1_700_000_000.0


def event(payload: RolloutEventPayload) -> RolloutEvent:
    return RolloutEvent(event_id="ev-1", rollout_id=RID, time=T0, writer="test", payload=payload)


def enqueued(attempt: Attempt | None = None) -> RolloutEvent:
    rollout = Rollout(rollout_id=RID, input={"q": 1}, start_time=T0)
    return event(RolloutEnqueued(rollout=rollout, attempt=attempt))


def test_the_queue_counts_queued_rollouts_per_partition_reserved_ones_included() -> None:
    queue: ClaimQueue[str] = ClaimQueue()
    queue.queued("ro-a", 1.0, partition=0)
    queue.queued("ro-b", 2.0, partition=0)
    queue.queued("ro-c", 3.0, partition=1)
    queue.queued("ro-a", 4.0, partition=0)  # already queued: counted once
    assert (queue.queued_on(0), queue.queued_on(1), queue.queued_on(2)) == (2, 1, 0)
    assert queue.take() == "ro-a"
    assert queue.queued_on(0) == 2  # reserved for a claim, still queued in the log
    queue.left("ro-a")  # the claim was folded
    queue.left("ro-a")  # twice changes nothing
    queue.left("ro-unknown")
    assert (queue.queued_on(0), queue.queued_on(1)) == (1, 1)
    queue.clear()
    assert (queue.queued_on(0), queue.queued_on(1)) == (0, 0)


@pytest.mark.parametrize(
    ("admission", "refused"),
    [
        (None, False),
        (Admission(0, queued=10**9, limit=None), False),
        (Admission(0, queued=1, limit=2), False),
        (Admission(0, queued=2, limit=2), True),
        (Admission(0, queued=3, limit=2), True),
        (Admission(3, queued=0, limit=2, folded_before=True), True),
        (Admission(3, queued=0, limit=None, folded_before=True), False),
    ],
)
def test_admission_refuses_past_the_limit_and_what_was_refused_before(
    admission: Admission | None, refused: bool
) -> None:
    reason = admission_refusal(admission, RID)
    assert (reason is not None) == refused
    if reason is not None:
        assert reason.startswith(QUEUE_FULL) and RID in reason and "AGL_MAX_QUEUED_PER_PARTITION" in reason


def test_the_fold_refuses_a_new_queued_rollout_when_its_partition_is_full() -> None:
    full = Admission(1, queued=5, limit=5)
    result = fold(None, enqueued(), full)
    assert result.outcome == "rejected" and result.state is None
    assert result.error is not None and result.error.startswith(QUEUE_FULL) and "partition 1" in result.error
    assert fold(None, enqueued(), full) == result  # pure: the same inputs, the same answer
    room = fold(None, enqueued(), Admission(1, queued=4, limit=5))
    assert room.outcome == "applied" and room.state is not None and room.state.rollout.status == "queuing"
    assert fold(None, enqueued()).outcome == "applied"  # no admission: no limit


def test_other_rejections_come_first() -> None:
    existing = fold(None, enqueued()).state
    assert existing is not None
    other = existing.rollout.model_copy(update={"input": {"q": 2}})
    result = fold(existing, event(RolloutEnqueued(rollout=other)), Admission(0, queued=5, limit=5))
    assert result.outcome == "rejected" and result.error is not None and "already exists" in result.error
    assert fold(existing, enqueued(), Admission(0, queued=5, limit=5)).outcome == "ignored"  # a copy


def test_a_started_rollout_does_not_enter_the_queue_and_is_never_refused() -> None:
    attempt = Attempt(rollout_id=RID, attempt_id="at-00000001", sequence_id=1, start_time=T0)
    result = fold(None, enqueued(attempt), Admission(0, queued=5, limit=5))
    assert result.outcome == "applied" and result.state is not None and result.state.rollout.status == "preparing"


def test_retries_and_updates_into_the_queue_are_not_admission_decisions() -> None:
    """Only a new rollout is refused: a failed attempt's requeue and an update back to queuing
    are folded whatever the queue holds (the fold takes no admission for them)."""
    config = RolloutConfig(max_attempts=3, retry_condition=["failed"])
    rollout = Rollout(rollout_id=RID, input={"q": 1}, start_time=T0, status="running", config=config)
    attempt = Attempt(rollout_id=RID, attempt_id="at-00000001", sequence_id=1, start_time=T0, status="running")
    state = RolloutState(rollout=rollout, attempts=[attempt], version=3, cause_event_id="ev-0", cause_time=T0)
    full = Admission(0, queued=5, limit=5)
    failed = fold(state, event(AttemptUpdated(set_fields=["status"], attempt_id="latest", status="failed")), full)
    assert failed.state is not None and failed.state.rollout.status == "requeuing"
    back = fold(state, event(RolloutUpdated(set_fields=["status"], status="queuing")), full)
    assert back.state is not None and back.state.rollout.status == "queuing"
