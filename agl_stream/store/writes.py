"""The write half of the store client: records to Kafka, and the rollout processor's answers.

Concurrency model: a :class:`StoreWrites` belongs to one store client and its event loop; the
client's coroutines use it concurrently, and nothing in it is thread-safe. It owns no
connection: it writes through the client's Outbox and hears answers on the client's
ReplyChannel, both started and stopped by the client.

Every record written, and every state an answer names, raises the client's read fence
(``note``), so the client reads its writes. An answer lost while a broker fails over is looked
for in the rollout's state (:meth:`StoreWrites.submit`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Collection, Hashable, Iterable, Mapping, Sequence
from typing import TypeVar

from aiokafka.structs import RecordMetadata

from agl_stream.config import Settings
from agl_stream.errors import AglError
from agl_stream.ids import new_event_id
from agl_stream.kafka.io import Outbox, Record
from agl_stream.logs import get_logger
from agl_stream.models import AglModel, AttemptHeartbeat, RolloutEvent, Span, StoreRequest
from agl_stream.models.replies import Reply
from agl_stream.store.replies import ReplyChannel
from agl_stream.wire.avro_primitives import MAX_RECORD_BYTES
from agl_stream.wire.span_records import span_records

log = get_logger("agl.store")

ANSWER_RECHECK_S = 10.0
"""An event unanswered this long is looked for in its rollout's state (the answer may be lost)."""
_KNOWN_ATTEMPTS_MEMORY = 20_000
"""Attempts a client remembers as existing (older ones are verified by the processor again)."""
_STORED_SPANS_MEMORY = 20_000
"""Span keys a client remembers to answer a span sent again as a duplicate (~5 MB)."""

Note = Callable[[str, int, int, str | None, Collection[str]], None]
"""Raises the client's read fence to a record: (topic, partition, offset, the rollout it is about,
the workers it is about)."""

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

Events = Sequence[tuple[str, AglModel]]
"""Rollout event payloads with their rollout ids, in the order they are appended."""


def remember(memory: dict[K, V], items: Mapping[K, V], limit: int) -> None:
    """Put ``items`` last in an insertion-ordered memory, forgetting the oldest past ``limit``."""
    for key in items:
        memory.pop(key, None)
    memory.update(items)
    while len(memory) > limit:
        memory.pop(next(iter(memory)))


def no_answer(timeout: float) -> AglError:
    return AglError(f"no answer from the rollout processor within {timeout}s: is it running? (`agl-stream status`)")


def heartbeats(spans: Sequence[Span]) -> list[tuple[str, AttemptHeartbeat]]:
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


class StoreWrites:
    """What one store client writes, and the answers it waits for.

    ``note(topic, partition, offset, key, workers)`` raises the client's read fence to a record
    (``key``: the rollout a span batch or a state record is about, for reads of that rollout;
    ``workers``: the worker of a worker record and those with an attempt in a state record, for
    reads of one worker)."""

    def __init__(
        self,
        settings: Settings,
        records: Outbox,
        replies: ReplyChannel,
        writer: str,
        note: Note,
    ) -> None:
        self.settings = settings
        self.records = records
        self.replies = replies
        self.writer = writer
        self.note = note
        self._spans_topic = settings.topic("spans")
        self._workers_topic = settings.topic("workers")
        # Attempts seen in an answer: they exist (attempts are never deleted), so spans for them
        # need no verdict from the processor (see AglStore.add_many_spans).
        self._known_attempts: dict[tuple[str, str], None] = {}
        # Spans stored by (rollout, attempt, span id): a span sent again (a retry whose answer was
        # lost) is a duplicate, answered None as in the seed.
        self._stored_spans: dict[tuple[str, str, str], None] = {}

    # -- records -----------------------------------------------------------------------------

    def events(
        self, events: Events, headers: list[tuple[str, bytes]] | None = None
    ) -> list[tuple[RolloutEvent, Record]]:
        """Rollout events with ids made here, as records of agl.rollouts (ValueError for one too
        large to be a Kafka message); ``headers`` name the reply topic when an answer is wanted."""
        topic = self.settings.topic("rollouts")
        encoded = []
        for rollout_id, payload in events:
            event = RolloutEvent(
                event_id=new_event_id(), rollout_id=rollout_id, time=time.time(), writer=self.writer, payload=payload
            )
            data = self.records.codec.encode(event)
            if len(data) > MAX_RECORD_BYTES:
                raise ValueError(
                    f"the event for rollout {rollout_id} is {len(data):,} bytes, over the {MAX_RECORD_BYTES:,}-byte "
                    "limit of agl.rollouts: keep task input and metadata small (store large payloads elsewhere "
                    "and pass a reference)"
                )
            encoded.append((event, Record(topic, rollout_id.encode(), data, headers=headers)))
        return encoded

    def spans(self, spans: Sequence[Span]) -> list[Record]:
        """Spans as agl.SpanBatch records (one per attempt, split under 1 MB, keyed by rollout id)."""
        return [
            Record(self._spans_topic, key.encode(), value) for key, value in span_records(spans, self.records.codec)
        ]

    def typed(self, topic: str, records: Sequence[tuple[str, AglModel]]) -> list[Record]:
        """Typed records (not rollout events) for ``topic`` (a short name: ``workers``), by key."""
        full = self.settings.topic(topic)
        return [Record(full, key.encode(), self.records.codec.encode(record)) for key, record in records]

    async def write(self, topic: str, records: Sequence[tuple[str, AglModel]]) -> None:
        """Write typed records (not rollout events) and raise the fence to them."""
        await self.send(self.typed(topic, records))

    async def send(self, records: Sequence[Record]) -> list[RecordMetadata]:
        """Send records in one round trip, wait for every acknowledgement and raise the fence."""
        written = await self.records.send_all(records)
        for record, metadata in zip(records, written, strict=True):
            key = record.key.decode() if record.key else None
            if record.topic == self._workers_topic and key is not None:
                self.note(metadata.topic, metadata.partition, metadata.offset, None, (key,))
            else:
                rollout = key if record.topic == self._spans_topic else None
                self.note(metadata.topic, metadata.partition, metadata.offset, rollout, ())
        return written

    # -- spans -------------------------------------------------------------------------------

    def new_spans(self, spans: Sequence[Span]) -> list[Span]:
        """``spans`` less the ones stored before (among the last 20,000) and repeats within them."""
        firsts: dict[tuple[str, str, str], Span] = {}
        for span in spans:
            key = (span.rollout_id, span.attempt_id, span.span_id)
            if key not in self._stored_spans:
                firsts.setdefault(key, span)
        return list(firsts.values())

    def stored(self, spans: Sequence[Span]) -> None:
        keys = ((span.rollout_id, span.attempt_id, span.span_id) for span in spans)
        remember(self._stored_spans, dict.fromkeys(keys), _STORED_SPANS_MEMORY)

    def known(self, attempts: Iterable[tuple[str, str]]) -> bool:
        """Whether every ``(rollout_id, attempt_id)`` was seen in an answer (so it exists)."""
        return all(attempt in self._known_attempts for attempt in attempts)

    # -- answers -----------------------------------------------------------------------------

    async def submit(self, events: Events, headers: list[tuple[str, bytes]], timeout: float) -> list[Reply]:
        """Append events in order (one produce batch), then wait for every answer (the first
        rejection raises)."""
        encoded = self.events(events, headers)
        with self.replies.expecting(event.event_id for event, _ in encoded) as replies:
            written = await self.send([record for _, record in encoded])
            return await self._answers_or_states([event for event, _ in encoded], written, replies, timeout)

    async def _answers_or_states(
        self,
        events: Sequence[RolloutEvent],
        written: Sequence[RecordMetadata],
        replies: Sequence[asyncio.Future[Reply]],
        timeout: float,
    ) -> list[Reply]:
        """The answers to these events, which are in the log already (acknowledged).

        An answer can be lost while a broker fails over, though the processor folded the event.
        So an answer missing after ``ANSWER_RECHECK_S`` is looked for in the rollout's state,
        asked for with a watch: a state that folded the event's offset (``input_offset``) is the
        answer. An event the processor refused leaves no trace in the state, so its refusal
        can only come as an answer; without one the call times out as before.
        """
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise no_answer(timeout)
            # asyncio.wait, not wait_for: a timeout here must not cancel the answers' futures.
            _, pending = await asyncio.wait(replies, timeout=min(left, ANSWER_RECHECK_S))
            if not pending:
                answers = [reply.result() for reply in replies]
                for event, answer in zip(events, answers, strict=True):
                    self.note_answer(answer, event.rollout_id)
                return answers
            missing = [
                (event, metadata, reply)
                for event, metadata, reply in zip(events, written, replies, strict=True)
                if reply in pending
            ]
            log.warning("answers missing; reading the states of their rollouts", events=len(missing))
            states = await self._current_states(list(dict.fromkeys(event.rollout_id for event, _, _ in missing)))
            for event, metadata, reply in missing:
                found = states.get(event.rollout_id)
                if found is not None and found.state is not None and found.state.input_offset >= metadata.offset:
                    if not reply.done():
                        # With the state record's position: later reads are fenced on it.
                        reply.set_result(found.model_copy(update={"request_id": event.event_id}))

    @contextlib.asynccontextmanager
    async def _watching(self, rollout_ids: Sequence[str]) -> AsyncIterator[list[asyncio.Future[Reply]]]:
        """One watch request per rollout, each answered with its current state (and the processor
        tells this client when the rollout finishes): the answers' futures, cancelled on leaving."""
        topic = self.replies.topic
        requests = [
            StoreRequest(request_id=new_event_id(), kind="watch", reply_to=topic, time=time.time(), rollout_id=rid)
            for rid in rollout_ids
        ]
        with self.replies.expecting(r.request_id for r in requests) as replies:
            await self.records.send_many(self.settings.topic("store-requests"), [(r.rollout_id, r) for r in requests])
            yield replies

    async def watch(self, rollout_ids: Sequence[str], timeout: float) -> list[Reply]:
        """Watch the rollouts: every answer within ``timeout`` (AglError otherwise)."""
        async with self._watching(rollout_ids) as replies:
            return await self.answers(replies, timeout)

    async def _current_states(self, rollout_ids: Sequence[str]) -> dict[str, Reply]:
        """The processor's answer with the current state of each rollout it holds (one watch each)."""
        async with self._watching(rollout_ids) as replies:
            done, _ = await asyncio.wait(replies, timeout=ANSWER_RECHECK_S)
        return {
            rid: reply.result()
            for rid, reply in zip(rollout_ids, replies, strict=True)
            if reply in done and not reply.cancelled() and reply.result().state is not None
        }

    async def answers(self, replies: Sequence[asyncio.Future[Reply]], timeout: float) -> list[Reply]:
        """Every answer within ``timeout`` (AglError otherwise; the first rejection raises).

        asyncio.wait, not wait_for over gather: cancelled while waiting (a runner stopping), the
        gather would end holding a CancelledError nobody retrieves, which asyncio logs as an
        error; the futures themselves are cancelled by ``ReplyChannel.expecting``."""
        if not replies:
            return []
        await asyncio.wait(replies, timeout=timeout, return_when=asyncio.FIRST_EXCEPTION)
        for reply in replies:
            if reply.done() and not reply.cancelled() and (error := reply.exception()) is not None:
                raise error
        if not all(reply.done() for reply in replies):
            raise no_answer(timeout)
        answers = [reply.result() for reply in replies]
        for answer in answers:
            self.note_answer(answer)
        return answers

    def note_answer(self, answer: Reply, rollout_id: str | None = None) -> None:
        """Raise the fence to the state record an answer names; its attempts exist.
        ``rollout_id``: the rollout the answer is about, when it carries no state."""
        if answer.state_partition >= 0:
            key = answer.state.rollout.rollout_id if answer.state is not None else rollout_id
            workers = {a.worker_id for a in answer.state.attempts if a.worker_id} if answer.state is not None else ()
            self.note(self.settings.topic("rollout-state"), answer.state_partition, answer.state_offset, key, workers)
        if answer.state is not None:
            keys = ((a.rollout_id, a.attempt_id) for a in answer.state.attempts)
            remember(self._known_attempts, dict.fromkeys(keys), _KNOWN_ATTEMPTS_MEMORY)
