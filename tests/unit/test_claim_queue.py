"""The processor's claim queue: oldest queued rollout first, reservations, waiting claims."""

from __future__ import annotations

from agl_stream.domain.queue import ClaimQueue, claim_attempt_id


def test_claims_take_the_oldest_queued_rollout_first_whatever_the_insertion_order() -> None:
    queue: ClaimQueue[str] = ClaimQueue()
    queue.queued("ro-b", since=2.0)
    queue.queued("ro-a", since=1.0)
    queue.queued("ro-c", since=3.0)
    assert [queue.take(), queue.take(), queue.take(), queue.take()] == ["ro-a", "ro-b", "ro-c", None]


def test_a_reserved_rollout_is_not_handed_out_twice_until_released() -> None:
    queue: ClaimQueue[str] = ClaimQueue()
    queue.queued("ro-a", since=1.0)
    assert queue.take() == "ro-a"
    assert queue.take() is None and len(queue) == 0
    queue.release("ro-a")  # the claim lost at the fold, the rollout is still queued
    assert queue.take() == "ro-a"


def test_a_rollout_that_left_the_queue_is_skipped_and_a_requeued_one_gets_its_new_place() -> None:
    queue: ClaimQueue[str] = ClaimQueue()
    queue.queued("ro-a", since=1.0)
    queue.queued("ro-b", since=2.0)
    queue.left("ro-a")  # cancelled
    queue.queued("ro-a", since=5.0)  # requeued later: behind ro-b now
    queue.queued("ro-b", since=9.0)  # already queued: keeps its place
    assert [queue.take(), queue.take()] == ["ro-b", "ro-a"]


def test_waiting_claims_expire_at_their_deadline_in_arrival_order() -> None:
    queue: ClaimQueue[str] = ClaimQueue()
    queue.wait("first", deadline=10.0)
    queue.wait("second", deadline=5.0)
    assert queue.next_deadline() == 5.0
    assert queue.expired(now=4.0) == []
    assert queue.expired(now=5.0) == ["second"]
    assert [w.request for w in queue.waiting] == ["first"]


def test_claim_attempt_ids_are_derived_from_the_request() -> None:
    one = claim_attempt_id("6a4e1f4e-0000-4000-8000-000000000001")
    assert one == claim_attempt_id("6a4e1f4e-0000-4000-8000-000000000001")
    assert one != claim_attempt_id("6a4e1f4e-0000-4000-8000-000000000002")
    assert one.startswith("at-") and len(one) == 11
