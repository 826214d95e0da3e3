"""The rollout processor's handler on hand-made batches: what it writes and answers, no broker.

The producer and the reply topics are stand-ins that record what is sent and hand out offsets,
so the batches here are exactly the records a consumer would deliver.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from typing import Any

from aiokafka import ConsumerRecord, TopicPartition
from aiokafka.structs import RecordMetadata

from agl_stream.config import Settings
from agl_stream.domain.queue import QUEUE_FULL, claim_attempt_id
from agl_stream.domain.trace_collector import finishes_an_attempt
from agl_stream.ids import new_event_id, new_rollout_id
from agl_stream.kafka.io import Outbox
from agl_stream.models import (
    Attempt,
    AttemptHeartbeat,
    AttemptStarted,
    AttemptUpdated,
    Reply,
    Rollout,
    RolloutEnqueued,
    RolloutEvent,
    RolloutState,
    StoreRequest,
)
from agl_stream.store.replies import REPLY_HEADER
from agl_stream.wire.codec import Codec
from agl_stream.wire.reply_wire import replies_of
from processors.rollouts import PROCESSOR, RolloutProcessor

SETTINGS = Settings(topic_prefix="t")
EVENTS = SETTINGS.topic("rollouts")
REQUESTS = SETTINGS.topic("store-requests")
STATES = SETTINGS.topic("rollout-state")
CLIENT = f"{SETTINGS.topic('replies')}.client-1"
DLQ = SETTINGS.topic("dlq")


class Producer:
    """Acknowledges every send at once, with the next offset of its partition."""

    def __init__(self, ends: dict[tuple[str, int], int]) -> None:
        self.ends = ends
        self.sent: list[tuple[str, int, bytes | None, list[tuple[str, bytes]]]] = []
        self.client = MetadataTopics()

    async def send(
        self,
        topic: str,
        value: bytes | None,
        key: bytes | None = None,
        partition: int | None = None,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> asyncio.Future[RecordMetadata]:
        p = partition or 0
        offset = self.ends[(topic, p)]
        self.ends[(topic, p)] = offset + 1
        self.sent.append((topic, p, value, list(headers or [])))
        done: asyncio.Future[RecordMetadata] = asyncio.get_running_loop().create_future()
        done.set_result(RecordMetadata(topic, p, TopicPartition(topic, p), offset, -1, 0, 0))
        return done


class MetadataTopics:
    """The producer's client, as far as the processor uses it: the topics it asks metadata of."""

    def __init__(self) -> None:
        self.set: list[set[str]] = []

    def set_topics(self, topics: set[str]) -> None:
        self.set.append(set(topics))


class ReplyTopics:
    def __init__(self, real: Any) -> None:
        self.real = real
        self.deleted: set[str] = set()  # as the next lookup finds them

    def valid(self, name: str) -> bool:
        return bool(self.real.valid(name))

    def of(self, headers: Any) -> tuple[str | None, bool]:
        return self.real.of(headers)  # type: ignore[no-any-return]

    def exists(self, name: str) -> bool:
        return name not in self.deleted

    def gone(self, name: str) -> None:
        raise AssertionError(name)

    async def refresh(self, names: set[str]) -> bool:
        return bool(self.deleted)


class Harness:
    def __init__(self, settings: Settings = SETTINGS, ends: dict[tuple[str, int], int] | None = None) -> None:
        """``ends``: another harness's, for a processor that takes over the same topics."""
        self.codec = Codec.default()
        self.ends: dict[tuple[str, int], int] = defaultdict(int) if ends is None else ends
        self.producer = Producer(self.ends)
        self.replies = Producer(self.ends)
        outbox = Outbox(settings, self.producer, "test", self.codec)  # type: ignore[arg-type]
        self.processor = RolloutProcessor(settings, outbox, self.replies, self.codec)  # type: ignore[arg-type]
        self.processor.reply_topics = ReplyTopics(self.processor.reply_topics)  # type: ignore[assignment]
        self.processor.owned = {0}

    def record(
        self, topic: str, key: str, value: bytes, headers: list[tuple[str, bytes]]
    ) -> ConsumerRecord[bytes, bytes]:
        offset = self.ends[(topic, 0)]
        self.ends[(topic, 0)] = offset + 1
        return ConsumerRecord(topic, 0, offset, 0, 0, key.encode(), value, None, len(key), len(value), headers)

    def enqueue(self, reply_to: str = CLIENT) -> ConsumerRecord[bytes, bytes]:
        rollout = Rollout(rollout_id=new_rollout_id(), input={"n": 1}, start_time=time.time(), metadata={})
        event = RolloutEvent(
            event_id=new_event_id(), rollout_id=rollout.rollout_id, time=time.time(), writer="test",
            payload=RolloutEnqueued(rollout=rollout),
        )  # fmt: skip
        return self.record(EVENTS, rollout.rollout_id, self.codec.encode(event), [(REPLY_HEADER, reply_to.encode())])

    def event(self, rollout_id: str, payload: Any, *, at: float) -> ConsumerRecord[bytes, bytes]:
        event = RolloutEvent(event_id=new_event_id(), rollout_id=rollout_id, time=at, writer="test", payload=payload)
        return self.record(EVENTS, rollout_id, self.codec.encode(event), [])

    def claim(self, wait: float = 5.0, *, sent: float | None = None) -> tuple[str, ConsumerRecord[bytes, bytes]]:
        request = StoreRequest(
            request_id=new_event_id(), kind="claim", reply_to=CLIENT, time=time.time() if sent is None else sent,
            worker_id="w", wait_seconds=wait,
        )  # fmt: skip
        return request.request_id, self.record(REQUESTS, request.request_id, self.codec.encode(request), [])

    def written(self, topic: str) -> list[tuple[int, bytes | None, list[tuple[str, bytes]]]]:
        """What was produced to ``topic`` (offset order), as the consumer would read it back."""
        return [(i, v, h) for i, (t, _, v, h) in enumerate(self.producer.sent) if t == topic]

    def answers(self) -> list[Reply]:
        return [reply for t, _, v, _ in self.replies.sent if t == CLIENT for reply in replies_of(self.codec, v or b"")]

    def events_sent(self) -> list[ConsumerRecord[bytes, bytes]]:
        """The processor's own events on agl.rollouts, as records a consumer would deliver."""
        return [
            ConsumerRecord(EVENTS, p, 0, 0, 0, None, v, None, 0, len(v or b""), h)
            for t, p, v, h in self.producer.sent
            if t == EVENTS
        ]

    async def handle(self, *records: ConsumerRecord[bytes, bytes]) -> None:
        batch: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]] = defaultdict(list)
        for r in records:
            batch[TopicPartition(r.topic, r.partition)].append(r)
        await self.processor.handle(dict(batch))


def _claimed(answers: list[Reply], request_id: str) -> RolloutState:
    [answer] = [a for a in answers if a.request_id == request_id]
    assert answer.outcome == "applied" and answer.state is not None
    return answer.state


async def _claim_one(h: Harness) -> RolloutState:
    """A rollout queued, claimed, and its claim event read back and folded: the claimer's answer."""
    request_id, claim = h.claim()
    await h.handle(claim)
    await h.handle(enqueue := h.enqueue())
    [event] = h.events_sent()
    assert _answers_to(h, request_id) == []  # the claim is folded when its event comes back
    at = h.ends[(EVENTS, 0)] - 1
    await h.handle(ConsumerRecord(EVENTS, 0, at, 0, 0, enqueue.key, event.value, None, 0, 0, event.headers))
    state = _claimed(h.answers(), request_id)
    assert state.attempts[-1].attempt_id == claim_attempt_id(request_id) and state.input_offset == at
    return state


def _answers_to(h: Harness, request_id: str) -> list[Reply]:
    return [a for a in h.answers() if a.request_id == request_id]


async def test_the_state_an_attempt_finished_in_is_written_even_when_the_batch_changes_it_again() -> None:
    """A runner's liveness heartbeat folded after the attempt's outcome in one batch (the
    processor was down meanwhile): the batch's newest state no longer shows the attempt
    finishing, so the state it finished in is written too, before it. The triplet builder
    emits an attempt from that state (a cluster test lost a triplet record without it)."""
    h = Harness()
    state = await _claim_one(h)
    rollout_id, attempt_id = state.rollout.rollout_id, state.attempts[-1].attempt_id
    await h.handle(
        h.event(rollout_id, AttemptUpdated(set_fields=["status"], attempt_id=attempt_id, status="succeeded"), at=10.0),
        h.event(rollout_id, AttemptHeartbeat(attempt_id=attempt_id, worker_id="w"), at=13.0),
    )
    *_, finished, newest = [h.codec.decode(v or b"", RolloutState) for _, v, _ in h.written(STATES)]
    assert finishes_an_attempt(finished) and finished.attempts[-1].status == "succeeded"
    assert not finishes_an_attempt(newest) and newest.cause_time == 13.0
    assert newest.attempts[-1].end_time == finished.cause_time == 10.0


async def test_one_batchs_answers_to_a_client_are_one_record_in_event_order() -> None:
    h = Harness()
    enqueues = [h.enqueue() for _ in range(5)]
    await h.handle(*enqueues)
    [record] = [v for t, _, v, _ in h.replies.sent if t == CLIENT]
    assert h.codec.decode_dict(record or b"")[0] == "agl.ReplyBatch"
    assert [a.request_id for a in h.answers()] == [_event_id(e, h.codec) for e in enqueues]
    assert {a.outcome for a in h.answers()} == {"applied"}
    await h.handle(h.enqueue())  # a lone answer goes as a plain agl.Reply
    assert h.codec.decode_dict(h.replies.sent[-1][2] or b"")[0] == "agl.Reply"


def _event_id(record: ConsumerRecord[bytes, bytes], codec: Codec) -> str:
    return codec.decode(record.value or b"", RolloutEvent).event_id


def _claim_event_read_back(h: Harness) -> ConsumerRecord[bytes, bytes]:
    """The claim event the processor just wrote (the last record of agl.rollouts), read back."""
    *_, event = h.events_sent()
    key = h.codec.decode(event.value or b"", RolloutEvent).rollout_id.encode()
    return ConsumerRecord(EVENTS, 0, h.ends[(EVENTS, 0)] - 1, 0, 0, key, event.value, None, 0, 0, event.headers)


async def test_an_enqueue_past_the_partitions_limit_is_refused_and_room_comes_back_with_a_claim() -> None:
    h = Harness(Settings(topic_prefix="t", max_queued_per_partition=2))
    first, second, third = h.enqueue(), h.enqueue(), h.enqueue()
    await h.handle(first, second, third)
    [refused] = _answers_to(h, _event_id(third, h.codec))
    assert refused.outcome == "rejected" and refused.error is not None and refused.error.startswith(QUEUE_FULL)
    assert "partition 0" in refused.error and "2 queued" in refused.error
    assert [a.outcome for a in h.answers()] == ["applied", "applied", "rejected"]
    assert h.written(DLQ) == []  # its writer heard why
    assert h.processor.counts["enqueues_refused"] == 1
    assert h.processor.queue.queued_on(0) == 2
    # A claim takes one; until its event is folded the rollout is still queued in the log.
    request_id, claim = h.claim()
    await h.handle(claim)
    await h.handle(fourth := h.enqueue())
    assert _answers_to(h, _event_id(fourth, h.codec))[0].outcome == "rejected"
    claim_event = _claim_event_read_back(h)
    await h.handle(claim_event)
    assert _claimed(h.answers(), request_id).rollout.status == "preparing"
    await h.handle(fifth := h.enqueue())
    assert _answers_to(h, _event_id(fifth, h.codec))[0].outcome == "applied"


async def test_a_refused_enqueue_is_refused_again_by_a_processor_that_replays_it() -> None:
    """A processor restarted (or the next owner after a rebalance) rebuilds its state from the
    changelog and folds again what was not committed. The queue has room by then (a claim
    folded after the refusal), but the enqueue was refused the first time: it is refused again,
    and a later one is admitted."""
    limited = Settings(topic_prefix="t", max_queued_per_partition=1)
    a = Harness(limited)
    first, second = a.enqueue(), a.enqueue()
    await a.handle(first, second)
    assert [r.outcome for r in a.answers()] == ["applied", "rejected"]
    _, claim = a.claim()
    await a.handle(claim)
    claim_event = _claim_event_read_back(a)
    await a.handle(claim_event)
    assert a.processor.queue.queued_on(0) == 0  # room now
    # A dies before committing anything; B reads A's changelog, then agl.rollouts from the start.
    b = Harness(limited, a.ends)
    b.processor.owned = {0}
    for _, value, _ in a.written(STATES):
        assert value is not None
        key = a.codec.decode(value, RolloutState).rollout.rollout_id.encode()
        b.processor._recovered(ConsumerRecord(STATES, 0, 0, 0, 0, key, value, None, 0, 0, []), 0)
    await b.handle(first, second, claim_event)
    assert [r.outcome for r in b.answers()] == ["applied", "rejected", "applied"]
    again = b.answers()[1].error
    assert again is not None and again.startswith(QUEUE_FULL) and "not admitted when its enqueue was first" in again
    assert second.key is not None and second.key.decode() not in b.processor.states
    await b.handle(third := b.enqueue())
    assert _answers_to(b, _event_id(third, b.codec))[0].outcome == "applied"


async def test_a_queued_rollout_is_held_encoded_and_decoded_when_claimed() -> None:
    h = Harness()
    await h.handle(enqueue := h.enqueue())
    rollout_id = (enqueue.key or b"").decode()
    assert isinstance(h.processor.states._held[rollout_id], bytes)  # compact while it waits
    assert h.processor.states.decoded(rollout_id) is None
    state = h.processor.states[rollout_id]  # decoded on demand, the same state
    assert state.rollout.rollout_id == rollout_id and state.watchers == [CLIENT]
    request_id, claim = h.claim()
    await h.handle(claim)
    claim_event = _claim_event_read_back(h)
    await h.handle(claim_event)
    claimed = _claimed(h.answers(), request_id)
    assert claimed.rollout.status == "preparing" and claimed.watchers == [CLIENT]
    assert h.processor.states.decoded(rollout_id) == claimed  # not queued any more: kept decoded


def _outcomes(h: Harness, request_id: str) -> set[tuple[str, str | None]]:
    """What the answers to one request said: outcome and the rollout named, if any."""
    return {(a.outcome, a.state.rollout.rollout_id if a.state else None) for a in _answers_to(h, request_id)}


def _start_over(h: Harness, *, log_end: int | None = None) -> None:
    """What the skeleton does after a failed batch (``_Loop._start_over``), without a broker: the
    handler forgets its partitions and rebuilds them from the changelog as written so far, noting
    where agl.rollouts ends (``log_end``: its end by default) to catch up to before it serves
    claims; the records since the last commit are then read again (the test hands them in)."""
    p = h.processor
    p.revoked({TopicPartition(EVENTS, 0), TopicPartition(REQUESTS, 0)})
    p.owned = {0}
    p.folded_through[0] = -1
    for offset, value, _ in h.written(STATES):
        key = b"" if value is None else h.codec.decode(value, RolloutState).rollout.rollout_id.encode()
        p._recovered(ConsumerRecord(STATES, 0, offset, 0, 0, key, value, None, 0, 0, []), 0)
    p.catching_up[0] = h.ends[(EVENTS, 0)] if log_end is None else log_end


async def test_a_claim_read_again_while_the_processor_catches_up_gets_the_rollout_it_was_served() -> None:
    """The broker-kill bug (test_cluster): a claim was served (its claim event written), the batch
    that folded that event failed before its answer went out, and the processor started over. It
    read the claim again while catching up on agl.rollouts, the claim's wait spent by then, and
    answered it empty; the claimer moved on, and the claim event, folded next, left the rollout
    'preparing' under a runner that never heard of it. The claim must wait for the catch-up and
    then be answered with the rollout of its own claim event; no second rollout is taken."""
    h = Harness()
    first, second = h.enqueue(), h.enqueue()
    await h.handle(first, second)
    request_id, claim = h.claim(wait=1.0, sent=time.time() - 5)
    await h.handle(claim)
    claim_event = _claim_event_read_back(h)
    _start_over(h)  # the batch folding the claim event failed
    await h.handle(claim)  # read again (not committed), while catching up
    await h.processor.tick()
    assert _answers_to(h, request_id) == []  # not empty: its claim event is still to be folded
    await h.handle(first, second, claim_event)  # caught up
    await h.processor.tick()
    assert _outcomes(h, request_id) == {("applied", (first.key or b"").decode())}
    assert len(h.events_sent()) == 1  # one claim event: the second rollout was not taken
    assert len(h.processor.queue) == 1 and h.processor.states[(second.key or b"").decode()].rollout.status == "queuing"


async def test_a_claim_answered_empty_and_read_again_after_a_failed_batch_is_answered_empty_again() -> None:
    """Commits fail while the group coordinator fails over, so a start-over reads again claims
    answered long ago. One answered empty must not take a rollout that arrived since: its
    claimer moved on. Nor is a claim event written for it ever folded."""
    h = Harness()
    request_id, claim = h.claim(wait=0.0)
    await h.handle(claim)
    assert [a.outcome for a in _answers_to(h, request_id)] == ["empty"]
    await h.handle(enqueue := h.enqueue())
    _start_over(h)
    await h.handle(enqueue, claim)
    assert h.events_sent() == []
    assert {a.outcome for a in _answers_to(h, request_id)} == {"empty"}
    rollout_id = (enqueue.key or b"").decode()
    attempt = Attempt(rollout_id=rollout_id, attempt_id=claim_attempt_id(request_id), sequence_id=1, start_time=1.0)
    late = RolloutEvent(
        event_id=request_id, rollout_id=rollout_id, time=time.time(), writer=PROCESSOR,
        payload=AttemptStarted(attempt=attempt, worker_id="w"),
    )  # fmt: skip
    await h.handle(h.record(EVENTS, rollout_id, h.codec.encode(late), [(REPLY_HEADER, CLIENT.encode())]))
    assert h.processor.states[rollout_id].rollout.status == "queuing"  # not 'preparing' under "w"
    assert {a.outcome for a in _answers_to(h, request_id)} == {"empty"}
    assert h.processor.counts["claims_served_twice"] == 1


async def test_a_claim_served_twice_to_the_same_rollout_is_folded_once_and_never_answered_rejected() -> None:
    """A claim event whose send failed can still land (a produce that timed out while the ISR
    shrank). The claim, read again after the start-over, may get the same rollout: its second
    claim event is the same claim, skipped, not a duplicate attempt refused to the claimer (a
    refusal makes it claim anew, leaving the rollout to nobody if the first answer was lost)."""
    h = Harness()
    await h.handle(enqueue := h.enqueue())
    request_id, claim = h.claim()
    await h.handle(claim)
    landed_late = _claim_event_read_back(h)
    _start_over(h, log_end=landed_late.offset)  # the send failed: the event was not there yet
    await h.handle(enqueue, claim)  # caught up, the claim read again and served again
    again = _claim_event_read_back(h)
    await h.handle(landed_late)
    await h.handle(again)
    assert _outcomes(h, request_id) == {("applied", (enqueue.key or b"").decode())}
    state = h.processor.states[(enqueue.key or b"").decode()]
    assert [a.attempt_id for a in state.attempts] == [claim_attempt_id(request_id)]
    assert h.processor.counts["claims_served_twice"] == 1


def _work_notices(h: Harness) -> list[Reply]:
    return [a for a in h.answers() if a.outcome == "notice" and a.state is None and a.covered_partitions]


async def test_a_client_answered_empty_hears_once_that_work_was_queued() -> None:
    """Polls of a known-empty queue cost no round trip: the client skips the partitions an
    empty answer named until the processor says work was queued there (one notice per empty
    spell, none while nobody was told empty, none for work a waiting claim took at once)."""
    h = Harness()
    await h.handle(h.enqueue())
    assert _work_notices(h) == []  # nobody was answered empty
    h.processor.queue.clear()
    request_id, claim = h.claim(wait=0.0)
    await h.handle(claim)
    [empty] = _answers_to(h, request_id)
    assert empty.outcome == "empty" and empty.covered_partitions == [0]
    await h.handle(h.enqueue())
    [notice] = _work_notices(h)
    assert notice.request_id == "" and notice.covered_partitions == [0]
    await h.handle(h.enqueue())
    assert len(_work_notices(h)) == 1  # one per empty spell
    h.processor.queue.clear()
    _, empty_again = h.claim(wait=0.0)
    await h.handle(empty_again)
    _, waiting = h.claim(wait=5.0)
    await h.handle(waiting)
    await h.handle(h.enqueue())  # taken by the waiting claim: nothing left queued to tell of
    assert len(_work_notices(h)) == 1


async def test_a_claim_taking_the_last_queued_rollout_says_the_queue_is_empty_and_the_client_hears_of_work() -> None:
    """The claimer's other idle runners need not each ask to learn the queue is empty: the answer
    with the rollout names the partitions when nothing is left queued (and only then), and its
    client then hears, as a client answered empty does, when work is queued again."""
    h = Harness()
    await h.handle(h.enqueue(), h.enqueue())
    first, claim = h.claim(wait=0.0)
    await h.handle(claim)
    await h.handle(_claim_event_read_back(h))
    [served] = _answers_to(h, first)
    assert served.outcome == "applied" and served.state is not None
    assert served.covered_partitions == []  # one more is queued: the client's polls go on asking
    last, claim = h.claim(wait=0.0)
    await h.handle(claim)
    await h.handle(_claim_event_read_back(h))
    [served] = _answers_to(h, last)
    assert served.outcome == "applied" and served.covered_partitions == [0]
    assert _work_notices(h) == []
    await h.handle(h.enqueue())
    [notice] = _work_notices(h)
    assert notice.covered_partitions == [0]


async def test_the_reply_producer_stops_asking_metadata_of_reply_topics_that_were_deleted() -> None:
    """aiokafka's producer would ask the metadata of every client it ever answered, for good,
    logging an error for each deleted topic at every update: a lookup that finds topics gone
    narrows it to those that exist, and never to none (that would mean every topic)."""
    h = Harness()
    other = f"{SETTINGS.topic('replies')}.client-2"
    await h.handle(h.enqueue(), h.enqueue(reply_to=other))
    assert h.replies.client.set == []  # nothing gone
    h.processor.reply_topics.deleted.add(other)  # type: ignore[attr-defined]
    await h.handle(h.enqueue())
    assert h.replies.client.set == [{CLIENT}]
    h.processor.reply_topics.deleted.add(CLIENT)  # type: ignore[attr-defined]
    await h.handle(h.enqueue())
    assert h.replies.client.set == [{CLIENT}]  # not narrowed to nothing
