"""The rollout processor's pure core: what one instance holds, and what it decides for a batch.
Its Kafka shell, ``processors/rollouts.py``, decodes the records of a fetch, hands them to
:class:`RolloutCore` and writes what comes back. No I/O and no clock (times are arguments).

Memory and admission: every rollout the processor holds is in memory until it finished and its
retention passed. A rollout that waits in the queue unclaimed and has no attempt yet is held as
its encoded state record (:class:`States`; a fifth of the memory of its decoded objects), decoded
when something touches it. The queue of each partition is bounded (``Settings.max_queued_per_partition``):
the fold refuses an enqueue past it (``agl_stream.domain.queue.Admission``), counted per partition
from that partition's states so that a replay after a restart, or the next owner after a
rebalance, reaches the same answer; an enqueue at or below the offset the recovered states of its
partition cover (``folded_through``) that left no rollout was refused then and is refused again.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

from agl_stream.domain.fold import fold
from agl_stream.domain.queue import QUEUE_FULL, Admission, ClaimQueue, claim_attempt_id
from agl_stream.domain.trace_collector import finishes_an_attempt
from agl_stream.domain.watchdog import due_verdicts, next_deadline
from agl_stream.ids import new_event_id
from agl_stream.models import Attempt, AttemptStarted, RolloutEnqueued, RolloutEvent, RolloutState, StoreRequest
from agl_stream.models.base import QUEUING_STATUSES, TERMINAL_STATUSES, stored_seconds
from agl_stream.models.replies import ReplyOutcome
from agl_stream.wire.codec import Codec

PROCESSOR = "processor.rollouts"
"""The writer of the processor's own events (claims, watchdog verdicts) and its DLQ records."""
MAX_CLAIM_WAIT_S = 30.0


class States:
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
class Answer:
    """A reply for one writer's topic: to its event or request, or a notice (no request id)."""

    reply_to: str
    request_id: str
    outcome: ReplyOutcome
    rollout_id: str | None = None
    state: RolloutState | None = None
    error: str | None = None
    covered: list[int] = field(default_factory=list)


@dataclass
class Folded:
    """What folding one fetch produced, sent in two phases by the shell."""

    touched: dict[str, RolloutState] = field(default_factory=dict)  # newest state per rollout
    # States in which an attempt finished, superseded later in the batch: written too, before
    # the newest, since readers act on the state an attempt finished in (the triplet builder).
    finishing: list[RolloutState] = field(default_factory=list)
    was_terminal: dict[str, bool] = field(default_factory=dict)  # before the batch, per touched rollout
    answers: list[Answer] = field(default_factory=list)
    claims: list[StoreRequest] = field(default_factory=list)

    def touch(self, state: RolloutState, before: RolloutState | None) -> None:
        """``state`` is the rollout's newest; ``before``, its state before this change."""
        rollout_id = state.rollout.rollout_id
        self.was_terminal.setdefault(rollout_id, before is not None and before.rollout.status in TERMINAL_STATUSES)
        self.touched[rollout_id] = state

    def notices(self) -> list[Answer]:
        """A notice to every watcher of a rollout that finished in the batch."""
        return [
            Answer(watcher, "", "notice", rid, state)
            for rid, state in self.touched.items()
            if state.rollout.status in TERMINAL_STATUSES and not self.was_terminal.get(rid, False)
            for watcher in state.watchers
        ]


class RolloutCore:
    """The states of the rollouts of the partitions one processor owns, their indexes, its claims
    and the decisions of one batch on decoded events and requests."""

    def __init__(self, codec: Codec, *, retention_s: float, watchdog_interval_s: float, max_queued: int | None) -> None:
        self.codec = codec
        self.retention_s = retention_s
        self.watchdog_interval_s = watchdog_interval_s
        self.states = States(codec)
        self.max_queued = max_queued
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
        self.queue: ClaimQueue[StoreRequest] = ClaimQueue()
        self.empty_listeners: set[str] = set()  # reply topics answered empty since the queue last had work
        self.owned: set[int] = set()
        self.catching_up: dict[int, int] = {}  # partition -> end of agl.rollouts at assignment
        self.counts: dict[str, int] = defaultdict(int)

    # -- partitions ----------------------------------------------------------------------------

    def drop_partitions(self, gone: set[int]) -> None:
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

    def recovered(self, state: RolloutState, encoded: bytes, partition: int, offset: int) -> None:
        """A state record of the changelog, read back at assignment."""
        self._track(state, partition, offset)
        self.states.compact(state, encoded)
        if state.input_offset > self.folded_through.get(partition, -1):
            self.folded_through[partition] = state.input_offset

    def _track(self, state: RolloutState, partition: int, offset: int | None = None) -> None:
        rollout_id = state.rollout.rollout_id
        old = self.states.decoded(rollout_id)  # a compact one has no attempts to unindex
        self.states[rollout_id] = state
        self.partition_of[rollout_id] = partition
        if offset is not None:
            self.state_offset[rollout_id] = offset
        self._unindex_attempts(old)
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

    def _unindex_attempts(self, state: RolloutState | None) -> None:
        for attempt in state.attempts if state is not None else []:
            self.attempts.pop(attempt.attempt_id, None)

    def _untrack(self, rollout_id: str) -> None:
        self._unindex_attempts(self.states.discard(rollout_id))
        self.partition_of.pop(rollout_id, None)
        self.state_offset.pop(rollout_id, None)
        self.deadlines.pop(rollout_id, None)
        self.finished.pop(rollout_id, None)
        self.queue.left(rollout_id)
        self.queue.release(rollout_id)

    def forget(self, now: float) -> list[tuple[str, int]]:
        """Untrack finished rollouts past their retention: (rollout id, partition) of each."""
        out: list[tuple[str, int]] = []
        order = self.finish_order
        while order and order[0][0] < now - self.retention_s:
            finished, rollout_id = heapq.heappop(order)
            if self.finished.get(rollout_id) != finished:
                continue  # reopened, finished again later, or untracked since
            out.append((rollout_id, self.partition_of[rollout_id]))
            self._untrack(rollout_id)
        if len(order) > 2 * len(self.finished) + 1024:  # mostly stale entries: rebuild
            self.finish_order = [(t, rid) for rid, t in self.finished.items()]
            heapq.heapify(self.finish_order)
        return out

    # -- one batch -----------------------------------------------------------------------------

    def fold_event(
        self, event: RolloutEvent, partition: int, offset: int, reply_to: str | None, with_state: bool, out: Folded
    ) -> str | None:
        """Fold an event of agl.rollouts read at ``partition``/``offset``; ``reply_to``: the
        writer's topic, if it waits (``with_state``: for the state too). Returns why the event is
        dead-lettered when it is refused and nobody waits to hear it."""
        rollout_id = event.rollout_id
        # Our own claim event: the attempt it starts.
        claim = event.payload if event.writer == PROCESSOR and isinstance(event.payload, AttemptStarted) else None

        def applied(state: RolloutState | None) -> None:
            if reply_to:
                answer = Answer(reply_to, event.event_id, "applied", rollout_id, state if with_state else None)
                if claim is not None:
                    self._claim_served(answer)
                out.answers.append(answer)

        claimed_by: str | None = None  # our own claim event's attempt id: the rollout that has it, if any
        if claim is not None:
            self.queue.release(rollout_id)  # our own claim is decided now, whatever the fold says
            attempt_id = claim.attempt.attempt_id
            self.claims_in_flight.pop(attempt_id, None)
            claimed_by = self.attempts.get(attempt_id)
            if claimed_by not in (None, rollout_id) or self.queue.was_answered_empty(event.event_id):
                # One claim served twice: a batch redone while the first serving's event was still
                # on its way (landed after the start-over's catch-up). The first folded is the
                # claim (its claimer heard of it then), or the claim was answered empty (its
                # claimer moved on); this rollout stays queued for the next claim.
                self.counts["claims_served_twice"] += 1
                return None
        state = self.states.get(rollout_id)
        if state is not None and offset <= state.input_offset:
            applied(state)  # applied before a crash: the writer may still wait for its answer
            return None
        if claimed_by is not None:
            # The same claim served twice to the same rollout: folded once. The fold would refuse
            # the duplicate attempt and the claimer, told so, would claim anew and leave the
            # rollout to nobody if the first answer was lost.
            self.counts["claims_served_twice"] += 1
            return None
        admission = None
        if state is None and isinstance(event.payload, RolloutEnqueued):
            folded_before = offset <= self.folded_through.get(partition, -1)
            admission = Admission(partition, self.queue.queued_on(partition), self.max_queued, folded_before)
        result = fold(state, event, admission)
        if result.outcome == "rejected":
            if admission is not None and (result.error or "").startswith(QUEUE_FULL):
                self.counts["enqueues_refused"] += 1  # the queue of its partition is full
            if reply_to:  # the writer hears why and raises it: a DLQ copy would only pile up
                out.answers.append(Answer(reply_to, event.event_id, "rejected", error=result.error or "rejected"))
                return None
            return result.error or "rejected"
        if result.outcome == "ignored" or result.state is None:
            if state is not None:
                applied(state)
            return None
        # The fold built this state for this call and nothing else holds it: set, not copied
        # (a model_copy per event was about a tenth of the processor's work on an enqueue).
        new_state = result.state
        new_state.input_offset = offset
        if reply_to and state is None:  # the enqueuer hears when its rollout finishes
            new_state.watchers = [reply_to]
        previous = out.touched.get(rollout_id)
        if previous is not None and previous.cause_time != new_state.cause_time and finishes_an_attempt(previous):
            out.finishing.append(previous)
        out.touch(new_state, state)
        self._track(new_state, partition)
        applied(new_state)
        return None

    def take_request(self, request: StoreRequest, partition: int, out: Folded) -> None:
        """A store request read at ``partition``: a claim, or a watch of a rollout held there."""
        if request.kind == "claim":
            self._claim_request(request, out)
            return
        rollout_id = request.rollout_id or ""
        state = self.states.get(rollout_id)
        if state is None or self.partition_of.get(rollout_id) != partition:
            out.answers.append(Answer(request.reply_to, request.request_id, "unknown", rollout_id))
            return
        if request.reply_to not in state.watchers:
            watched = state.model_copy(update={"watchers": [*state.watchers, request.reply_to]})
            out.touch(watched, state)
            self._track(watched, partition)
            state = watched
        out.answers.append(Answer(request.reply_to, request.request_id, "applied", rollout_id, state))

    def _claim_request(self, request: StoreRequest, out: Folded) -> None:
        """A claim, or the same claim again: replayed after a crash, or sent again by a claimer
        whose answer was lost (a broker failing over). A claim is served once, whatever the
        number of copies: the attempt id is derived from the request id."""
        if self._decided(request, out.answers):
            return
        if any(c.request_id == request.request_id for c in out.claims) or any(
            w.request.request_id == request.request_id for w in self.queue.waiting
        ):
            return  # the same claim is already waiting or in this batch
        out.claims.append(request)

    def _decided(self, request: StoreRequest, answers: list[Answer]) -> bool:
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
            answers.append(Answer(request.reply_to, request.request_id, "applied", rollout_id, state))
            return True
        if attempt_id in self.claims_in_flight:
            return True
        if self.queue.was_answered_empty(request.request_id):
            answers.append(Answer(request.reply_to, request.request_id, "empty", covered=sorted(self.owned)))
            return True
        return False

    def _empty(self, request: StoreRequest, now: float, answers: list[Answer]) -> None:
        """Answer the claim empty (nothing queued here), unless it was decided meanwhile; its
        client hears when work arrives (:meth:`notify_work`), so it need not ask before."""
        if self._decided(request, answers):
            return
        self.queue.answered_empty(request.request_id, now)
        self.empty_listeners.add(request.reply_to)
        answers.append(Answer(request.reply_to, request.request_id, "empty", covered=sorted(self.owned)))

    def _claim_served(self, answer: Answer) -> None:
        """A claim's answer with its rollout also says when that emptied the queue, as an empty
        answer does: the claimer's other idle runners skip these partitions (no claim each to
        learn it) until the notice that work was queued (:meth:`notify_work`)."""
        if len(self.queue) == 0:
            answer.covered = sorted(self.owned)
            self.empty_listeners.add(answer.reply_to)

    def expire_claims(self, now: float, answers: list[Answer]) -> None:
        """Answer the waiting claims whose wait is over empty."""
        for request in self.queue.expired(now):
            self._empty(request, now, answers)

    def notify_work(self, answers: list[Answer]) -> None:
        """Work is queued that no claim took: every client answered empty since the queue last had
        work gets one notice without a state naming the partitions (its polls stop skipping them)."""
        if self.empty_listeners and len(self.queue) > 0:
            covered = sorted(self.owned)
            answers.extend(Answer(topic, "", "notice", covered=covered) for topic in sorted(self.empty_listeners))
            self.empty_listeners.clear()

    def serve_claims(self, out: Folded, now: float) -> list[tuple[RolloutEvent, str]]:
        """Claim events for agl.rollouts, each with its claimer's reply topic; waiting or empty
        claims otherwise."""
        events: list[tuple[RolloutEvent, str]] = []
        claims, answers = out.claims, out.answers
        if self.catching_up:
            # Claim events written before a restart (or a start-over after a failed batch) must be
            # folded first, and until then no claim is answered, not even empty at its deadline: a
            # claim read again may have one among them, and an empty answer would send its claimer
            # away from the rollout that event gives it (left 'preparing' under nobody).
            for claim in claims:
                self.queue.wait(claim, now + self._wait_of(claim, now))
            return events
        self.expire_claims(now, answers)
        waiting = list(self.queue.waiting)
        self.queue.waiting.clear()
        for claim in [w.request for w in waiting] + claims:
            if self._decided(claim, answers):
                continue
            rollout_id = self.queue.take()
            if rollout_id is not None:
                events.append((self._claim_event(claim, rollout_id, now), claim.reply_to))
                continue
            wait = self._wait_of(claim, now)
            if wait > 0:
                deadline = next((w.deadline for w in waiting if w.request is claim), now + wait)
                self.queue.wait(claim, deadline)
            else:
                self._empty(claim, now, answers)
        return events

    @staticmethod
    def _wait_of(request: StoreRequest, now: float) -> float:
        # Time spent in transit counts against the wait; a stale replayed request waits not at all.
        waited = max(0.0, now - request.time) if request.time <= now + 5 else 0.0
        return max(0.0, min(request.wait_seconds, MAX_CLAIM_WAIT_S) - waited)

    def _claim_event(self, request: StoreRequest, rollout_id: str, now: float) -> RolloutEvent:
        sequence_id = len(self.states[rollout_id].attempts) + 1
        attempt_id = claim_attempt_id(request.request_id)
        self.claims_in_flight[attempt_id] = rollout_id
        attempt = Attempt(
            rollout_id=rollout_id,
            attempt_id=attempt_id,
            sequence_id=sequence_id,
            start_time=now,
            worker_id=request.worker_id,
        )
        payload = AttemptStarted(attempt=attempt, worker_id=request.worker_id, manual=False)
        return RolloutEvent(
            event_id=request.request_id, rollout_id=rollout_id, time=now, writer=PROCESSOR, payload=payload
        )

    def watchdog_events(self, now: float) -> list[RolloutEvent]:
        """The watchdog's verdicts on every rollout whose deadline passed.

        Judged at ``now`` as the events will carry it (to the microsecond), the time the fold
        re-checks them at: judged at the unrounded time, a verdict due by less than half a
        microsecond would be folded as not yet due and ignored.
        """
        now = stored_seconds(now)
        events = []
        for rollout_id, deadline in list(self.deadlines.items()):
            state = self.states.get(rollout_id)
            if deadline > now or state is None:
                continue
            events += [
                RolloutEvent(
                    event_id=new_event_id(), rollout_id=rollout_id, time=now, writer=PROCESSOR, payload=verdict
                )
                for verdict in due_verdicts(state, now)
            ]
            # Until the verdict is folded, don't send it again on the next tick.
            self.deadlines[rollout_id] = now + max(self.watchdog_interval_s * 4, 1.0)
        return events
