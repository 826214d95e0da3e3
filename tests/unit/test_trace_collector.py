"""Collecting an attempt's spans until it finished and all arrived, in any arrival order."""

from __future__ import annotations

import itertools

import pytest

from agl_stream.domain.adapter import AdapterConfig
from agl_stream.domain.trace_collector import TraceCollector, group_id_of, spans_by_attempt, triplet_record
from agl_stream.models import Attempt, Rollout, RolloutState, Span

RID = "ro-000000000001"


def span(seq: int, attempt: str = "at-1", rollout: str = RID) -> Span:
    return Span(
        rollout_id=rollout, attempt_id=attempt, sequence_id=seq, trace_id="0" * 32, span_id=f"{seq:016x}", name="s"
    )


def state(
    *attempts: tuple[str, str], counts: dict[str, int] | None = None, cause_time: float = 10.0, ended_at: float = 10.0
) -> RolloutState:
    return RolloutState(
        rollout=Rollout(rollout_id=RID, input={"q": 1}, start_time=0.0, status="succeeded"),
        attempts=[
            Attempt(
                rollout_id=RID,
                attempt_id=aid,
                sequence_id=i + 1,
                start_time=1.0,
                status=status,  # type: ignore[arg-type]
                end_time=ended_at if status in ("succeeded", "failed", "timeout", "unresponsive") else None,
            )
            for i, (aid, status) in enumerate(attempts)
        ],
        version=3,
        cause_event_id="ev",
        cause_time=cause_time,
        span_counts=counts or {},
    )


@pytest.mark.parametrize("order", list(itertools.permutations(["s1", "s2", "s3", "state"])))
def test_ready_once_finished_and_complete_whatever_the_order(order: tuple[str, ...]) -> None:
    collector: TraceCollector[str] = TraceCollector()
    ready = []
    acked_at_once: list[str] = []
    for item in order:
        if item == "state":
            got, ack = collector.add_state(state(("at-1", "succeeded"), counts={"at-1": 3}), item, now=1.0)
        else:
            got, ack = collector.add_span(span(int(item[1])), item, now=1.0)
        ready += got
        acked_at_once += ack
    [attempt] = ready
    assert attempt.complete and [s.sequence_id for s in attempt.spans] == [1, 2, 3]
    assert sorted(attempt.tokens) == ["s1", "s2", "s3", "state"] and acked_at_once == []
    assert collector.pending == {} and collector.held_spans == 0


def test_an_incomplete_attempt_settles_after_settle_s() -> None:
    collector: TraceCollector[int] = TraceCollector(settle_s=5.0)
    collector.add_span(span(1), 1, now=0.0)
    ready, _ = collector.add_state(state(("at-1", "failed"), counts={"at-1": 2}), 2, now=1.0)
    assert ready == []
    assert collector.tick(now=5.9) == ([], [])
    [attempt], evicted = collector.tick(now=6.0)
    assert not attempt.complete and len(attempt.spans) == 1 and attempt.tokens == [1, 2] and evicted == []
    assert collector.stats.incomplete == 1


def test_duplicates_count_once_and_late_spans_are_acknowledged_at_once() -> None:
    collector: TraceCollector[int] = TraceCollector(settle_s=5.0)
    collector.add_span(span(1), 1, now=0.0)
    collector.add_span(span(1), 2, now=0.0)  # a re-sent batch: its heartbeat counted it twice
    ready, _ = collector.add_state(state(("at-1", "succeeded"), counts={"at-1": 2}), 3, now=0.0)
    assert ready == []  # waits for a second distinct span that will never come ...
    [attempt], _ = collector.tick(now=5.0)  # ... until it settles
    assert [s.sequence_id for s in attempt.spans] == [1] and attempt.tokens == [1, 2, 3]
    ready, ack = collector.add_span(span(2), 4, now=6.0)  # after the attempt was handed out
    assert ready == [] and ack == [4]
    assert collector.stats.duplicate_spans == 2


def test_zero_spans_expected_is_ready_at_once() -> None:
    collector: TraceCollector[int] = TraceCollector()
    [attempt], ack = collector.add_state(state(("at-1", "failed")), 7, now=0.0)
    assert attempt.spans == [] and attempt.complete and attempt.tokens == [7] and ack == []


def test_attempts_finished_long_ago_are_not_emitted_again() -> None:
    collector: TraceCollector[int] = TraceCollector()
    # A later state of the rollout still lists attempt 1, finished at t=3 while this state's cause is t=10.
    ready, ack = collector.add_state(state(("at-1", "failed"), ("at-2", "running"), ended_at=3.0), 1, now=0.0)
    assert ready == [] and ack == [1] and collector.pending == {}
    # ... but one whose spans are held is finished by it (its end_time was set by the writer).
    collector.add_span(span(1, "at-3"), 2, now=0.0)
    ready, _ = collector.add_state(state(("at-3", "succeeded"), counts={"at-3": 1}, ended_at=3.0), 3, now=0.0)
    assert [r.finished.attempt.attempt_id for r in ready] == ["at-3"]


def test_unfinished_attempts_are_evicted_after_max_wait_and_over_the_span_bound() -> None:
    collector: TraceCollector[int] = TraceCollector(max_wait_s=60.0, max_spans=3)
    collector.add_span(span(1, "at-old"), 1, now=0.0)
    collector.add_span(span(1, "at-a"), 2, now=50.0)
    _, evicted = collector.tick(now=61.0)
    assert [(e.attempt_id, e.tokens) for e in evicted] == [("at-old", [1])]
    for seq in range(2, 5):
        collector.add_span(span(seq, "at-a"), 10 + seq, now=70.0)
    _, evicted = collector.tick(now=70.0)
    assert [e.attempt_id for e in evicted] == ["at-a"] and collector.held_spans == 0
    assert collector.stats.evicted == 2 and collector.stats.evicted_spans == 5


def test_group_id_is_the_task_identity_or_the_producers_choice() -> None:
    a = Rollout(rollout_id="ro-a", input={"q": 1, "x": [1, 2]}, start_time=0.0, mode="train")
    b = Rollout(rollout_id="ro-b", input={"x": [1, 2], "q": 1}, start_time=5.0, mode="train")
    c = Rollout(rollout_id="ro-c", input={"q": 2, "x": [1, 2]}, start_time=0.0, mode="train")
    assert group_id_of(a) == group_id_of(b) != group_id_of(c)
    d = a.model_copy(update={"metadata": {"group_id": "task-17"}})
    assert group_id_of(d) == "task-17"


def test_spans_of_one_record_hold_its_token_once() -> None:
    collector: TraceCollector[str] = TraceCollector()
    ready, at_once = collector.add_spans([span(1), span(2)], "batch-1", now=1.0)
    assert (ready, at_once) == ([], [])
    ready, _ = collector.add_spans([span(2), span(3)], "batch-2", now=1.0)  # a re-sent span in it
    assert ready == [] and collector.stats.duplicate_spans == 1 and collector.held_spans == 3
    [attempt], _ = collector.add_state(state(("at-1", "succeeded"), counts={"at-1": 3}), "state", now=1.0)
    assert [s.sequence_id for s in attempt.spans] == [1, 2, 3]
    assert attempt.tokens == ["batch-1", "batch-2", "state"]
    # A late copy of the batch: acknowledged at once, once.
    assert collector.add_spans([span(1), span(2)], "batch-1-again", now=2.0) == ([], ["batch-1-again"])
    assert collector.add_spans([], "empty", now=2.0) == ([], ["empty"])


def test_add_spans_takes_one_attempt_at_a_time() -> None:
    collector: TraceCollector[str] = TraceCollector()
    with pytest.raises(ValueError, match="one attempt"):
        collector.add_spans([span(1), span(2, attempt="at-2")], "t", now=1.0)


def test_spans_by_attempt_groups_in_first_appearance_order() -> None:
    spans = [span(1, "at-2"), span(1, "at-1"), span(2, "at-2"), span(1, "at-1", rollout="ro-000000000002")]
    groups = spans_by_attempt(spans)
    assert [[(s.rollout_id, s.attempt_id, s.sequence_id) for s in g] for g in groups] == [
        [(RID, "at-2", 1), (RID, "at-2", 2)],
        [(RID, "at-1", 1)],
        [("ro-000000000002", "at-1", 1)],
    ]
    assert spans_by_attempt([]) == []


@pytest.mark.parametrize("mode", ["train", "val", "test", None])
def test_the_record_carries_its_rollouts_mode(mode: str | None) -> None:
    """What the batcher refuses val and test records by: validation is never trained on."""
    base = state(("at-1", "succeeded"))
    finished_state = base.model_copy(update={"rollout": base.rollout.model_copy(update={"mode": mode})})
    collector: TraceCollector[str] = TraceCollector()
    [attempt], _ = collector.add_state(finished_state, "state", now=1.0)
    record, _ = triplet_record(attempt.finished, attempt.spans, AdapterConfig(), None)
    assert record.mode == mode and record.rollout_id == RID
