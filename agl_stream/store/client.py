"""The store client: Agent Lightning's LightningStore API over Kafka and ClickHouse.

Concurrency model: one client per event loop; its coroutines may run concurrently (many
runner coroutines share one client), and nothing in it is thread-safe.

Writes append events (agl.rollouts, agl.spans, agl.resources, agl.workers) with ids made here.
A write whose return value needs folded state waits for the processor's answer on the client's
own reply topic (:mod:`agl_stream.store.replies`): the rollout's new state, or a rejection (a
ValueError with the reason). Claims are store requests the processor answers with the oldest
queued rollout of the partitions it owns. Reads go to ClickHouse (through the gateway, or
directly to a server) behind an offset fence: the newest offsets this client wrote or was
answered with, so a client always reads its writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any, Literal, TypeVar

from aiokafka import AIOKafkaProducer

from agl_stream import metrics
from agl_stream.config import Settings, load_settings
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
    RolloutEvent,
    RolloutState,
    RolloutUpdated,
    Span,
    SpanSequenceRequested,
    StoreRequest,
    Worker,
)
from agl_stream.models.base import TERMINAL_STATUSES, AttemptStatus, RolloutMode, RolloutStatus
from agl_stream.models.replies import Reply
from agl_stream.store.reads import StoreReads
from agl_stream.store.readside import KeyFences, ReadSide
from agl_stream.store.replies import REPLY_HEADER, REPLY_STATE_HEADER, RejectedError, ReplyChannel
from agl_stream.store.resources_cache import ResourcesCache
from agl_stream.store.types import UNSET, AttemptedRollout, EnqueueRolloutRequest, StoreCapabilities, Unset
from agl_stream.wire.avro_primitives import MAX_RECORD_BYTES
from agl_stream.wire.codec import Codec
from agl_stream.wire.span_records import span_records

log = get_logger("agl.store")

# A rollout event must fit in one Kafka message of agl.rollouts (broker default ~1 MB).
CLAIM_SENDS = 3
"""Copies of one claim a client sends, each after the last went unanswered for its timeout."""
REWATCH_S = 30.0
"""A rollout watched this long ago, not finished since, is watched again by the next wait."""
ANSWER_RECHECK_S = 10.0
EMPTY_HOLD_S = 0.02
"""How long a poll of a known-empty queue waits for work before it answers None: about what
asking the processor took, so callers' polling loops keep their pace."""
EMPTY_TTL_S = 1.0
"""How long a poll trusts that a partition's queue is empty without asking (a lost notice that
work arrived costs a poller at most this long)."""
"""An event unanswered this long is looked for in its rollout's state (the answer may be lost)."""


def _no_answer(timeout: float) -> AglError:
    return AglError(f"no answer from the rollout processor within {timeout}s: is it running? (`agl-stream status`)")


def _latest(state: RolloutState) -> Attempt | None:
    return max(state.attempts, key=lambda a: a.sequence_id) if state.attempts else None


def _attempted(state: RolloutState, attempt_id: str | None = None) -> AttemptedRollout:
    attempt = _latest(state) if attempt_id is None else next(a for a in state.attempts if a.attempt_id == attempt_id)
    assert attempt is not None
    return AttemptedRollout(**state.rollout.model_dump(), attempt=attempt)


class AglStore(StoreReads):
    """An async LightningStore. Use ``async with agl_stream.connect() as store: ...``."""

    def __init__(
        self, settings: Settings, *, request_timeout: float | None = None, read_side: ReadSide | None = None
    ) -> None:
        """``read_side``: where reads go instead of the one the settings name (the gateway gives its
        store client the engine in its own process: no HTTP round trip to itself)."""
        # topic -> partition -> newest offset written or answered: the fence of our reads.
        self._fence: dict[str, dict[int, int]] = defaultdict(dict)
        # The same per rollout, for reads of one rollout (its spans, its attempts): they wait for
        # this client's writes about that rollout only, not for every write it made since.
        self._key_fences = KeyFences(_KEY_FENCES_MEMORY)
        super().__init__(settings, self._fence, read_side)
        self.request_timeout = request_timeout if request_timeout is not None else settings.request_timeout_s
        self.codec = Codec.default()
        self.writer = f"client-{uuid.uuid4().hex[:12]}"
        # A 2 ms linger lets concurrent requests share produce requests: far less broker work.
        self._producer: AIOKafkaProducer = make_producer(settings, linger_ms=2)
        self._records = Outbox(settings, self._producer, self.writer, self.codec)
        self._replies = ReplyChannel(settings, self.writer, self.codec)
        self._replies.on_state = self._on_state
        self._replies.on_queue = self._on_queue
        # store-request partition -> when a claim found its processor's queue empty (monotonic);
        # cleared by the processor's notice that work was queued there
        self._empty_at: dict[int, float] = {}
        self._work_queued = asyncio.Event()
        self._woken: set[int] = set()  # partitions noticed to have work, not yet asked by a poll
        self._replies.send_keepalive = self._producer.send_and_wait
        self._reply_header = [(REPLY_HEADER, self._replies.topic.encode())]
        self._state_header = [*self._reply_header, (REPLY_STATE_HEADER, b"1")]
        # What this client knows without asking: rollouts seen finished, rollouts it will hear of.
        self._finished: dict[str, Rollout] = {}
        # Rollouts the processor tells us about when they finish -> when that was last confirmed.
        self._watched: dict[str, float] = {}
        self._finish_seen = asyncio.Event()
        self._claim_partition = 0
        # Attempts this client has seen in an answer: they exist (attempts are never deleted), so
        # spans for them need no verdict from the processor (see add_many_spans).
        self._known_attempts: dict[tuple[str, str], None] = {}
        # Spans this client stored with add_span(s), by (rollout, attempt, span id): a span sent
        # again (a retry whose answer was lost) is a duplicate, answered None as in the seed.
        self._stored_spans: dict[tuple[str, str, str], None] = {}
        # Rollouts with heartbeats sent without waiting for their fold (rollout id -> attempt
        # id): no answer has raised the read fence past them yet. Any later answer about the
        # rollout does (the processor folds a rollout's events in order); a read of rollout
        # state before that asks first (_settle).
        self._unfolded: dict[str, str] = {}
        # Resources by id come from agl.resources itself, started on first use: the ClickHouse
        # copy has its API keys redacted (anyone with SQL access reads that table).
        self._resources: ResourcesCache | None = None
        self._reported_unknown: set[str] = set()  # ids wait_for_rollouts warned about once
        # Workers whose empty claim this client recorded, with that record (see _mark_idle).
        self._idle_marked: dict[str, Worker] = {}
        # worker -> (heartbeat_stats, last_heartbeat_time) this client last wrote for it
        self._heartbeats: dict[str, tuple[Any, float | None]] = {}
        self._idle_marking: dict[str, asyncio.Task[None]] = {}  # records being written, by worker
        self._claims: Counter[str] = Counter()  # attempts claimed or started per worker (ends a spell)
        self._resources_started = asyncio.Lock()

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
        await asyncio.gather(*self._idle_marking.values(), return_exceptions=True)
        if self._resources is not None:
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

    def _note(self, topic: str, partition: int, offset: int, key: str | None = None) -> None:
        """Raise the read fence to a record written or answered; ``key`` (the rollout id of a
        span batch or a state record) also raises that rollout's own fence."""
        fence = self._fence[topic]
        if offset > fence.get(partition, -1):
            fence[partition] = offset
        self._key_fences.note(topic, key, partition, offset)

    def _fence_for(self, sources: Sequence[str], key: str | None) -> dict[str, dict[int, int]]:
        if key is None:
            return super()._fence_for(sources, key)
        return {t: f for t in (self.topics[s] for s in sources) if (f := self._key_fences.of(t, key))}

    def _encode_event(self, rollout_id: str, payload: AglModel) -> tuple[RolloutEvent, bytes]:
        event = RolloutEvent(
            event_id=new_event_id(), rollout_id=rollout_id, time=time.time(), writer=self.writer, payload=payload
        )
        data = self.codec.encode(event)
        if len(data) > MAX_RECORD_BYTES:
            raise ValueError(
                f"the event for rollout {rollout_id} is {len(data):,} bytes, over the {MAX_RECORD_BYTES:,}-byte "
                "limit of agl.rollouts: keep task input and metadata small (store large payloads elsewhere "
                "and pass a reference)"
            )
        return event, data

    async def _write(self, topic: str, records: Sequence[tuple[str, AglModel]]) -> None:
        """Write records (not rollout events) and raise our read fence to them."""
        for metadata in await self._records.send_many(self.settings.topic(topic), records):
            self._note(metadata.topic, metadata.partition, metadata.offset)

    async def _write_spans(self, spans: Sequence[Span]) -> None:
        """Spans as agl.SpanBatch records (one per attempt, split under 1 MB, keyed by rollout id)."""
        topic = self.settings.topic("spans")
        records = span_records(spans, self.codec)
        sends = [await self._producer.send(topic, value, key=key.encode()) for key, value in records]
        for (key, _), metadata in zip(records, await asyncio.gather(*sends), strict=True):
            self._note(metadata.topic, metadata.partition, metadata.offset, key)
        metrics.count_out(topic, len(sends))

    async def _request(self, rollout_id: str, payload: AglModel) -> RolloutState:
        """Append an event and wait for the processor's verdict: the new state, or ValueError."""
        [state] = await self._request_many([(rollout_id, payload)])
        return state

    async def _request_many(self, events: Sequence[tuple[str, AglModel]]) -> list[RolloutState]:
        """Append events in order (one produce batch), then wait for every answer with its state
        (the first rejection raises)."""
        answers = await self._submit(events, with_state=True)
        states = []
        for answer in answers:
            assert answer.state is not None, f"an answer without a state to {answer.request_id}"
            states.append(answer.state)
        return states

    async def _acknowledged(self, events: Sequence[tuple[str, AglModel]]) -> None:
        """Append events and wait until the processor applied them all (ValueError on the first
        rejection); the answers carry no state, which spares encoding and decoding it."""
        await self._submit(events, with_state=False)

    async def _submit(self, events: Sequence[tuple[str, AglModel]], *, with_state: bool) -> list[Reply]:
        if not events:
            return []
        # An event of ours may queue work (an enqueue, a retry): our next poll asks, whatever
        # the processor's notice and the answer to this event race to.
        self._empty_at.clear()
        encoded = [self._encode_event(rollout_id, payload) for rollout_id, payload in events]
        replies = [self._replies.expect(event.event_id) for event, _ in encoded]
        topic = self.settings.topic("rollouts")
        headers = self._state_header if with_state else self._reply_header
        try:
            sends = [
                await self._producer.send(topic, data, key=event.rollout_id.encode(), headers=headers)
                for event, data in encoded
            ]
            written = await asyncio.gather(*sends)
            for metadata in written:
                self._note(metadata.topic, metadata.partition, metadata.offset)
            metrics.count_out(topic, len(sends))
            answers = await self._answers_or_states(encoded, written, replies)
        finally:
            for reply in replies:
                if not reply.done():
                    reply.cancel()
        for event, _ in encoded:
            self._unfolded.pop(event.rollout_id, None)
            if isinstance(event.payload, RolloutEnqueued):
                self._watched[event.rollout_id] = time.monotonic()  # the enqueuer hears when it finishes
        return answers

    async def _answers_or_states(
        self,
        encoded: Sequence[tuple[RolloutEvent, bytes]],
        written: Sequence[Any],
        replies: Sequence[asyncio.Future[Reply]],
    ) -> list[Reply]:
        """The answers to these events, which are in the log already (acknowledged).

        An answer can be lost while a broker fails over, though the processor folded the event.
        So an answer missing after ``ANSWER_RECHECK_S`` is looked for in the rollout's state,
        asked for with a watch: a state that folded the event's offset (``input_offset``) is the
        answer. An event the processor refused leaves no trace in the state, so its refusal
        can only come as an answer; without one the call times out as before.
        """
        deadline = time.monotonic() + self.request_timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _no_answer(self.request_timeout)
            # asyncio.wait, not wait_for: a timeout here must not cancel the answers' futures.
            _, pending = await asyncio.wait(replies, timeout=min(left, ANSWER_RECHECK_S))
            if not pending:
                answers = [reply.result() for reply in replies]
                for (event, _), answer in zip(encoded, answers, strict=True):
                    self._note_answer(answer, event.rollout_id)
                return answers
            missing = [
                (index, event, metadata)
                for index, ((event, _), metadata, reply) in enumerate(zip(encoded, written, replies, strict=True))
                if reply in pending
            ]
            log.warning("answers missing; reading the states of their rollouts", events=len(missing))
            states = await self._current_states(list(dict.fromkeys(event.rollout_id for _, event, _ in missing)))
            for index, event, metadata in missing:
                found = states.get(event.rollout_id)
                state = found.state if found is not None else None
                if found is not None and state is not None and state.input_offset >= metadata.offset:
                    if not replies[index].done():
                        # With the state record's position: later reads are fenced on it.
                        replies[index].set_result(found.model_copy(update={"request_id": event.event_id}))

    async def _send_watches(self, rollout_ids: list[str]) -> list[asyncio.Future[Reply]]:
        """One watch request per rollout (answered with its current state); their answers' futures,
        which the caller cancels when it stops waiting."""
        topic = self.settings.topic("store-requests")
        requests = [
            StoreRequest(
                request_id=new_event_id(), kind="watch", reply_to=self._replies.topic, time=time.time(), rollout_id=rid
            )
            for rid in rollout_ids
        ]
        replies = [self._replies.expect(r.request_id) for r in requests]
        try:
            sends = [
                await self._producer.send(topic, self.codec.encode(r), key=(r.rollout_id or "").encode())
                for r in requests
            ]
            await asyncio.gather(*sends)
        except BaseException:
            for reply in replies:
                reply.cancel()
            raise
        metrics.count_out(topic, len(sends))
        return replies

    async def _current_states(self, rollout_ids: list[str]) -> dict[str, Reply]:
        """The processor's answer with the current state of each rollout it holds (one watch each)."""
        replies = await self._send_watches(rollout_ids)
        try:
            done, _ = await asyncio.wait(replies, timeout=ANSWER_RECHECK_S)
        finally:
            for reply in replies:
                if not reply.done():
                    reply.cancel()
        found = {}
        for rid, reply in zip(rollout_ids, replies, strict=True):
            if reply in done and not reply.cancelled() and reply.result().state is not None:
                found[rid] = reply.result()
        return found

    async def _settle(self, sources: Sequence[str], key: str | None = None) -> None:
        """Reads of rollout state see the effect of heartbeats sent without waiting (spans'
        arrival turns a preparing attempt running): one heartbeat per such rollout, this time
        answered, raises the fence past them. The runner's usual path (spans, then finishing
        the attempt) never gets here: finishing is answered and settles the rollout. Reads of
        workers wait for this client's idle-worker records in flight (an empty claim answered
        before its record was written), except inside one of those: it reads before writing."""
        marking = self._idle_marking.values()
        if "workers" in sources and marking and asyncio.current_task() not in marking:
            await asyncio.gather(*marking, return_exceptions=True)
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

    async def _answers(self, replies: Sequence[asyncio.Future[Reply]], timeout: float) -> list[Reply]:
        try:
            answers: list[Reply] = await asyncio.wait_for(asyncio.gather(*replies), timeout)
        except TimeoutError as error:
            raise _no_answer(timeout) from error
        for answer in answers:
            self._note_answer(answer)
        return answers

    def _note_answer(self, answer: Reply, rollout_id: str | None = None) -> None:
        """``rollout_id``: the rollout the answer is about, when it carries no state."""
        if answer.state_partition >= 0:
            key = answer.state.rollout.rollout_id if answer.state is not None else rollout_id
            self._note(self.settings.topic("rollout-state"), answer.state_partition, answer.state_offset, key)
        if answer.state is not None:
            keys = ((a.rollout_id, a.attempt_id) for a in answer.state.attempts)
            _remember(self._known_attempts, keys, _KNOWN_ATTEMPTS_MEMORY)

    def _on_queue(self, reply: Reply) -> None:
        """An empty claim answer marks its processor's partitions empty; its notice that work was
        queued clears them. Both arrive on the reply topic in the order the processor sent them."""
        if reply.outcome == "empty":
            now = time.monotonic()
            for partition in reply.covered_partitions:
                self._empty_at[partition] = now
            self._woken.difference_update(reply.covered_partitions)
        else:
            # One poll of this client asks (not every idle runner at once): if it gets a
            # rollout, the marks go and every poll asks again (more may be queued).
            self._woken.update(reply.covered_partitions)
            self._work_queued.set()  # wakes the polls holding on a known-empty queue
            self._work_queued = asyncio.Event()

    def _known_empty(self, partitions: Sequence[int]) -> set[int]:
        now = time.monotonic()
        return {
            p for p in partitions if p not in self._woken and now - self._empty_at.get(p, -EMPTY_TTL_S) < EMPTY_TTL_S
        }

    def _on_state(self, reply: Reply) -> None:
        """Every state the processor sent us: remember finished rollouts for wait_for_rollouts."""
        assert reply.state is not None
        rollout = reply.state.rollout
        if rollout.status in TERMINAL_STATUSES:
            self._note_answer(reply)
            if rollout.rollout_id not in self._finished and len(self._finished) >= _FINISHED_MEMORY:
                self._finished.pop(next(iter(self._finished)))
            self._finished[rollout.rollout_id] = rollout
            self._watched.pop(rollout.rollout_id, None)  # nothing more to hear of it
            self._finish_seen.set()
        else:
            self._finished.pop(rollout.rollout_id, None)

    async def _pinned_resources(self, resources_id: str | None) -> str | None:
        """``resources_id`` checked, or the latest resources now (None when there are none): a
        rollout says which policy version it was meant for, as the seed's stores record it."""
        if resources_id is None:
            latest = await self.get_latest_resources()
            return latest.resources_id if latest is not None else None
        return await self._check_resources(resources_id)

    async def _check_resources(self, resources_id: str | None) -> str | None:
        if resources_id is not None and await self.get_resources_by_id(resources_id) is None:
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
            config=(config or RolloutConfig()).model_copy(deep=True),
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
        self._busy(worker_id)
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
        resources_id = await self._pinned_resources(resources_id)
        rollout = self._new_rollout(input, mode, resources_id, config, metadata)
        await self._acknowledged([(rollout.rollout_id, RolloutEnqueued(rollout=rollout))])
        return rollout  # as the fold stores a new rollout

    async def enqueue_many_rollouts(
        self, requests: Sequence[Mapping[str, Any] | EnqueueRolloutRequest]
    ) -> list[Rollout]:
        """Enqueue several rollouts at once (keys as enqueue_rollout's arguments), pipelined:
        one produce batch and one wait for their folds; those without ``resources_id`` pin the
        latest resources."""
        given = [dict(r) if isinstance(r, EnqueueRolloutRequest) else r for r in requests]
        pinned = {rid: await self._pinned_resources(rid) for rid in {r.get("resources_id") for r in given}}
        rollouts = [
            self._new_rollout(
                r["input"], r.get("mode"), pinned[r.get("resources_id")], r.get("config"), r.get("metadata")
            )
            for r in given
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
        covered: set[int] = set()
        if wait <= 0:
            # A poll skips the partitions whose queue was found empty and has had no work since
            # (the processor says when it has): an idle runner's polls cost no round trip. When
            # all are, the poll waits for that notice as long as asking would take (so a loop of
            # polls neither spins nor starves the loop), then answers None. The mark expires, in
            # case the notice was lost (a processor that restarted).
            covered = self._known_empty(partitions)
            if len(covered) == len(partitions):
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._work_queued.wait(), EMPTY_HOLD_S)
                covered = self._known_empty(partitions)
            self._woken.difference_update(set(partitions) - covered)  # this poll asks for them
        while len(covered) < len(partitions):
            partition = next(p for p in _rotation(partitions, self._claim_partition) if p not in covered)
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
                self._empty_at.clear()  # there was work: more may be queued, every poll asks
                self._claim_partition = partition  # a processor with work: ask it first next time
                self._busy(worker_id)
                return _attempted(answer.state, claim_attempt_id(request.request_id))
            covered |= {partition, *answer.covered_partitions}
            self._claim_partition = partition + 1
        if worker_id is not None and worker_id not in self._idle_marked and worker_id not in self._idle_marking:
            # In the background: the record needs a fenced read of the worker, and a runner whose
            # claim waited for it would be late for the next rollout (idle claims measured
            # p50 82 -> 512 ms when this ran inline).
            self._idle_marking[worker_id] = asyncio.create_task(
                self._mark_idle(worker_id, time.time(), self._claims[worker_id]), name=f"idle {worker_id}"
            )
        return None

    async def _claim(self, topic: str, partition: int, request: StoreRequest) -> Reply:
        """Send a claim and wait for its answer; without one in time, send the same claim again.

        An answer can be lost while a broker fails over, after the processor served the claim:
        a new claim would leave that rollout reserved for nobody. The same request id is served
        once, so a copy gets the rollout already claimed (or is served now if the first never
        arrived).
        """
        for copy in range(CLAIM_SENDS):
            reply = self._replies.expect(request.request_id)
            try:
                await self._records.send(topic, request, key=request.request_id, partition=partition)
                [answer] = await self._answers([reply], self.request_timeout + request.wait_seconds)
                return answer
            except AglError as error:
                if isinstance(error, RejectedError) or copy == CLAIM_SENDS - 1:
                    raise
                log.warning("no answer to a claim; asking again", request_id=request.request_id, error=describe(error))
            finally:
                if not reply.done():
                    reply.cancel()
        raise AssertionError("unreachable")  # the last copy returned or raised

    def _note_heartbeat(self, worker_id: str, stats: Any, at: float | None) -> None:
        self._heartbeats.pop(worker_id, None)
        self._heartbeats[worker_id] = (stats, at)
        while len(self._heartbeats) > _WORKERS_MEMORY:
            self._heartbeats.pop(next(iter(self._heartbeats)))

    def _busy(self, worker_id: str | None) -> None:
        """``worker_id`` claimed or started an attempt: its idle spell (if any) ends here."""
        if worker_id is not None:
            self._claims[worker_id] += 1
            self._idle_marked.pop(worker_id, None)

    async def _mark_idle(self, worker_id: str, now: float, claims: int) -> None:
        """A claim that found nothing (at ``now``) leaves its worker idle, as the seed's stores
        record it: a worker record with the claim's time, which reads prefer to the worker's
        attempts while it is the newer (see StoreQueries.workers). Once per idle spell of this
        client's worker (a runner's long polls would otherwise write it every poll); the next
        claim, start or start_attempt for the worker ends the spell. ``claims`` is the worker's
        claim count when the empty claim answered: a claim since then ended the spell already,
        and the record (older than that attempt) is written but not kept as the spell's."""
        try:
            # No read: reads derive the worker's assignment and idle time from its attempts
            # (StoreQueries.workers), and its heartbeat is what this client last wrote for it. (A
            # fenced read per empty claim made the sinks flush for it: at 20 rollouts/s the
            # gateway spent a core on those reads and INSERTs.)
            stats, beat_time = self._heartbeats.get(worker_id, (None, None))
            record = Worker(
                worker_id=worker_id,
                status="idle",
                heartbeat_stats=stats,
                last_heartbeat_time=beat_time,
                last_dequeue_time=now,
                last_idle_time=now,
            )
            await self._write("workers", [(worker_id, record)])
            if self._claims[worker_id] == claims:
                self._idle_marked[worker_id] = record
        except Exception as error:  # bookkeeping: the claim's answer stands; the next empty claim retries
            log.warning("could not record an idle worker", worker_id=worker_id, error=describe(error))
        finally:
            self._idle_marking.pop(worker_id, None)

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
        self._busy(worker_id)
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
        given = {
            "input": input,
            "mode": mode,
            "resources_id": resources_id,
            "status": status,
            "config": config,
            "metadata": metadata,
        }
        changes = {name: value for name, value in given.items() if value is not UNSET}
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
        given = {
            "status": status,
            "worker_id": worker_id,
            "last_heartbeat_time": last_heartbeat_time,
            "metadata": metadata,
        }
        changes = {name: value for name, value in given.items() if value is not UNSET}
        state = await self._request(rollout_id, AttemptUpdated.of(attempt_id, **changes))
        if attempt_id == "latest":
            latest = _latest(state)
            assert latest is not None
            return latest
        return next(a for a in state.attempts if a.attempt_id == attempt_id)

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
        # Never seen, or watched long ago without a word since: a notice can be lost while a
        # broker fails over, and asking again (the answer carries the state) makes up for it.
        stale_before = time.monotonic() - REWATCH_S
        unseen = [rid for rid in wanted if rid not in self._finished and self._watched.get(rid, -1e18) < stale_before]
        if unseen:
            await self._watch(unseen)
        deadline = None if timeout is None else time.monotonic() + timeout
        got: dict[str, Rollout] = {}  # kept here: the client's memory of finished ones is bounded
        while True:
            self._finish_seen.clear()
            got.update((rid, self._finished[rid]) for rid in wanted if rid not in got and rid in self._finished)
            if len(got) == len(wanted):
                break
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            try:
                await asyncio.wait_for(self._finish_seen.wait(), left)
            except TimeoutError:
                break
        return [got[rid] for rid in rollout_ids if rid in got]

    async def _watch(self, rollout_ids: list[str]) -> None:
        """Ask the processor to tell us when these rollouts finish; look up those it forgot."""
        replies = await self._send_watches(rollout_ids)
        try:
            answers = await self._answers(replies, self.request_timeout)
        finally:
            for reply in replies:
                if not reply.done():
                    reply.cancel()
        forgotten = []
        for rid, answer in zip(rollout_ids, answers, strict=True):
            if answer.outcome == "unknown":
                forgotten.append(rid)
            elif rid not in self._finished:  # finished ones were recorded by _on_state already
                self._watched[rid] = time.monotonic()
        if forgotten:
            found = {r.rollout_id: r for r in await self.query_rollouts(rollout_id_in=forgotten)}
            unknown = [rid for rid in forgotten if rid not in found]
            fresh = [rid for rid in unknown if rid not in self._reported_unknown]
            if fresh:
                self._reported_unknown.update(fresh)
                log.warning("wait_for_rollouts: no such rollouts; left out of the answer", rollout_ids=fresh[:20])
            for rid, rollout in found.items():
                if rollout.status in TERMINAL_STATUSES:
                    self._finished[rid] = rollout
                # Not finished, yet not held by the processor: enqueued but not folded yet; the
                # next call asks again.

    # -- spans -----------------------------------------------------------------------------

    async def add_span(self, span: Span) -> Span | None:
        """Store one span (see :meth:`add_many_spans`); the span as stored, or None for a
        duplicate (a span of the same rollout, attempt and span id was stored before)."""
        spans = await self.add_many_spans([span])
        return spans[0] if spans else None

    async def add_many_spans(self, spans: Sequence[Span]) -> Sequence[Span]:
        """Write spans to agl.spans; their arrival is one heartbeat per attempt. Returns the
        spans stored: duplicates (the same rollout, attempt and span id as a span this client
        stored among its last 20,000, or earlier in ``spans``) are left out and not written
        again. The read side keeps one row per span id anyway, so a duplicate from another
        client or from before a restart is stored once too; it is only answered as stored.

        The contract wants a ValueError for spans of an unknown rollout or attempt. An attempt
        this client has seen in an answer (it claimed or started it, or updated it) exists, so
        its spans and heartbeats only wait for the broker, like ``export_spans``: one produce
        round trip instead of a round trip through the processor. Spans of other attempts are
        written once the processor applied their heartbeats: a rejected one raises and none of
        the spans is stored.
        """
        firsts: dict[tuple[str, str, str], Span] = {}
        for span in spans:
            key = _span_key(span)
            if key not in self._stored_spans and key not in firsts:
                firsts[key] = span
        fresh = list(firsts.values())
        if not fresh:
            return []
        beats = _heartbeats(fresh)
        if all((rid, beat.attempt_id) in self._known_attempts for rid, beat in beats):
            await self.export_spans(fresh)
        else:
            # The verdict first: spans of an attempt no store knows are refused, not stored.
            await self._acknowledged(beats)
            await self._write_spans(fresh)
        _remember(self._stored_spans, firsts, _STORED_SPANS_MEMORY)
        return fresh

    async def export_spans(self, spans: Sequence[Span]) -> None:
        """Write spans and their heartbeats, waiting only for the broker's acknowledgements.

        The tracer's path: unlike ``add_many_spans`` it does not wait for the processor to fold
        the heartbeats (a rejected heartbeat, e.g. for an attempt that already timed out, goes
        to agl.dlq as usual), so exporting never costs a round trip through the processor.
        """
        if not spans:
            return
        heartbeats = _heartbeats(spans)
        beats = [self._encode_event(rid, beat) for rid, beat in heartbeats]
        acks = await self._send_events(beats)
        await self._write_spans(spans)
        await self._await_acks(acks)
        for rid, beat in heartbeats:
            self._unfolded[rid] = beat.attempt_id

    async def beat(
        self, attempts: Sequence[tuple[str, str]], *, worker_id: str | None = None, heartbeat_stats: Any = None
    ) -> None:
        """A runner's periodic liveness: one heartbeat per live attempt, plus the worker's record.

        Like ``export_spans`` it waits only for the broker: heartbeats keep the watchdog from
        judging long-running attempts unresponsive, and nobody needs the folded result.
        """
        beats = [
            self._encode_event(rollout_id, AttemptHeartbeat(attempt_id=attempt_id, worker_id=worker_id))
            for rollout_id, attempt_id in attempts
        ]
        acks = await self._send_events(beats)
        if worker_id is not None:
            update = {"heartbeat_stats": heartbeat_stats, "last_heartbeat_time": time.time()}
            self._note_heartbeat(worker_id, heartbeat_stats, update["last_heartbeat_time"])
            marked = self._idle_marked.get(worker_id)  # keeps the record of an empty claim
            record = Worker(worker_id=worker_id, **update) if marked is None else marked.model_copy(update=update)
            await self._write("workers", [(worker_id, record)])
        await self._await_acks(acks)

    async def _send_events(self, events: Sequence[tuple[RolloutEvent, bytes]]) -> list[asyncio.Future[Any]]:
        topic = self.settings.topic("rollouts")
        return [await self._producer.send(topic, data, key=event.rollout_id.encode()) for event, data in events]

    async def _await_acks(self, acks: Sequence[asyncio.Future[Any]]) -> None:
        per_topic: Counter[str] = Counter()
        for metadata in await asyncio.gather(*acks):
            self._note(metadata.topic, metadata.partition, metadata.offset)  # rollouts, workers: no keyed reads
            per_topic[metadata.topic] += 1
        for topic, n in per_topic.items():
            metrics.count_out(topic, n)

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
        state = await self._request(rollout_id, SpanSequenceRequested(attempt_id=attempt_id, count=1))
        assert state.reserved_sequence_id is not None
        return state.reserved_sequence_id

    async def reserve_span_sequence_ids(self, rollout_id: str, attempt_id: str, count: int) -> int:
        """Reserve ``count`` consecutive sequence ids of an attempt; returns the first.

        Writers that number spans themselves (the runner's tracer, the LLM proxy) reserve a block
        once and number within it, so ids from different writers never collide.
        """
        if count < 1:
            raise ValueError("reserve at least one sequence id")
        state = await self._request(rollout_id, SpanSequenceRequested(attempt_id=attempt_id, count=count))
        assert state.reserved_sequence_id is not None
        return state.reserved_sequence_id

    async def start_running(
        self, rollout_id: str, attempt_id: str, *, reserve_sequence_ids: int, metadata: Any = UNSET
    ) -> tuple[Attempt, int]:
        """Mark the attempt running (and set its metadata) and reserve a block of sequence ids,
        in one round trip."""
        changes: dict[str, Any] = {"status": "running"}
        if metadata is not UNSET:
            changes["metadata"] = metadata
        running, reserved = await self._request_many(
            [
                (rollout_id, AttemptUpdated.of(attempt_id, **changes)),
                (rollout_id, SpanSequenceRequested(attempt_id=attempt_id, count=reserve_sequence_ids)),
            ]
        )
        attempt = next(a for a in running.attempts if a.attempt_id == attempt_id)
        assert reserved.reserved_sequence_id is not None
        return attempt, reserved.reserved_sequence_id

    async def get_many_span_sequence_ids(self, rollout_attempt_ids: Sequence[tuple[str, str]]) -> Sequence[int]:
        """One sequence id per ``(rollout_id, attempt_id)`` given, in order (a pair given n times
        gets n increasing ids): one reservation per attempt, all attempts at once. ValueError
        when any rollout or attempt is unknown."""
        wanted: dict[tuple[str, str], int] = defaultdict(int)
        for pair in rollout_attempt_ids:
            wanted[pair] += 1
        firsts = await asyncio.gather(
            *(self._request(rid, SpanSequenceRequested(attempt_id=aid, count=n)) for (rid, aid), n in wanted.items())
        )
        cursor = {pair: state.reserved_sequence_id or 1 for pair, state in zip(wanted, firsts, strict=True)}
        result = []
        for pair in rollout_attempt_ids:
            result.append(cursor[pair])
            cursor[pair] += 1
        return result

    # -- resources and workers -------------------------------------------------------------

    async def _resources_topic(self) -> ResourcesCache:
        async with self._resources_started:
            if self._resources is None:
                cache = ResourcesCache(self.settings, self.codec)
                await cache.start()
                self._resources = cache
        return self._resources

    async def _resources_seen(self) -> ResourcesCache:
        """The agl.resources follower, past every snapshot this client wrote (read your writes,
        with no broker round trip: enqueues pin the latest resources on this path). Another
        client's snapshot shows as soon as the follower reads it; an id never seen is looked
        up to the topic's end by the cache itself."""
        cache = await self._resources_topic()
        own = self._fence.get(self.settings.topic("resources"))
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
        await self._write("resources", [(update.resources_id, update)])
        return update

    async def add_resources(self, resources: Mapping[str, Any]) -> ResourcesUpdate:
        """Publish a new resources snapshot (version 1 under a new id), which becomes the latest;
        returned once the broker acknowledged it, so every later read sees it."""
        now = time.time()
        update = ResourcesUpdate(
            resources_id=new_resources_id(), create_time=now, update_time=now, version=1, resources=dict(resources)
        )
        return await self._publish_resources(update)

    async def update_resources(self, resources_id: str, resources: Mapping[str, Any]) -> ResourcesUpdate:
        """Replace the contents of resources (version + 1), which become the latest; an id that
        does not exist yet is created (version 1), as the seed's stores do (its algorithms
        publish their first resources under an id of their own this way)."""
        current = await self.get_resources_by_id(resources_id)
        if current is None:
            now = time.time()
            created = ResourcesUpdate(
                resources_id=resources_id, create_time=now, update_time=now, version=1, resources=dict(resources)
            )
            return await self._publish_resources(created)
        update = ResourcesUpdate(
            resources_id=resources_id,
            create_time=current.create_time,
            update_time=time.time(),
            version=current.version + 1,
            resources=dict(resources),
        )
        return await self._publish_resources(update)

    async def update_worker(self, worker_id: str, heartbeat_stats: Any = UNSET) -> Worker:
        """A heartbeat: stats and time. Status and assignment follow from the worker's attempts
        and claims, so the record carries them over as they stand."""
        current = await self.get_worker_by_id(worker_id)
        stats = (current.heartbeat_stats if current else None) if heartbeat_stats is UNSET else heartbeat_stats
        base = current if current is not None else Worker(worker_id=worker_id)
        record = base.model_copy(update={"heartbeat_stats": stats, "last_heartbeat_time": time.time()})
        self._note_heartbeat(worker_id, stats, record.last_heartbeat_time)
        if worker_id in self._idle_marked:
            self._idle_marked[worker_id] = record
        await self._write("workers", [(worker_id, record)])
        # The worker as a read would now give it: the read above with the new heartbeat (a second
        # fenced read would wait for the sink to apply this very record, for nothing new).
        return record


_WORKERS_MEMORY = 10_000
"""Workers whose last heartbeat a client remembers (a runner process has a few)."""

_FINISHED_MEMORY = 20_000
"""Finished rollouts a client remembers for wait_for_rollouts (older ones are asked again; a
wait keeps what it saw finish itself). At 200,000 a runner, which never waits, grew by ~1 KB a
rollout for its first 200,000 (benchmarks/soak.py), more with large inputs."""

_KNOWN_ATTEMPTS_MEMORY = 20_000
"""Attempts a client remembers as existing (older ones are verified by the processor again)."""

_KEY_FENCES_MEMORY = 20_000
"""Rollouts whose own read fence a client remembers (older ones are read behind its oldest)."""

_STORED_SPANS_MEMORY = 20_000
"""Span keys a client remembers to answer a span sent again as a duplicate (~5 MB)."""


K = TypeVar("K", bound=Hashable)


def _remember(memory: dict[K, None], keys: Iterable[K], limit: int) -> None:
    """Add ``keys`` to an insertion-ordered memory, forgetting the oldest past ``limit``."""
    memory.update(dict.fromkeys(keys))
    while len(memory) > limit:
        memory.pop(next(iter(memory)))


def _span_key(span: Span) -> tuple[str, str, str]:
    return (span.rollout_id, span.attempt_id, span.span_id)


def _rotation(partitions: Sequence[int], start: int) -> list[int]:
    """The partitions starting at ``start`` (modulo), then wrapping around."""
    n = len(partitions)
    return [partitions[(start + i) % n] for i in range(n)]


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


def _heartbeats(spans: Sequence[Span]) -> list[tuple[str, AttemptHeartbeat]]:
    """Span arrival as heartbeats: one per attempt, carrying its span count and highest sequence id."""
    highest: dict[tuple[str, str], int] = {}
    counts: dict[tuple[str, str], int] = defaultdict(int)
    for span in spans:
        key = (span.rollout_id, span.attempt_id)
        highest[key] = max(highest.get(key, 0), span.sequence_id)
        counts[key] += 1
    return [
        (rid, AttemptHeartbeat(attempt_id=aid, span_count=counts[(rid, aid)], max_sequence_id=top))
        for (rid, aid), top in highest.items()
    ]
