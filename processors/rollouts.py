"""The rollout processor: folds agl.rollouts into rollout state, hands out claims, answers writers.

Concurrency model: one asyncio task (the processor skeleton's loop, ``agl_stream.kafka.processor``)
calls every method here; rebalances run under the same lock, so nothing here is shared.

Per fetch (up to thousands of records from agl.rollouts and agl.store-requests):

1. every event is folded with the pure fold (``agl_stream.domain.fold``) in partition order;
   events at or below a state's ``input_offset`` were applied before a crash and are skipped;
2. store requests are answered: a watch adds the writer's reply topic to the rollout's
   ``watchers``; a claim takes the oldest queued rollout of every partition this processor owns
   (``agl_stream.domain.queue``) and becomes an AttemptStarted event *written to agl.rollouts*, so
   the log stays the whole history; it is folded (and answered) when it comes back. A claim that
   finds nothing waits up to its ``wait_seconds`` for work, else is answered ``empty``;
3. phase one, sent together and acknowledged: one state record per rollout the batch touched
   (its newest, after any state in which an attempt finished that later events of the batch
   superseded: readers act on that state), tombstones of finished rollouts past their retention, DLQ records of
   undecodable input and of rejected events nobody waits on (a writer waiting on its event
   hears the reason instead), claim and watchdog events;
4. phase two: the replies, each on the writer's own topic (``<prefix>.replies.<client>``, named
   by the event's ``agl-reply-to`` header or the request's ``reply_to``), carrying the state
   after that event and the offset of a state record at least as new (the writer's read fence),
   and a notice to every watcher of a rollout that finished;
5. the skeleton commits the input offsets. A crash anywhere re-reads the batch: replayed
   events are answered again with the rollout's current state, a replayed claim whose attempt
   exists is answered with that rollout (its attempt id is derived from the request id), one
   answered empty is answered empty again (remembered, ``ClaimQueue.answered_empty``), and a
   second claim event of one attempt id is not folded.

State survives restarts as the compacted ``agl.rollout-state`` topic: on assignment the
processor reads its partitions to the end, then reads agl.rollouts up to its end before it hands
out claims or answers any, not even empty (so a claim event written before a crash or a failed
batch is folded before any new one, and a claim read again gets the rollout its event gave it).

Memory and admission: every rollout the processor holds is in memory until it finished and its
retention passed. A rollout that waits in the queue unclaimed and has no attempt yet is held as
its encoded state record (``_States``; a fifth of the memory of its decoded objects), decoded when
something touches it. The queue of each partition is bounded (``Settings.max_queued_per_partition``):
the fold refuses an enqueue past it (``agl_stream.domain.queue.Admission``), counted per partition
from that partition's states so that a replay after a restart, or the next owner after a
rebalance, reaches the same answer; an enqueue at or below the offset the recovered states of its
partition cover (``folded_through``) that left no rollout was refused then and is refused again.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError

from agl_stream import metrics
from agl_stream.config import Settings
from agl_stream.domain.fold import fold
from agl_stream.domain.queue import QUEUE_FULL, Admission, ClaimQueue, claim_attempt_id
from agl_stream.domain.trace_collector import finishes_an_attempt
from agl_stream.domain.watchdog import due_verdicts, next_deadline
from agl_stream.errors import CodecError
from agl_stream.ids import new_event_id
from agl_stream.kafka.io import Outbox, Record, Rejected, make_producer
from agl_stream.kafka.processor import Batch, run_processor
from agl_stream.local.processes import run_until_stopped
from agl_stream.logs import get_logger
from agl_stream.models import (
    Attempt,
    AttemptStarted,
    RolloutEnqueued,
    RolloutEvent,
    RolloutState,
    StoreRequest,
)
from agl_stream.models.base import QUEUING_STATUSES, TERMINAL_STATUSES
from agl_stream.models.replies import ReplyOutcome
from agl_stream.store.replies import REPLY_HEADER, REPLY_STATE_HEADER, ReplyTopics, prune_reply_topics
from agl_stream.wire.avro_primitives import MAX_RECORD_BYTES
from agl_stream.wire.codec import Codec
from agl_stream.wire.reply_wire import ReplyEncoder

log = get_logger("agl.processor")

PROCESSOR = "processor.rollouts"
MAX_CLAIM_WAIT_S = 30.0
REPLY_WAIT_S = 2.0
PRUNE_EVERY_S = 3600.0


class RejectedEvent(Exception):
    """The fold refused the event (its reason is the message)."""


class OversizeRecordError(Exception):
    """A record over MAX_RECORD_BYTES: nothing it would produce fits the topics it feeds."""


def _oversize(record: ConsumerRecord[bytes, bytes], what: str) -> str:
    return (
        f"{what} of {len(record.value or b''):,} bytes, over the {MAX_RECORD_BYTES:,}-byte limit: keep task input "
        "and metadata small (store large payloads elsewhere and pass a reference)"
    )


class _States:
    """The rollouts' states by id. A queued rollout without attempts (the bulk of a long queue,
    idle until claimed) is held as its encoded state record instead of decoded objects (measured
    with ``benchmarks/processor_memory.py``); reading it decodes it and keeps the decoded state
    until it is compacted again. Such a rollout has no attempts, deadline or finish to index."""

    def __init__(self, codec: Codec) -> None:
        self._codec = codec
        self._held: dict[str, RolloutState | bytes] = {}

    def get(self, rollout_id: str) -> RolloutState | None:
        held = self._held.get(rollout_id)
        if held is None or isinstance(held, RolloutState):
            return held
        state = self._held[rollout_id] = self._codec.decode(held, RolloutState)
        return state

    def __getitem__(self, rollout_id: str) -> RolloutState:
        state = self.get(rollout_id)
        if state is None:
            raise KeyError(rollout_id)
        return state

    def __setitem__(self, rollout_id: str, state: RolloutState) -> None:
        self._held[rollout_id] = state

    def __contains__(self, rollout_id: object) -> bool:
        return rollout_id in self._held

    def __iter__(self) -> Iterator[str]:
        return iter(self._held)

    def __len__(self) -> int:
        return len(self._held)

    def decoded(self, rollout_id: str) -> RolloutState | None:
        """The state if it is held decoded (None if absent or compact: no attempts then)."""
        held = self._held.get(rollout_id)
        return held if isinstance(held, RolloutState) else None

    def discard(self, rollout_id: str) -> RolloutState | None:
        """Forget the rollout; returns its state if it was held decoded."""
        held = self._held.pop(rollout_id, None)
        return held if isinstance(held, RolloutState) else None

    def compact(self, state: RolloutState, encoded: bytes) -> None:
        """Hold ``state`` (``encoded``) compact when it is the rollout's current state, queued
        and without attempts."""
        rollout_id = state.rollout.rollout_id
        if state.rollout.status == "queuing" and not state.attempts and self._held.get(rollout_id) is state:
            self._held[rollout_id] = encoded


@dataclass
class _Answer:
    reply_to: str
    request_id: str
    outcome: ReplyOutcome
    rollout_id: str | None = None
    state: RolloutState | None = None
    error: str | None = None
    covered: list[int] = field(default_factory=list)


@dataclass
class _Batch:
    """What folding one fetch produced, sent in two phases by ``_send``."""

    touched: dict[str, RolloutState] = field(default_factory=dict)  # newest state per rollout
    # States in which an attempt finished, superseded later in the batch: written too, before
    # the newest, since readers act on the state an attempt finished in (the triplet builder).
    finishing: list[RolloutState] = field(default_factory=list)
    was_terminal: dict[str, bool] = field(default_factory=dict)  # before the batch, per touched rollout
    answers: list[_Answer] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)
    claims: list[_Claim] = field(default_factory=list)


@dataclass
class _Claim:
    request: StoreRequest
    partition: int
    offset: int


class RolloutProcessor:
    def __init__(self, settings: Settings, outbox: Outbox, replies: AIOKafkaProducer, codec: Codec) -> None:
        self.settings = settings
        self.fold_seconds = metrics.FOLD_SECONDS.labels(metrics.role())
        self.codec = codec
        self.outbox = outbox
        self.reply_producer = replies
        self.reply_topics = ReplyTopics(settings)
        self.replies_wire = ReplyEncoder(codec)
        self.events_topic = settings.topic("rollouts")
        self.state_topic = settings.topic("rollout-state")
        self.requests_topic = settings.topic("store-requests")
        self.retention_s = settings.finished_retention_s
        self.watchdog_interval_s = settings.watchdog_interval_s
        self.states = _States(codec)
        self.max_queued = settings.max_queued_per_partition or None
        # partition -> the highest agl.rollouts offset its recovered states folded: an enqueue at
        # or below it that left no rollout was refused before the restart.
        self.folded_through: dict[int, int] = {}
        self.partition_of: dict[str, int] = {}
        self.state_offset: dict[str, int] = {}  # newest state record's offset on agl.rollout-state
        self.deadlines: dict[str, float] = {}
        self.finished: dict[str, float] = {}
        # (finished time, rollout id), oldest first; entries whose time no longer matches
        # ``finished`` are stale and skipped, so forgetting costs O(log n) per rollout, not a
        # scan of every finished rollout per batch.
        self.finish_order: list[tuple[float, str]] = []
        self.attempts: dict[str, str] = {}  # attempt id -> rollout id (claims are recognised by it)
        # Claims served whose AttemptStarted has not come back through agl.rollouts yet:
        # attempt id -> rollout id. A claimer asking again meanwhile must not get a second rollout.
        self.claims_in_flight: dict[str, str] = {}
        self.queue: ClaimQueue[_Claim] = ClaimQueue()
        self.empty_listeners: set[str] = set()  # reply topics answered empty since the queue last had work
        self.owned: set[int] = set()
        self.catching_up: dict[int, int] = {}  # partition -> end of agl.rollouts at assignment
        self._next_watchdog = 0.0
        self._next_prune = time.monotonic() + PRUNE_EVERY_S
        self._pruning: asyncio.Task[list[str]] | None = None
        self.counts: dict[str, int] = defaultdict(int)
        self.consumer: AIOKafkaConsumer | None = None  # the skeleton's, for positions

    # -- assignment --------------------------------------------------------------------------

    async def assigned(self, partitions: set[TopicPartition]) -> None:
        mine = {tp.partition for tp in partitions if tp.topic == self.events_topic}
        new = mine - self.owned
        self.owned = mine
        if new:
            await self._recover(new)

    def revoked(self, partitions: set[TopicPartition]) -> None:
        gone = {tp.partition for tp in partitions if tp.topic == self.events_topic}
        for rollout_id in [r for r, p in self.partition_of.items() if p in gone]:
            self._untrack(rollout_id)
        # Claims served on those partitions are decided by their events (folded by the next
        # owner, which then recognises a copy of the claim).
        left = set(self.states)
        self.claims_in_flight = {a: r for a, r in self.claims_in_flight.items() if r in left}
        self.owned -= gone
        for p in gone:
            self.catching_up.pop(p, None)
            self.folded_through.pop(p, None)

    async def _recover(self, partitions: set[int]) -> None:
        """Read the changelog partitions to their end; note where agl.rollouts ends now."""
        consumer = AIOKafkaConsumer(
            **self.settings.kafka_client_options(),
            enable_auto_commit=False,
            isolation_level="read_committed",
            max_partition_fetch_bytes=8 << 20,
        )
        await consumer.start()
        try:
            states = [TopicPartition(self.state_topic, p) for p in sorted(partitions)]
            events = [TopicPartition(self.events_topic, p) for p in sorted(partitions)]
            consumer.assign(states)
            await consumer.seek_to_beginning(*states)
            ends = await consumer.end_offsets(states + events)
            for p in partitions:
                self.folded_through[p] = -1
            remaining = {tp for tp in states if ends[tp] > 0}
            while remaining:
                fetched = await consumer.getmany(*remaining, timeout_ms=1000, max_records=10_000)
                for tp, records in fetched.items():
                    for record in records:
                        self._recovered(record, tp.partition)
                for tp in list(remaining):
                    if await consumer.position(tp) >= ends[tp]:
                        remaining.discard(tp)
            for tp in events:
                self.catching_up[tp.partition] = ends[tp]
        finally:
            await consumer.stop()
        log.info("rollout states recovered", partitions=sorted(partitions), rollouts=len(self.states))

    def _recovered(self, record: ConsumerRecord[bytes, bytes], partition: int) -> None:
        rollout_id = (record.key or b"").decode(errors="replace")
        if record.value is None:
            self._untrack(rollout_id)
            return
        try:
            state = self.codec.decode(record.value, RolloutState)
        except CodecError as error:  # the sink dead-letters this topic's bad records
            log.warning(
                "undecodable state in the changelog", partition=partition, offset=record.offset, error=str(error)
            )
            return
        self._track(state, partition, record.offset)
        self.states.compact(state, record.value)
        if state.input_offset > self.folded_through.get(partition, -1):
            self.folded_through[partition] = state.input_offset

    # -- bookkeeping -------------------------------------------------------------------------

    def _track(self, state: RolloutState, partition: int, offset: int | None = None) -> None:
        rollout_id = state.rollout.rollout_id
        old = self.states.decoded(rollout_id)  # a compact one has no attempts to unindex
        self.states[rollout_id] = state
        self.partition_of[rollout_id] = partition
        if offset is not None:
            self.state_offset[rollout_id] = offset
        if old is not None:
            for attempt in old.attempts:
                self.attempts.pop(attempt.attempt_id, None)
        for attempt in state.attempts:
            self.attempts[attempt.attempt_id] = rollout_id
        deadline = next_deadline(state)
        if deadline is None:
            self.deadlines.pop(rollout_id, None)
        else:
            self.deadlines[rollout_id] = deadline
        if state.finished_time is not None:
            if self.finished.get(rollout_id) != state.finished_time:
                heapq.heappush(self.finish_order, (state.finished_time, rollout_id))
            self.finished[rollout_id] = state.finished_time
        else:
            self.finished.pop(rollout_id, None)
        if state.rollout.status in QUEUING_STATUSES:
            entered = state.rollout.start_time if state.rollout.status == "queuing" else state.cause_time
            self.queue.queued(rollout_id, entered, partition)
        else:
            self.queue.left(rollout_id)

    def _untrack(self, rollout_id: str) -> None:
        state = self.states.discard(rollout_id)
        if state is not None:
            for attempt in state.attempts:
                self.attempts.pop(attempt.attempt_id, None)
        self.partition_of.pop(rollout_id, None)
        self.state_offset.pop(rollout_id, None)
        self.deadlines.pop(rollout_id, None)
        self.finished.pop(rollout_id, None)
        self.queue.left(rollout_id)
        self.queue.release(rollout_id)

    # -- one batch ---------------------------------------------------------------------------

    async def handle(self, batch: Batch) -> None:
        started = time.monotonic()
        now = time.time()
        out = _Batch()
        # Forgotten before the batch is folded, so its events find them gone (unknown rollout).
        tombstones = self._forget(now)
        for tp, records in batch.items():
            if tp.topic == self.events_topic:
                for record in records:
                    self._fold(record, out)
                if tp.partition in self.catching_up and records[-1].offset + 1 >= self.catching_up[tp.partition]:
                    del self.catching_up[tp.partition]
        for tp, records in batch.items():
            if tp.topic == self.requests_topic:
                for record in records:
                    self._request(record, out)
        outgoing = self._serve_claims(out.claims, now, out.answers)
        self._notify_work(out.answers)
        self.fold_seconds.observe(time.monotonic() - started)
        await self._send(out, tombstones, outgoing)

    def _fold(self, record: ConsumerRecord[bytes, bytes], out: _Batch) -> None:
        if len(record.value or b"") > MAX_RECORD_BYTES:
            # Its state would be too large to write: refused here, where the DLQ can say why,
            # rather than failing every produce of the batch it lands in.
            out.rejected.append(Rejected.of(record, OversizeRecordError(_oversize(record, "a rollout event"))))
            return
        try:
            event = self.codec.decode(record.value or b"", RolloutEvent)
        except CodecError as error:
            out.rejected.append(Rejected.of(record, error))
            return
        reply_to, with_state = self.reply_topics.of(record.headers)
        if (record.key or b"").decode(errors="replace") != event.rollout_id:
            mismatch = RejectedEvent(f"key {record.key!r} is not the rollout id {event.rollout_id}")
            out.rejected.append(Rejected.of(record, mismatch))
            if reply_to:
                out.answers.append(_Answer(reply_to, event.event_id, "rejected", error=str(mismatch)))
            return
        rollout_id = event.rollout_id
        claimed_by: str | None = None  # our own claim event's attempt id: the rollout that has it, if any
        if event.writer == PROCESSOR and isinstance(event.payload, AttemptStarted):
            self.queue.release(rollout_id)  # our own claim is decided now, whatever the fold says
            attempt_id = event.payload.attempt.attempt_id
            self.claims_in_flight.pop(attempt_id, None)
            claimed_by = self.attempts.get(attempt_id)
            if claimed_by not in (None, rollout_id) or self.queue.was_answered_empty(event.event_id):
                # One claim served twice: a batch redone while the first serving's event was still
                # on its way (landed after the start-over's catch-up). The first folded is the
                # claim (its claimer heard of it then), or the claim was answered empty (its
                # claimer moved on); this rollout stays queued for the next claim.
                self.counts["claims_served_twice"] += 1
                return
        state = self.states.get(rollout_id)
        if state is not None and record.offset <= state.input_offset:
            # Applied before a crash: the writer may still wait for its answer.
            if reply_to:
                out.answers.append(
                    _Answer(reply_to, event.event_id, "applied", rollout_id, state if with_state else None)
                )
            return
        if claimed_by is not None:
            # The same claim served twice to the same rollout: folded once. The fold would refuse
            # the duplicate attempt and the claimer, told so, would claim anew and leave the
            # rollout to nobody if the first answer was lost.
            self.counts["claims_served_twice"] += 1
            return
        admission = None
        if state is None and isinstance(event.payload, RolloutEnqueued):
            partition = record.partition
            admission = Admission(
                partition,
                self.queue.queued_on(partition),
                self.max_queued,
                folded_before=record.offset <= self.folded_through.get(partition, -1),
            )
        result = fold(state, event, admission)
        if result.outcome == "rejected":
            if admission is not None and (result.error or "").startswith(QUEUE_FULL):
                self.counts["enqueues_refused"] += 1  # the queue of its partition is full
            refused = RejectedEvent(result.error or "rejected")
            if reply_to:  # the writer hears why and raises it: a DLQ copy would only pile up
                out.answers.append(_Answer(reply_to, event.event_id, "rejected", error=str(refused)))
            else:
                out.rejected.append(Rejected.of(record, refused))
            return
        if result.outcome == "ignored" or result.state is None:
            if reply_to and state is not None:
                out.answers.append(
                    _Answer(reply_to, event.event_id, "applied", rollout_id, state if with_state else None)
                )
            return
        update: dict[str, Any] = {"input_offset": record.offset}
        if reply_to and state is None:  # the enqueuer hears when its rollout finishes
            update["watchers"] = [reply_to]
        new_state = result.state.model_copy(update=update)
        if rollout_id not in out.was_terminal:
            out.was_terminal[rollout_id] = state is not None and state.rollout.status in TERMINAL_STATUSES
        previous = out.touched.get(rollout_id)
        if previous is not None and previous.cause_time != new_state.cause_time and finishes_an_attempt(previous):
            out.finishing.append(previous)
        out.touched[rollout_id] = new_state
        self._track(new_state, record.partition)
        if reply_to:
            out.answers.append(
                _Answer(reply_to, event.event_id, "applied", rollout_id, new_state if with_state else None)
            )

    def _request(self, record: ConsumerRecord[bytes, bytes], out: _Batch) -> None:
        if len(record.value or b"") > MAX_RECORD_BYTES:
            out.rejected.append(Rejected.of(record, OversizeRecordError(_oversize(record, "a store request"))))
            return
        try:
            request = self.codec.decode(record.value or b"", StoreRequest)
        except CodecError as error:
            out.rejected.append(Rejected.of(record, error))
            return
        if not self.reply_topics.valid(request.reply_to):
            out.rejected.append(
                Rejected.of(record, RejectedEvent(f"reply_to {request.reply_to!r} is not a reply topic"))
            )
            return
        if request.kind == "claim":
            self._claim_request(request, record, out)
            return
        rollout_id = request.rollout_id or ""
        state = self.states.get(rollout_id)
        if state is None or self.partition_of.get(rollout_id) != record.partition:
            out.answers.append(_Answer(request.reply_to, request.request_id, "unknown", rollout_id))
            return
        if request.reply_to not in state.watchers:
            state = state.model_copy(update={"watchers": [*state.watchers, request.reply_to]})
            out.was_terminal.setdefault(rollout_id, state.rollout.status in TERMINAL_STATUSES)
            out.touched[rollout_id] = state
            self._track(state, record.partition)
        out.answers.append(_Answer(request.reply_to, request.request_id, "applied", rollout_id, state))

    def _claim_request(self, request: StoreRequest, record: ConsumerRecord[bytes, bytes], out: _Batch) -> None:
        """A claim, or the same claim again: replayed after a crash, or sent again by a claimer
        whose answer was lost (a broker failing over). A claim is served once, whatever the
        number of copies: the attempt id is derived from the request id."""
        if self._decided(request, out.answers):
            return
        if any(c.request.request_id == request.request_id for c in out.claims) or any(
            w.request.request.request_id == request.request_id for w in self.queue.waiting
        ):
            return  # the same claim is already waiting or in this batch
        out.claims.append(_Claim(request, record.partition, record.offset))

    def _decided(self, request: StoreRequest, answers: list[_Answer]) -> bool:
        """Whether the claim was decided before (True: answered as it was, or to be), checked when
        it is read and again when it would be served or answered empty (it may have waited, or
        been read again after a start-over, while its claim event was folded).

        Served and folded: the claimer hears of the same rollout again (a copy nobody waits for
        is ignored by its client). Served, its event not folded yet: the answer goes out with
        that fold. Answered empty: empty again (its claimer moved on)."""
        attempt_id = claim_attempt_id(request.request_id)
        rollout_id = self.attempts.get(attempt_id)
        if rollout_id is not None:
            state = self.states[rollout_id]
            answers.append(_Answer(request.reply_to, request.request_id, "applied", rollout_id, state))
            return True
        if attempt_id in self.claims_in_flight:
            return True
        if self.queue.was_answered_empty(request.request_id):
            answers.append(_Answer(request.reply_to, request.request_id, "empty", covered=sorted(self.owned)))
            return True
        return False

    def _empty(self, request: StoreRequest, now: float, answers: list[_Answer]) -> None:
        """Answer the claim empty (nothing queued here), unless it was decided meanwhile; its
        client hears when work arrives (:meth:`_notify_work`), so it need not ask before."""
        if self._decided(request, answers):
            return
        self.queue.answered_empty(request.request_id, now)
        self.empty_listeners.add(request.reply_to)
        answers.append(_Answer(request.reply_to, request.request_id, "empty", covered=sorted(self.owned)))

    def _notify_work(self, answers: list[_Answer]) -> None:
        """Work is queued that no claim took: every client answered empty since the queue last had
        work gets one notice without a state naming the partitions (its polls stop skipping them)."""
        if self.empty_listeners and len(self.queue) > 0:
            covered = sorted(self.owned)
            answers.extend(_Answer(topic, "", "notice", covered=covered) for topic in sorted(self.empty_listeners))
            self.empty_listeners.clear()

    def _serve_claims(self, claims: list[_Claim], now: float, answers: list[_Answer]) -> list[Record]:
        """Claim events for agl.rollouts; waiting or empty claims otherwise."""
        events: list[Record] = []
        if self.catching_up:
            # Claim events written before a restart (or a start-over after a failed batch) must be
            # folded first, and until then no claim is answered, not even empty at its deadline: a
            # claim read again may have one among them, and an empty answer would send its claimer
            # away from the rollout that event gives it (left 'preparing' under nobody).
            for claim in claims:
                self.queue.wait(claim, now + self._wait_of(claim.request, now))
            return events
        for claim in self.queue.expired(now):
            self._empty(claim.request, now, answers)
        waiting = list(self.queue.waiting)
        self.queue.waiting.clear()
        for claim in [w.request for w in waiting] + claims:
            if self._decided(claim.request, answers):
                continue
            rollout_id = self.queue.take()
            if rollout_id is not None:
                events.append(self._claim_event(claim.request, rollout_id, now))
                continue
            wait = self._wait_of(claim.request, now)
            if wait > 0:
                deadline = next((w.deadline for w in waiting if w.request is claim), now + wait)
                self.queue.wait(claim, deadline)
            else:
                self._empty(claim.request, now, answers)
        return events

    @staticmethod
    def _wait_of(request: StoreRequest, now: float) -> float:
        # Time spent in transit counts against the wait; a stale replayed request waits not at all.
        waited = max(0.0, now - request.time) if request.time <= now + 5 else 0.0
        return max(0.0, min(request.wait_seconds, MAX_CLAIM_WAIT_S) - waited)

    def _claim_event(self, request: StoreRequest, rollout_id: str, now: float) -> Record:
        state = self.states[rollout_id]
        self.claims_in_flight[claim_attempt_id(request.request_id)] = rollout_id
        attempt = Attempt(
            rollout_id=rollout_id,
            attempt_id=claim_attempt_id(request.request_id),
            sequence_id=len(state.attempts) + 1,
            start_time=now,
            worker_id=request.worker_id,
        )
        event = RolloutEvent(
            event_id=request.request_id,
            rollout_id=rollout_id,
            time=now,
            writer=PROCESSOR,
            payload=AttemptStarted(attempt=attempt, worker_id=request.worker_id, manual=False),
        )
        # The claimer's reply topic travels as the event's header, like any writer's.
        return Record(
            self.events_topic,
            rollout_id.encode(),
            self.codec.encode(event),
            self.partition_of[rollout_id],
            [(REPLY_HEADER, request.reply_to.encode()), (REPLY_STATE_HEADER, b"1")],
        )

    def _forget(self, now: float) -> list[Record]:
        """Tombstones for finished rollouts past their retention."""
        out: list[Record] = []
        order = self.finish_order
        while order and order[0][0] < now - self.retention_s:
            finished, rollout_id = heapq.heappop(order)
            if self.finished.get(rollout_id) != finished:
                continue  # reopened, finished again later, or untracked since
            partition = self.partition_of[rollout_id]
            self._untrack(rollout_id)
            out.append(Record(self.state_topic, rollout_id.encode(), None, partition))
        if len(order) > 2 * len(self.finished) + 1024:  # mostly stale entries: rebuild
            self.finish_order = [(t, rid) for rid, t in self.finished.items()]
            heapq.heapify(self.finish_order)
        return out

    async def _send(self, out: _Batch, tombstones: list[Record], outgoing: list[Record]) -> None:
        touched, was_terminal, answers = out.touched, out.was_terminal, out.answers
        ids = list(touched)
        encoded = [self.codec.encode(touched[rid]) for rid in ids]
        finishing = [
            Record(self.state_topic, rid.encode(), self.codec.encode(state), self.partition_of[rid])
            for state in out.finishing
            for rid in [state.rollout.rollout_id]
        ]
        states = finishing + [
            Record(self.state_topic, rid.encode(), value, self.partition_of[rid])
            for rid, value in zip(ids, encoded, strict=True)
        ]
        # Tombstones first: a rollout forgotten and enqueued again in one batch ends up present.
        await self.outbox.reject(out.rejected)  # rare (bad input): its own round trip
        sent = await self.outbox.send_all(tombstones + states + outgoing)
        for rid, meta in zip(ids, sent[len(tombstones) + len(finishing) :], strict=False):
            self.state_offset[rid] = meta.offset
        for rid, value in zip(ids, encoded, strict=True):
            self.states.compact(touched[rid], value)
        # Answers that carry a state this batch wrote reuse its bytes (most of them do).
        bodies = {
            id(touched[rid]): self.replies_wire.state_body(value) for rid, value in zip(ids, encoded, strict=True)
        }
        notices = [
            _Answer(watcher, "", "notice", rid, state)
            for rid, state in touched.items()
            if state.rollout.status in TERMINAL_STATUSES and not was_terminal.get(rid, False)
            for watcher in state.watchers
        ]
        await self._reply(answers + notices, bodies)

    async def _reply(self, answers: list[_Answer], bodies: dict[int, bytes] | None = None) -> None:
        """Phase two: each answer on its writer's topic; a topic that is gone loses its answers.

        Waits a bounded time for the acknowledgements: a writer that vanished (its topic deleted
        a moment ago) must not hold up everyone else's answers; slow sends finish in the
        background and their failures are counted.
        """
        if not answers:
            return
        bodies = {} if bodies is None else bodies
        await self.reply_topics.refresh({a.reply_to for a in answers})
        deliveries = []
        for answer in answers:
            if not self.reply_topics.exists(answer.reply_to):
                self.counts["replies_to_missing_topics"] += 1
                continue
            rid = answer.rollout_id
            body = None
            if answer.state is not None:
                body = bodies.get(id(answer.state))
                if body is None:  # an intermediate state of the batch: encoded once
                    body = bodies[id(answer.state)] = self.replies_wire.state_body(self.codec.encode(answer.state))
            value = self.replies_wire.encode(
                answer.request_id,
                answer.outcome,
                state_body=body,
                error=answer.error,
                state_partition=self.partition_of.get(rid, -1) if rid and rid in self.state_offset else -1,
                state_offset=self.state_offset.get(rid, -1) if rid else -1,
                covered_partitions=answer.covered,
            )
            deliveries.append(asyncio.create_task(self._deliver(answer.reply_to, value)))
        if deliveries:
            await asyncio.wait(deliveries, timeout=REPLY_WAIT_S)
            metrics.count_out(self.settings.topic("replies"), len(deliveries))  # one label for all clients

    async def _deliver(self, topic: str, value: bytes) -> None:
        try:
            await (await self.reply_producer.send(topic, value))
        except KafkaError as error:
            self.counts["replies_failed"] += 1
            self.reply_topics.gone(topic)
            log.warning("a reply could not be delivered", topic=topic, error=str(error))

    # -- timers ------------------------------------------------------------------------------

    async def _prune(self) -> list[str]:
        try:
            deleted = await prune_reply_topics(self.settings)
        except Exception as error:
            log.warning("pruning reply topics failed", error=str(error))
            return []
        if deleted:
            log.info("reply topics of gone clients deleted", count=len(deleted))
        return deleted

    async def _caught_up(self) -> None:
        """Partitions whose agl.rollouts position reached the end noted at assignment."""
        if not self.catching_up or self.consumer is None:
            return
        owned = self.consumer.assignment()
        for partition, end in list(self.catching_up.items()):
            tp = TopicPartition(self.events_topic, partition)
            if tp not in owned or await self.consumer.position(tp) >= end:
                del self.catching_up[partition]

    def poll_timeout(self) -> float:
        now = time.time()
        until = [0.5, self._next_watchdog - now]
        deadline = None if self.catching_up else self.queue.next_deadline()  # none answered meanwhile
        if deadline is not None:
            until.append(deadline - now)
        return max(0.001, min(until))

    async def tick(self) -> None:
        await self._caught_up()
        if time.monotonic() >= self._next_prune and (self._pruning is None or self._pruning.done()):
            # In the background: reply topics of clients killed without closing.
            self._next_prune = time.monotonic() + PRUNE_EVERY_S
            self._pruning = asyncio.create_task(self._prune())
        now = time.time()
        if not self.catching_up:  # until caught up, no claim is answered (``_serve_claims``)
            answers: list[_Answer] = []
            for claim in self.queue.expired(now):
                self._empty(claim.request, now, answers)
            await self._reply(answers)
        if now < self._next_watchdog:
            return
        self._next_watchdog = now + self.watchdog_interval_s
        events = []
        for rollout_id, deadline in list(self.deadlines.items()):
            state = self.states.get(rollout_id)
            if deadline > now or state is None:
                continue
            for verdict in due_verdicts(state, now):
                event = RolloutEvent(
                    event_id=new_event_id(), rollout_id=rollout_id, time=now, writer=PROCESSOR, payload=verdict
                )
                events.append(Record(self.events_topic, rollout_id.encode(), self.codec.encode(event)))
            # Until the verdict is folded, don't send it again on the next tick.
            self.deadlines[rollout_id] = now + max(self.watchdog_interval_s * 4, 1.0)
        if events:
            await self.outbox.send_all(events)
            log.info("watchdog verdicts", count=len(events))


async def run(settings: Settings, stop: asyncio.Event) -> None:
    codec = Codec.default()
    # Replies go to writers' own topics; one that vanished must not hold up the batch for long.
    # Not idempotent: a topic deleted under a pending send must fail that send, not the producer,
    # and a duplicate answer is harmless (the writer takes the first).
    replies = make_producer(settings, linger_ms=1, request_timeout_ms=5000, enable_idempotence=False)
    async with Outbox.started(settings, PROCESSOR, codec, linger_ms=1) as outbox:
        await replies.start()
        processor = RolloutProcessor(settings, outbox, replies, codec)
        try:
            await run_processor(
                settings,
                processor,
                name=PROCESSOR,
                topics=[settings.topic("rollouts"), settings.topic("store-requests")],
                stop=stop,
                ready_as="processor",
                on_start=lambda consumer: setattr(processor, "consumer", consumer),
            )
        finally:
            if processor._pruning is not None:
                processor._pruning.cancel()
            await processor.reply_topics.close()
            await replies.stop()


def main(settings: Settings) -> None:
    """Run the processor in the foreground until SIGTERM/SIGINT."""

    run_until_stopped(lambda stop: run(settings, stop))
