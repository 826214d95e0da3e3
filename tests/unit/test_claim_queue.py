"""The processor's claim queue: oldest queued rollout first, reservations, waiting claims, and
the claims answered empty it remembers."""

from __future__ import annotations

import pytest

from agl_stream.domain import queue as queue_module
from agl_stream.domain.queue import EMPTY_MEMORY_S, ClaimQueue, claim_attempt_id


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


def test_claims_answered_empty_are_remembered_for_a_while_and_a_bounded_number() -> None:
    queue: ClaimQueue[str] = ClaimQueue()
    queue.answered_empty("old", now=0.0)
    queue.answered_empty("new", now=EMPTY_MEMORY_S)
    assert queue.was_answered_empty("old") and queue.was_answered_empty("new")
    queue.clear()  # not forgotten with the queue: a start-over reads answered claims again
    queue.answered_empty("newer", now=EMPTY_MEMORY_S + 1)
    assert not queue.was_answered_empty("old")  # past EMPTY_MEMORY_S
    assert queue.was_answered_empty("new") and queue.was_answered_empty("newer")
    assert not queue.was_answered_empty("never")


def test_at_most_empty_memory_max_claims_answered_empty_are_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(queue_module, "EMPTY_MEMORY_MAX", 2)
    queue: ClaimQueue[str] = ClaimQueue()
    for n, request in enumerate(["a", "b", "c"]):
        queue.answered_empty(request, now=float(n))
    assert [queue.was_answered_empty(r) for r in "abc"] == [False, True, True]
