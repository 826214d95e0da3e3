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
What it holds, admission and the decisions of a batch are its pure core (``domain.rollout_core``).
"""

from __future__ import annotations

import asyncio
import time

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError

from agl_stream import metrics
from agl_stream.config import Settings
from agl_stream.domain.rollout_core import PROCESSOR, Answer, Folded, RolloutCore
from agl_stream.errors import CodecError
from agl_stream.kafka.io import Outbox, Record, Rejected, make_producer
from agl_stream.kafka.processor import Batch, run_processor
from agl_stream.local.processes import run_until_stopped
from agl_stream.logs import get_logger
from agl_stream.models import RolloutEvent, RolloutState, StoreRequest
from agl_stream.store.replies import REPLY_HEADER, REPLY_STATE_HEADER, ReplyTopics, prune_reply_topics
from agl_stream.wire.avro_primitives import MAX_RECORD_BYTES
from agl_stream.wire.codec import Codec
from agl_stream.wire.reply_wire import ReplyEncoder

log = get_logger("agl.processor")

REPLY_WAIT_S = 2.0
PRUNE_EVERY_S = 3600.0


class RejectedEvent(Exception):
    """The fold refused the event (its reason is the message)."""


class OversizeRecordError(Exception):
    """A record over MAX_RECORD_BYTES: nothing it would produce fits the topics it feeds."""


class RolloutProcessor(RolloutCore):
    def __init__(self, settings: Settings, outbox: Outbox, replies: AIOKafkaProducer, codec: Codec) -> None:
        super().__init__(
            codec,
            retention_s=settings.finished_retention_s,
            watchdog_interval_s=settings.watchdog_interval_s,
            max_queued=settings.max_queued_per_partition or None,
        )
        self.settings = settings
        self.fold_seconds = metrics.FOLD_SECONDS.labels(metrics.role())
        self.outbox = outbox
        self.reply_producer = replies
        self.reply_topics = ReplyTopics(settings)
        self.replies_wire = ReplyEncoder(codec)
        self.events_topic = settings.topic("rollouts")
        self.state_topic = settings.topic("rollout-state")
        self.requests_topic = settings.topic("store-requests")
        self._next_watchdog = 0.0
        self._next_prune = time.monotonic() + PRUNE_EVERY_S
        self._pruning: asyncio.Task[list[str]] | None = None
        self._answered: set[str] = set()  # the reply topics in the reply producer's metadata
        self.consumer: AIOKafkaConsumer | None = None  # the skeleton's, for positions

    # -- assignment --------------------------------------------------------------------------

    async def assigned(self, partitions: set[TopicPartition]) -> None:
        mine = {tp.partition for tp in partitions if tp.topic == self.events_topic}
        new = mine - self.owned
        self.owned = mine
        if new:
            await self._recover(new)

    def revoked(self, partitions: set[TopicPartition]) -> None:
        self.drop_partitions({tp.partition for tp in partitions if tp.topic == self.events_topic})

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
            self.folded_through.update(dict.fromkeys(partitions, -1))
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
        self.recovered(state, record.value, partition, record.offset)

    # -- one batch ---------------------------------------------------------------------------

    async def handle(self, batch: Batch) -> None:
        started = time.monotonic()
        now = time.time()
        out = Folded()
        rejected: list[Rejected] = []
        # Forgotten before the batch is folded, so its events find them gone (unknown rollout).
        tombstones = [Record(self.state_topic, rid.encode(), None, p) for rid, p in self.forget(now)]
        for tp, records in batch.items():
            if tp.topic == self.events_topic:
                rejected += [Rejected.of(r, e) for r in records if (e := self._fold(r, out)) is not None]
                if tp.partition in self.catching_up and records[-1].offset + 1 >= self.catching_up[tp.partition]:
                    del self.catching_up[tp.partition]
        for tp, records in batch.items():
            if tp.topic == self.requests_topic:
                rejected += [Rejected.of(r, e) for r in records if (e := self._request(r, out)) is not None]
        claims = [self._claim_record(event, reply_to) for event, reply_to in self.serve_claims(out, now)]
        self.notify_work(out.answers)
        self.fold_seconds.observe(time.monotonic() - started)
        await self._send(out, rejected, tombstones, claims)

    @staticmethod
    def _sized(record: ConsumerRecord[bytes, bytes], what: str) -> bytes:
        """The record's value, unless its effects would be too large to write: refused here, where
        the DLQ can say why, rather than failing every produce of the batch it lands in."""
        if len(value := record.value or b"") > MAX_RECORD_BYTES:
            raise OversizeRecordError(
                f"{what} of {len(value):,} bytes, over the {MAX_RECORD_BYTES:,}-byte limit: keep task input and "
                "metadata small (store large payloads elsewhere and pass a reference)"
            )
        return value

    def _fold(self, record: ConsumerRecord[bytes, bytes], out: Folded) -> Exception | None:
        """Fold an event record; returns why it goes to the DLQ, if it does."""
        try:
            event = self.codec.decode(self._sized(record, "a rollout event"), RolloutEvent)
        except (CodecError, OversizeRecordError) as error:
            return error
        reply_to, with_state = self.reply_topics.of(record.headers)
        if (record.key or b"").decode(errors="replace") != event.rollout_id:
            mismatch = RejectedEvent(f"key {record.key!r} is not the rollout id {event.rollout_id}")
            if reply_to:
                out.answers.append(Answer(reply_to, event.event_id, "rejected", error=str(mismatch)))
            return mismatch
        refused = self.fold_event(event, record.partition, record.offset, reply_to, with_state, out)
        return None if refused is None else RejectedEvent(refused)

    def _request(self, record: ConsumerRecord[bytes, bytes], out: Folded) -> Exception | None:
        """Take a store request record; returns why it goes to the DLQ, if it does."""
        try:
            request = self.codec.decode(self._sized(record, "a store request"), StoreRequest)
        except (CodecError, OversizeRecordError) as error:
            return error
        if not self.reply_topics.valid(request.reply_to):
            return RejectedEvent(f"reply_to {request.reply_to!r} is not a reply topic")
        self.take_request(request, record.partition, out)
        return None

    def _claim_record(self, event: RolloutEvent, reply_to: str) -> Record:
        """A claim event for agl.rollouts; the claimer's reply topic travels as its header, like any writer's."""
        rollout_id = event.rollout_id
        headers = [(REPLY_HEADER, reply_to.encode()), (REPLY_STATE_HEADER, b"1")]
        return Record(
            self.events_topic, rollout_id.encode(), self.codec.encode(event), self.partition_of[rollout_id], headers
        )

    def _state_record(self, state: RolloutState, value: bytes) -> Record:
        rollout_id = state.rollout.rollout_id
        return Record(self.state_topic, rollout_id.encode(), value, self.partition_of[rollout_id])

    async def _send(
        self, out: Folded, rejected: list[Rejected], tombstones: list[Record], claims: list[Record]
    ) -> None:
        touched = out.touched
        encoded = {rid: self.codec.encode(state) for rid, state in touched.items()}
        finishing = [self._state_record(state, self.codec.encode(state)) for state in out.finishing]
        states = finishing + [self._state_record(touched[rid], value) for rid, value in encoded.items()]
        # Tombstones first: a rollout forgotten and enqueued again in one batch ends up present.
        await self.outbox.reject(rejected)  # rare (bad input): its own round trip
        sent = await self.outbox.send_all(tombstones + states + claims)
        for rid, meta in zip(encoded, sent[len(tombstones) + len(finishing) :], strict=False):
            self.state_offset[rid] = meta.offset
        for rid, value in encoded.items():
            self.states.compact(touched[rid], value)
        # Answers that carry a state this batch wrote reuse its bytes (most of them do).
        bodies = {id(touched[rid]): self.replies_wire.state_body(value) for rid, value in encoded.items()}
        await self._reply(out.answers + out.notices(), bodies)

    async def _reply(self, answers: list[Answer], bodies: dict[int, bytes]) -> None:
        """Phase two: the answers to each writer in one record on its topic (an ``agl.Reply``,
        or an ``agl.ReplyBatch`` of several, in order); a topic that is gone loses its answers.

        Waits a bounded time for the acknowledgements: a writer that vanished (its topic deleted
        a moment ago) must not hold up everyone else's answers; slow sends finish in the
        background and their failures are counted.
        """
        if not answers:
            return
        if await self.reply_topics.refresh({a.reply_to for a in answers}):
            self._forget_gone_topics()
        per_topic: dict[str, list[bytes]] = {}
        for answer in answers:
            if not self.reply_topics.exists(answer.reply_to):
                self.counts["replies_to_missing_topics"] += 1
                continue
            rid, body = answer.rollout_id, None
            if answer.state is not None and (body := bodies.get(id(answer.state))) is None:
                # An intermediate state of the batch: encoded once.
                body = bodies[id(answer.state)] = self.replies_wire.state_body(self.codec.encode(answer.state))
            per_topic.setdefault(answer.reply_to, []).append(
                self.replies_wire.body(
                    answer.request_id,
                    answer.outcome,
                    state_body=body,
                    error=answer.error,
                    state_partition=self.partition_of.get(rid, -1) if rid and rid in self.state_offset else -1,
                    state_offset=self.state_offset.get(rid, -1) if rid else -1,
                    covered_partitions=answer.covered,
                )
            )
        self._answered.update(per_topic)
        deliveries = [
            asyncio.create_task(self._deliver(topic, record))
            for topic, replies in per_topic.items()
            for record in self.replies_wire.records(replies)
        ]
        if deliveries:
            await asyncio.wait(deliveries, timeout=REPLY_WAIT_S)
            metrics.count_out(self.settings.topic("replies"), len(deliveries))  # one label for all clients

    def _forget_gone_topics(self) -> None:
        """aiokafka's producer asks the metadata of every topic it ever sent to, for good (and
        logs an error for each deleted one at every update): once a lookup shows reply topics
        gone (their clients closed), it asks only for those that still exist. Never for none:
        an empty list would make it ask for every topic of the cluster."""
        live = {topic for topic in self._answered if self.reply_topics.exists(topic)}
        if live and live != self._answered:
            self.reply_producer.client.set_topics(live)
            self._answered = live

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
        if not self.catching_up:  # until caught up, no claim is answered (``serve_claims``)
            answers: list[Answer] = []
            self.expire_claims(now, answers)
            await self._reply(answers, {})
        if now < self._next_watchdog:
            return
        self._next_watchdog = now + self.watchdog_interval_s
        events = [
            Record(self.events_topic, event.rollout_id.encode(), self.codec.encode(event))
            for event in self.watchdog_events(now)
        ]
        if events:
            await self.outbox.send_all(events)
            log.info("watchdog verdicts", count=len(events))


async def run(settings: Settings, stop: asyncio.Event) -> None:
    codec = Codec.default()
    # Replies go to writers' own topics; one that vanished must not hold up the batch for long.
    # Not idempotent: a topic deleted under a pending send must fail that send, not the producer,
    # and a duplicate answer is harmless (the writer takes the first).
    replies = make_producer(settings, request_timeout_ms=5000, enable_idempotence=False)
    async with Outbox.started(settings, PROCESSOR, codec) as outbox:
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
