"""The store client: Agent Lightning's LightningStore API over Kafka and ClickHouse.

Concurrency model: one client per event loop; its coroutines may run concurrently (many
runner coroutines share one client), and nothing in it is thread-safe.

Writes append events (agl.rollouts, agl.spans, agl.resources, agl.workers) with ids made here
(``writes.py``). A write whose return value needs folded state waits for the processor's answer
on the client's own reply topic (``replies.py``): the rollout's new state, or a rejection (a
ValueError with the reason). Claims are store requests the processor answers with the oldest
queued rollout of the partitions it owns. Reads go to ClickHouse (through the gateway, or
directly to a server) behind an offset fence: the newest offsets this client wrote or was
answered with, so a client always reads its writes (``reads.py``). What the processor tells a
client unasked is in ``notices.py``; the worker records a client writes, in ``workers.py``.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from aiokafka import AIOKafkaProducer

from agl_stream.config import Settings, load_settings
from agl_stream.domain.fold import latest_attempt, may_queue
from agl_stream.domain.queue import claim_attempt_id
from agl_stream.errors import AglError
from agl_stream.ids import new_attempt_id, new_event_id, new_resources_id, new_rollout_id
from agl_stream.kafka.io import Outbox, make_producer
from agl_stream.logs import describe, get_logger
from agl_stream.models import (
    AglModel,
    Attempt,
    AttemptHeartbeat,
    AttemptStarted,
    AttemptUpdated,
    ResourcesUpdate,
    Rollout,
    RolloutConfig,
    RolloutEnqueued,
    RolloutState,
    RolloutUpdated,
    Span,
    SpanSequenceRequested,
    StoreRequest,
    Worker,
)
from agl_stream.models.base import AttemptStatus, RolloutMode, RolloutStatus
from agl_stream.models.replies import Reply
from agl_stream.models.rollouts import WORKER_STOPPED
from agl_stream.store.notices import ClaimQueues, FinishedRollouts
from agl_stream.store.reads import StoreReads
from agl_stream.store.readside import ReadSide
from agl_stream.store.replies import REPLY_HEADER, REPLY_STATE_HEADER, RejectedError, ReplyChannel
from agl_stream.store.resources_cache import ResourcesCache, snapshot
from agl_stream.store.types import UNSET, AttemptedRollout, EnqueueRolloutRequest, StoreCapabilities, Unset, given
from agl_stream.store.workers import WorkerBook
from agl_stream.store.writes import Events, StoreWrites, heartbeats
from agl_stream.wire.codec import Codec

log = get_logger("agl.store")

CLAIM_SENDS = 3
"""Copies of one claim a client sends, each after the last went unanswered for its timeout."""


def _attempt(state: RolloutState, attempt_id: str | None = None) -> Attempt:
    """The attempt of ``state`` with this id (the latest for None)."""
    found = (
        latest_attempt(state) if attempt_id is None else next(a for a in state.attempts if a.attempt_id == attempt_id)
    )
    assert found is not None
    return found


def _attempted(state: RolloutState, attempt_id: str | None = None) -> AttemptedRollout:
    return AttemptedRollout(**state.rollout.model_dump(), attempt=_attempt(state, attempt_id))


class AglStore(StoreReads):
    """An async LightningStore. Use ``async with agl_stream.connect() as store: ...``."""

    def __init__(
        self, settings: Settings, *, request_timeout: float | None = None, read_side: ReadSide | None = None
    ) -> None:
        """``read_side``: where reads go instead of the one the settings name (the gateway gives its
        store client the engine in its own process: no HTTP round trip to itself)."""
        super().__init__(settings, read_side)
        self.request_timeout = request_timeout if request_timeout is not None else settings.request_timeout_s
        self.codec = Codec.default()
        self.writer = f"client-{uuid.uuid4().hex[:12]}"
        self._producer: AIOKafkaProducer = make_producer(settings)
        self._records = Outbox(settings, self._producer, self.writer, self.codec)
        self._replies = ReplyChannel(settings, self.writer, self.codec)
        self._replies.send_keepalive = self._producer.send_and_wait
        self._reply_header = [(REPLY_HEADER, self._replies.topic.encode())]
        self._state_header = [*self._reply_header, (REPLY_STATE_HEADER, b"1")]
        self._writes = StoreWrites(settings, self._records, self._replies, self.writer, self._note)
        self._workers = WorkerBook(self._writes)
        self._finished = FinishedRollouts()
        self._queues = ClaimQueues()
        self._replies.on_state = self._on_state
        self._replies.on_queue = self._queues.on_queue
        # Rollouts with heartbeats sent without waiting for their fold (rollout id -> attempt
        # id): no answer has raised the read fence past them yet. Any later answer about the
        # rollout does (the processor folds a rollout's events in order); a read of rollout
        # state before that asks first (_settle).
        self._unfolded: dict[str, str] = {}
        # Resources by id come from agl.resources itself, started on first use: the ClickHouse
        # copy has its API keys redacted (anyone with SQL access reads that table).
        self._resources = ResourcesCache(settings, self.codec)

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> AglStore:
        """Connect: the producer, this client's reply topic and the read side. ``async with``
        calls it; every other method needs a started store."""
        await self._producer.start()
        try:
            await self._replies.start()
            await self._start_reads()
        except BaseException:
            await self._producer.stop()
            raise
        return self

    async def close(self) -> None:
        """Disconnect; what was written and acknowledged stays written."""
        # Idle-worker records in flight are bookkeeping of claims already answered: let them land.
        await self._workers.landed()
        await self._resources.stop()
        await self._replies.stop()
        await self._close_reads()
        await self._producer.stop()

    async def __aenter__(self) -> AglStore:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def capabilities(self) -> StoreCapabilities:
        """What this client offers, as the seed's stores describe themselves: safe to share
        between coroutines of one event loop, not between threads."""
        return StoreCapabilities(thread_safe=False, async_safe=True, zero_copy=False, otlp_traces=False)

    # -- the write path --------------------------------------------------------------------

    async def _request(self, rollout_id: str, payload: AglModel) -> RolloutState:
        """Append an event and wait for the processor's verdict: the new state, or ValueError."""
        [state] = await self._request_many([(rollout_id, payload)])
        return state

    async def _request_many(self, events: Events) -> list[RolloutState]:
        """Append events in order (one produce batch), then wait for every answer with its state
        (the first rejection raises)."""
        states = []
        for answer in await self._submit(events, with_state=True):
            assert answer.state is not None, f"an answer without a state to {answer.request_id}"
            states.append(answer.state)
        return states

    async def _acknowledged(self, events: Events) -> None:
        """Append events and wait until the processor applied them all (ValueError on the first
        rejection); the answers carry no state, which spares encoding and decoding it."""
        await self._submit(events, with_state=False)

    async def _submit(self, events: Events, *, with_state: bool) -> list[Reply]:
        if not events:
            return []
        # An event of ours that may queue work (an enqueue, a retry): our next poll asks, whatever
        # the processor's notice and the answer to this event race to. Others leave what the
        # polls know alone (a runner finishing its attempt must not send every idle runner of
        # its client to ask an empty queue).
        if any(may_queue(payload) for _, payload in events):
            self._queues.ask_all()
        headers = self._state_header if with_state else self._reply_header
        answers = await self._writes.submit(events, headers, self.request_timeout)
        for rollout_id, payload in events:
            self._unfolded.pop(rollout_id, None)
            if isinstance(payload, RolloutEnqueued):
                self._finished.watching(rollout_id)  # the enqueuer hears when it finishes
        return answers

    async def _settle(self, sources: Sequence[str], key: str | None = None) -> None:
        """Reads of rollout state see the effect of heartbeats sent without waiting (spans'
        arrival turns a preparing attempt running): one heartbeat per such rollout, this time
        answered, raises the fence past them. The runner's usual path (spans, then finishing
        the attempt) never gets here: finishing is answered and settles the rollout. Reads of
        workers wait for this client's idle-worker records in flight (an empty claim answered
        before its record was written)."""
        if "workers" in sources:
            await self._workers.landed()
        pending: list[tuple[str, str]] = []
        if "rollout-state" in sources:
            if key is None:
                pending = list(self._unfolded.items())
            elif key in self._unfolded:  # a read of one rollout: only its own heartbeats matter
                pending = [(key, self._unfolded[key])]
        if pending:
            try:
                await self._acknowledged([(rid, AttemptHeartbeat(attempt_id=aid)) for rid, aid in pending])
            except RejectedError:
                pass  # a rollout finished and forgotten by the processor: its final state is long applied
            for rid, _ in pending:
                self._unfolded.pop(rid, None)

    def _on_state(self, reply: Reply) -> None:
        """Every state the processor sent us: finished rollouts are remembered for wait_for_rollouts."""
        assert reply.state is not None
        if self._finished.heard(reply.state.rollout):
            self._writes.note_answer(reply)

    async def _pinned_resources(self, resources_id: str | None) -> str | None:
        """``resources_id`` checked, or the latest resources now (None when there are none): a
        rollout says which policy version it was meant for, as the seed's stores record it."""
        if resources_id is None:
            latest = await self.get_latest_resources()
            return latest.resources_id if latest is not None else None
        if await self.get_resources_by_id(resources_id) is None:
            raise ValueError(f"resources {resources_id!r} do not exist")
        return resources_id

    # -- rollouts --------------------------------------------------------------------------

    def _new_rollout(
        self, input: Any, mode: Any, resources_id: str | None, config: RolloutConfig | None, metadata: Any
    ) -> Rollout:
        return Rollout(
            rollout_id=new_rollout_id(),
            input=input,
            start_time=time.time(),
            mode=mode,
            resources_id=resources_id,
            status="queuing",
            config=RolloutConfig() if config is None else config.model_copy(deep=True),
            # An empty mapping when none is given, as the seed's stores record it.
            metadata={} if metadata is None else dict(metadata),
        )

    async def start_rollout(
        self,
        input: Any,
        mode: Literal["train", "val", "test"] | None = None,
        resources_id: str | None = None,
        config: RolloutConfig | None = None,
        metadata: dict[str, Any] | None = None,
        worker_id: str | None = None,
    ) -> AttemptedRollout:
        """Create a rollout with its first attempt already started (``preparing``), for callers
        that run it themselves instead of queuing it; ``worker_id`` is the worker that runs it
        (busy on that attempt from now on).

        ``resources_id``: None pins the latest resources at this moment. Returns once the
        processor folded it, so every later read sees it. Raises ValueError for unknown
        resources or a rollout the fold refuses.
        """
        rollout = self._new_rollout(input, mode, resources_id, config, metadata)  # pinned below
        [started] = await self.start_rollouts([rollout], worker_id=worker_id)
        return started

    async def start_rollouts(
        self, rollouts: Sequence[Rollout], *, attempt_id: str | None = None, worker_id: str | None = None
    ) -> list[AttemptedRollout]:
        """Create rollouts the caller built (``queuing``, ids included), each with its first
        attempt started, in one produce batch and one wait for their folds: :meth:`start_rollout`
        for callers that choose their ids (a retried create is then idempotent: a copy of a
        rollout that exists, the same id and input, is answered with it as it is now).

        ``attempt_id``: the first attempts' id (a fresh one each when None). ``resources_id``
        None on a rollout pins the latest resources. ValueError on the first rollout the fold
        refuses (an id that exists with another input, for one).
        """
        pinned = {rid: await self._pinned_resources(rid) for rid in {r.resources_id for r in rollouts}}
        events = []
        for rollout in rollouts:
            rollout = rollout.model_copy(update={"resources_id": pinned[rollout.resources_id]})
            attempt = Attempt(
                rollout_id=rollout.rollout_id,
                attempt_id=attempt_id or new_attempt_id(),
                sequence_id=1,
                start_time=rollout.start_time,
                worker_id=worker_id,
            )
            events.append((rollout.rollout_id, RolloutEnqueued(rollout=rollout, attempt=attempt)))
        states = await self._request_many(events)
        self._workers.busy(worker_id)
        return [_attempted(state) for state in states]

    async def enqueue_rollout(
        self,
        input: Any,
        mode: Literal["train", "val", "test"] | None = None,
        resources_id: str | None = None,
        config: RolloutConfig | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Rollout:
        """Queue a rollout (``queuing``) for a runner to claim; returns it as stored.

        ``resources_id``: None pins the latest resources at this moment. Returns once the
        processor folded it, so a claim that follows (from any client) can get it. Raises
        ValueError when ``resources_id`` names no resources.
        """
        asked = {"input": input, "mode": mode, "resources_id": resources_id, "config": config, "metadata": metadata}
        [rollout] = await self.enqueue_many_rollouts([asked])
        return rollout  # as the fold stores a new rollout

    async def enqueue_many_rollouts(
        self, requests: Sequence[Mapping[str, Any] | EnqueueRolloutRequest]
    ) -> list[Rollout]:
        """Enqueue several rollouts at once (keys as enqueue_rollout's arguments), pipelined:
        one produce batch and one wait for their folds; those without ``resources_id`` pin the
        latest resources."""
        asked = [dict(r) if isinstance(r, EnqueueRolloutRequest) else r for r in requests]
        pinned = {rid: await self._pinned_resources(rid) for rid in {r.get("resources_id") for r in asked}}
        rollouts = [
            self._new_rollout(
                r["input"], r.get("mode"), pinned[r.get("resources_id")], r.get("config"), r.get("metadata")
            )
            for r in asked
        ]
        await self._acknowledged([(r.rollout_id, RolloutEnqueued(rollout=r)) for r in rollouts])
        return rollouts

    async def dequeue_rollout(self, worker_id: str | None = None, *, wait: float = 0.0) -> AttemptedRollout | None:
        """Claim the oldest queued rollout; None when nothing is queued.

        One store request to the processor, which answers with the rollout it claimed for us
        (oldest first over the partitions it owns) or empty; with several processors the
        request goes on to the partitions the first did not cover. ``wait`` lets the processor
        hold the request that long for work to arrive (a runner's long poll: no polling loop).
        """
        topic = self.settings.topic("store-requests")
        partitions = sorted(await self._producer.partitions_for(topic))
        # A poll skips the queues known to be empty (and answers None when that is all of them).
        covered = await self._queues.skipped(partitions) if wait <= 0 else set()
        while len(covered) < len(partitions):
            partition = self._queues.next(partitions, covered)
            request = StoreRequest(
                request_id=new_event_id(),
                kind="claim",
                reply_to=self._replies.topic,
                time=time.time(),
                worker_id=worker_id,
                wait_seconds=wait if not covered else 0.0,
            )
            try:
                answer = await self._claim(topic, partition, request)
            except RejectedError:
                continue  # the rollout moved on between the claim and its fold: ask again
            if answer.outcome == "applied" and answer.state is not None:
                self._queues.answered(partition, found_work=True, left_empty=bool(answer.covered_partitions))
                self._workers.busy(worker_id)
                return _attempted(answer.state, claim_attempt_id(request.request_id))
            self._queues.answered(partition, found_work=False)
            covered |= {partition, *answer.covered_partitions}
        self._workers.idle(worker_id)
        return None

    async def _claim(self, topic: str, partition: int, request: StoreRequest) -> Reply:
        """Send a claim and wait for its answer; without one in time, send the same claim again.

        An answer can be lost while a broker fails over, after the processor served the claim:
        a new claim would leave that rollout reserved for nobody. The same request id is served
        once, so a copy gets the rollout already claimed (or is served now if the first never
        arrived).
        """
        for copy in range(CLAIM_SENDS):
            with self._replies.expecting([request.request_id]) as replies:
                try:
                    await self._records.send(topic, request, key=request.request_id, partition=partition)
                    [answer] = await self._writes.answers(replies, self.request_timeout + request.wait_seconds)
                    return answer
                except AglError as error:
                    if isinstance(error, RejectedError) or copy == CLAIM_SENDS - 1:
                        raise
                    log.warning(
                        "no answer to a claim; asking again", request_id=request.request_id, error=describe(error)
                    )
        raise AssertionError("unreachable")  # the last copy returned or raised

    async def start_attempt(self, rollout_id: str, worker_id: str | None = None) -> AttemptedRollout:
        """Start a new attempt of ``rollout_id`` outside the queue (a manual retry, on a rollout
        in any status); the rollout with that attempt, once folded. ``worker_id`` is the worker
        that runs it (busy on that attempt from now on). ValueError for an unknown rollout."""
        attempt = Attempt(
            rollout_id=rollout_id,
            attempt_id=new_attempt_id(),
            sequence_id=1,
            start_time=time.time(),
            worker_id=worker_id,
        )
        state = await self._request(rollout_id, AttemptStarted(attempt=attempt, manual=True))
        self._workers.busy(worker_id)
        return _attempted(state, attempt.attempt_id)

    async def update_rollout(
        self,
        rollout_id: str,
        input: Any = UNSET,
        mode: RolloutMode | Unset | None = UNSET,
        resources_id: str | Unset | None = UNSET,
        status: RolloutStatus | Unset = UNSET,
        config: RolloutConfig | Unset = UNSET,
        metadata: dict[str, Any] | Unset | None = UNSET,
    ) -> Rollout:
        """Change the given fields of a rollout (arguments left out keep their value; None is a
        value); the rollout after the change, once folded. A terminal ``status`` finishes it.
        ValueError for an unknown rollout or a change the fold refuses (an illegal transition).
        """
        changes = given(
            input=input, mode=mode, resources_id=resources_id, status=status, config=config, metadata=metadata
        )
        state = await self._request(rollout_id, RolloutUpdated.of(**changes))
        return state.rollout

    async def update_attempt(
        self,
        rollout_id: str,
        attempt_id: str,
        status: AttemptStatus | Unset = UNSET,
        worker_id: str | Unset | None = UNSET,
        last_heartbeat_time: float | Unset = UNSET,
        metadata: dict[str, Any] | Unset | None = UNSET,
    ) -> Attempt:
        """Change the given fields of an attempt (``attempt_id="latest"``: the rollout's newest);
        the attempt after the change, once folded. A failed attempt with retries left requeues
        its rollout, as the rollout's config says. ValueError for an unknown rollout or attempt,
        or an illegal transition.
        """
        changes = given(status=status, worker_id=worker_id, last_heartbeat_time=last_heartbeat_time, metadata=metadata)
        state = await self._request(rollout_id, AttemptUpdated.of(attempt_id, **changes))
        return _attempt(state, None if attempt_id == "latest" else attempt_id)

    async def wait_for_rollouts(self, *, rollout_ids: list[str], timeout: float | None = None) -> list[Rollout]:
        """Rollouts among ``rollout_ids`` that reach a terminal status before ``timeout``.

        Answered from what this client already heard: the processor sends a notice to the
        enqueuer of a rollout (and to every client that watches it) when it finishes. Ids this
        client has never seen are watched first (one store request each, answered with the
        current state); only the ids the processor does not hold (finished and forgotten, or
        unknown) are looked up on the read side. Repeated calls therefore cost no round trip.
        Ids no store knows are left out of the answer and logged, as the seed's store does: an
        algorithm waits on lists it built itself, and a typo must not end a training run.
        """
        wanted = list(dict.fromkeys(rollout_ids))
        unseen = self._finished.unseen(wanted)
        if unseen:
            forgotten = self._finished.watched(unseen, await self._writes.watch(unseen, self.request_timeout))
            if forgotten:
                self._finished.looked_up(forgotten, await self.query_rollouts(rollout_id_in=forgotten))
        got = await self._finished.wait(wanted, timeout)
        return [got[rid] for rid in rollout_ids if rid in got]

    # -- spans -----------------------------------------------------------------------------

    async def add_span(self, span: Span) -> Span | None:
        """Store one span (see :meth:`add_many_spans`); the span as stored, or None for a
        duplicate (a span of the same rollout, attempt and span id was stored before)."""
        spans = await self.add_many_spans([span])
        return spans[0] if spans else None

    def unstored_spans(self, spans: Sequence[Span]) -> list[Span]:
        """``spans`` less the duplicates ``add_many_spans`` would leave out (same objects)."""
        return self._writes.new_spans(spans)

    async def add_many_spans(self, spans: Sequence[Span], *, counted: bool = False) -> Sequence[Span]:
        """Write spans to agl.spans; their arrival is one heartbeat per attempt. Returns the
        spans stored: duplicates (the same rollout, attempt and span id as a span this client
        stored among its last 20,000, or earlier in ``spans``) are left out and not written
        again. The read side keeps one row per span id anyway, so a duplicate from another
        client or from before a restart is stored once too; it is only answered as stored.
        ``counted``: their heartbeat was folded already, with their reservation
        (``reserve_span_sequence_ids(..., spans=...)``): only the spans are written.

        The contract wants a ValueError for spans of an unknown rollout or attempt. An attempt
        this client has seen in an answer (it claimed or started it, or updated it) exists, so
        its spans and heartbeats only wait for the broker, like ``export_spans``: one produce
        round trip instead of a round trip through the processor. Spans of other attempts are
        written once the processor applied their heartbeats: a rejected one raises and none of
        the spans is stored.
        """
        fresh = self._writes.new_spans(spans)
        if not fresh:
            return []
        if counted:
            await self._writes.send(self._writes.spans(fresh))
        elif self._writes.known({(s.rollout_id, s.attempt_id) for s in fresh}):
            await self.export_spans(fresh)
        else:
            # The verdict first: spans of an attempt no store knows are refused, not stored.
            await self._acknowledged(heartbeats(fresh))
            await self._writes.send(self._writes.spans(fresh))
        self._writes.stored(fresh)
        return fresh

    async def export_spans(self, spans: Sequence[Span]) -> None:
        """Write spans and their heartbeats, waiting only for the broker's acknowledgements.

        The tracer's path: unlike ``add_many_spans`` it does not wait for the processor to fold
        the heartbeats (a rejected heartbeat, e.g. for an attempt that already timed out, goes
        to agl.dlq as usual), so exporting never costs a round trip through the processor.
        """
        if not spans:
            return
        beats = heartbeats(spans)
        await self._writes.send([*(record for _, record in self._writes.events(beats)), *self._writes.spans(spans)])
        for rid, beat in beats:
            self._unfolded[rid] = beat.attempt_id

    async def beat(
        self, attempts: Sequence[tuple[str, str]], *, worker_id: str | None = None, heartbeat_stats: Any = None
    ) -> None:
        """A runner's periodic liveness: one heartbeat per live attempt, plus the worker's record.

        Like ``export_spans`` it waits only for the broker: heartbeats keep the watchdog from
        judging long-running attempts unresponsive, and nobody needs the folded result.
        """
        beats = [(rid, AttemptHeartbeat(attempt_id=aid, worker_id=worker_id)) for rid, aid in attempts]
        records = [record for _, record in self._writes.events(beats)]
        if worker_id is not None:
            records += self._writes.typed("workers", [(worker_id, self._workers.beat(worker_id, heartbeat_stats))])
        await self._writes.send(records)

    async def last_beat(self, worker_id: str, heartbeat_stats: Mapping[str, Any] | None = None) -> None:
        """A runner's last heartbeat as it stops cleanly: ``heartbeat_stats`` with
        ``WORKER_STOPPED`` set (the seed's worker statuses have none for a worker that left), written
        after this client's idle marks in flight so that it is the worker's last record."""
        await self._workers.landed()
        await self.beat([], worker_id=worker_id, heartbeat_stats={**(heartbeat_stats or {}), WORKER_STOPPED: True})

    async def add_otel_span(
        self, rollout_id: str, attempt_id: str, readable_span: Any, sequence_id: int | None = None
    ) -> Span | None:
        """Store an OpenTelemetry SDK span (a ``ReadableSpan``) of an attempt, numbered with
        ``sequence_id`` or the next one reserved for it; the span as stored."""
        from agl_stream.wire.spans import span_from_otel

        if sequence_id is None:
            sequence_id = await self.get_next_span_sequence_id(rollout_id, attempt_id)
        return await self.add_span(span_from_otel(readable_span, rollout_id, attempt_id, sequence_id))

    async def get_next_span_sequence_id(self, rollout_id: str, attempt_id: str) -> int:
        """Reserve the next span sequence id of an attempt (strictly increasing per attempt,
        across clients and restarts). ValueError for an unknown rollout or attempt."""
        return await self.reserve_span_sequence_ids(rollout_id, attempt_id, 1)

    async def reserve_span_sequence_ids(
        self, rollout_id: str, attempt_id: str, count: int, *, spans: int = 0, max_sequence_id: int | None = None
    ) -> int:
        """Reserve ``count`` consecutive sequence ids of an attempt; returns the first.

        Writers that number spans themselves (the runner's tracer, the LLM proxy) reserve a block
        once and number within it, so ids from different writers never collide. ``spans``: that
        many spans of the attempt are about to be written, numbered with these ids (or by the
        writer, up to ``max_sequence_id``): the reservation is their heartbeat too, so write them
        with ``add_many_spans(..., counted=True)``, which sends none.
        """
        if count < 1:
            raise ValueError("reserve at least one sequence id")
        payload = SpanSequenceRequested(
            attempt_id=attempt_id, count=count, span_count=spans, max_sequence_id=max_sequence_id
        )
        state = await self._request(rollout_id, payload)
        assert state.reserved_sequence_id is not None
        return state.reserved_sequence_id

    async def start_running(
        self, rollout_id: str, attempt_id: str, *, reserve_sequence_ids: int, metadata: Any = UNSET
    ) -> tuple[Attempt, int]:
        """Mark the attempt running (and set its metadata) and reserve a block of sequence ids,
        in one round trip."""
        running, reserved = await self._request_many(
            [
                (rollout_id, AttemptUpdated.of(attempt_id, status="running", **given(metadata=metadata))),
                (rollout_id, SpanSequenceRequested(attempt_id=attempt_id, count=reserve_sequence_ids)),
            ]
        )
        assert reserved.reserved_sequence_id is not None
        return _attempt(running, attempt_id), reserved.reserved_sequence_id

    async def get_many_span_sequence_ids(self, rollout_attempt_ids: Sequence[tuple[str, str]]) -> Sequence[int]:
        """One sequence id per ``(rollout_id, attempt_id)`` given, in order (a pair given n times
        gets n increasing ids): one reservation per attempt, all attempts at once. ValueError
        when any rollout or attempt is unknown."""
        wanted = Counter(rollout_attempt_ids)
        firsts = await asyncio.gather(
            *(self._request(rid, SpanSequenceRequested(attempt_id=aid, count=n)) for (rid, aid), n in wanted.items())
        )
        ids = {
            pair: itertools.count(state.reserved_sequence_id or 1) for pair, state in zip(wanted, firsts, strict=True)
        }
        return [next(ids[pair]) for pair in rollout_attempt_ids]

    # -- resources and workers -------------------------------------------------------------

    async def _resources_seen(self) -> ResourcesCache:
        """The agl.resources follower, past every snapshot this client wrote (read your writes,
        with no broker round trip: enqueues pin the latest resources on this path). Another
        client's snapshot shows as soon as the follower reads it; an id never seen is looked
        up to the topic's end by the cache itself."""
        cache = await self._resources.started()
        own = self.fence.get(self.settings.topic("resources"))
        if own:
            await cache.reach(own)
        return cache

    async def get_resources_by_id(self, resources_id: str) -> ResourcesUpdate | None:
        """The snapshot with this id, API keys included (read from agl.resources, not ClickHouse)."""
        return await (await self._resources_seen()).get(resources_id)

    async def get_latest_resources(self) -> ResourcesUpdate | None:
        """The latest snapshot, API keys included (read from agl.resources, not ClickHouse)."""
        return await (await self._resources_seen()).get(None)

    async def _publish_resources(self, update: ResourcesUpdate) -> ResourcesUpdate:
        await self._writes.write("resources", [(update.resources_id, update)])
        return update

    async def add_resources(self, resources: Mapping[str, Any]) -> ResourcesUpdate:
        """Publish a new resources snapshot (version 1 under a new id), which becomes the latest;
        returned once the broker acknowledged it, so every later read sees it."""
        return await self._publish_resources(snapshot(new_resources_id(), resources))

    async def update_resources(self, resources_id: str, resources: Mapping[str, Any]) -> ResourcesUpdate:
        """Replace the contents of resources (version + 1), which become the latest; an id that
        does not exist yet is created (version 1), as the seed's stores do (its algorithms
        publish their first resources under an id of their own this way)."""
        current = await self.get_resources_by_id(resources_id)
        return await self._publish_resources(snapshot(resources_id, resources, current))

    async def update_worker(self, worker_id: str, heartbeat_stats: Any = UNSET) -> Worker:
        """A heartbeat: stats and time. Status and assignment follow from the worker's attempts
        and claims, so the record carries them over as they stand."""
        current = await self.get_worker_by_id(worker_id)
        stats = (current.heartbeat_stats if current else None) if heartbeat_stats is UNSET else heartbeat_stats
        base = current if current is not None else Worker(worker_id=worker_id)
        record = self._workers.written(
            base.model_copy(update={"heartbeat_stats": stats, "last_heartbeat_time": time.time()})
        )
        await self._writes.write("workers", [(worker_id, record)])
        # The worker as a read would now give it: the read above with the new heartbeat (a second
        # fenced read would wait for the sink to apply this very record, for nothing new).
        return record


class _Connection:
    """What :func:`connect` returns: await it, or use it as ``async with``."""

    def __init__(self, settings: Settings) -> None:
        self.store = AglStore(settings)

    def __await__(self) -> Any:
        return self.store.start().__await__()

    async def __aenter__(self) -> AglStore:
        return await self.store.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.store.close()


def connect(**settings: Any) -> _Connection:
    """A store on the configured stack (by default the one ``agl-stream up`` started).

    ``store = await agl_stream.connect()`` (then ``await store.close()``), or
    ``async with agl_stream.connect() as store: ...``. Keyword arguments are settings
    (``data_dir=...``, ``kafka_bootstrap=...``, ``gateway_url=...``; see the README).
    """
    from agl_stream.local.stack import local_stack_settings

    return _Connection(local_stack_settings(load_settings(**settings)))
