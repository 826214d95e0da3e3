"""The triplet builder: when an attempt finishes, turn all of its spans into one TripletRecord.

A consumer-group member over two co-partitioned topics, ``agl.spans`` and ``agl.rollout-state``
(both keyed by rollout id, so one member sees every span and every state of a rollout). The
pure :class:`~agl_stream.domain.trace_collector.TraceCollector` holds each attempt's spans until the
attempt finished and the span count its writers reported has arrived (or it settled); then the
pure adapter (:mod:`agl_stream.domain.adapter`) extracts the triplets and the record goes to
``agl.triplets`` (keyed by group id, so a GRPO group meets in one batcher partition) with the
resources snapshot the attempt ran with and its policy version.

Nothing is lost when the process dies: each input partition is committed only up to its
lowest *pending* offset (a span or state whose attempt has not been emitted yet), after the
records of the emitted attempts were acknowledged. A restart or a new owner reads every
pending record again; an attempt emitted just before a crash may be emitted again, with the
same rollout and attempt ids (the batcher drops the repeat). It runs on the processor skeleton
(``agl_stream.kafka.processor``) as a handler that holds records: ``committable`` gives the
skeleton each partition's lowest pending offset. (faust was not used for this reason: it
commits past the first unacknowledged offset of a partition when later ones are acknowledged.)

Concurrency model: the skeleton's one loop task calls every method here (rebalances under the
loop's lock); nothing here is shared.

A record of agl.spans is one span or an agl.SpanBatch (a writer's flush of one attempt's
spans, :mod:`agl_stream.wire.span_records`); a batch stays pending until every attempt it holds
spans of was emitted.

Undecodable records go to ``agl.dlq`` (acknowledged before their offset is committed); spans of
attempts that never finish are evicted after a bound (counted, logged), so memory and the
uncommitted range stay bounded.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Iterable

from aiokafka import ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError

from agl_stream import metrics
from agl_stream.config import Settings
from agl_stream.domain.adapter import AdapterConfig
from agl_stream.domain.adapter.lean import lean_span
from agl_stream.domain.adapter.triplet_encoder import TripletRecordEncoder
from agl_stream.domain.trace_collector import (
    EvictedAttempt,
    ReadyAttempt,
    TraceCollector,
    resources_id_of,
    spans_by_attempt,
    triplet_record,
)
from agl_stream.errors import CodecError
from agl_stream.kafka.io import Outbox, Record, Rejected
from agl_stream.kafka.processor import Batch, run_processor
from agl_stream.local.processes import run_until_stopped
from agl_stream.logs import describe, get_logger
from agl_stream.models import RolloutState, TripletRecord
from agl_stream.store.resources_cache import ResourcesCache
from agl_stream.wire.codec import Codec
from agl_stream.wire.span_records import spans_of

log = get_logger("agl.triplets")

PROCESSOR = "processor.triplets"
_POLL_S = 0.2
_COMMIT_EVERY_S = 0.5

Token = tuple[TopicPartition, int]


class TripletBuilder:
    """The skeleton's handler (``assigned``, ``revoked``, ``handle``, ``tick``, ``committable``)."""

    def __init__(
        self,
        settings: Settings,
        *,
        adapter: AdapterConfig | None = None,
        settle_s: float = 5.0,
        max_wait_s: float = 600.0,
        max_spans: int = 200_000,
    ) -> None:
        self.settings = settings
        self.adapter = adapter or AdapterConfig()
        self.settle_s, self.max_wait_s, self.max_spans = settle_s, max_wait_s, max_spans
        self.codec = Codec.default()
        self.encoder = TripletRecordEncoder(self.codec)  # the codec's bytes, without its per-number cost
        self.spans_topic = settings.topic("spans")
        self.states_topic = settings.topic("rollout-state")
        self.collector: TraceCollector[Token] = self._new_collector()
        # Per partition, offset -> how many attempts still hold that record (a span batch of
        # several attempts is done when the last of them is emitted; everything else holds 1).
        self.pending: dict[TopicPartition, dict[int, int]] = defaultdict(dict)
        # Folded into the collector but not yet sent (a failed send is retried, not refolded).
        self.folded: dict[TopicPartition, int] = {}
        self.ready: list[ReadyAttempt[Token]] = []
        self.rejected: list[tuple[Token, Rejected]] = []
        self.emitted = 0
        self._last_tick = 0.0
        self.outbox: Outbox | None = None
        self.resources: ResourcesCache | None = None

    def _new_collector(self) -> TraceCollector[Token]:
        return TraceCollector(settle_s=self.settle_s, max_wait_s=self.max_wait_s, max_spans=self.max_spans)

    # -- the skeleton's calls ---------------------------------------------------------------

    async def assigned(self, partitions: set[TopicPartition]) -> None:
        log.info("triplet builder assigned", partitions=sorted(f"{tp.topic}:{tp.partition}" for tp in partitions))

    def revoked(self, partitions: set[TopicPartition]) -> None:
        # Eager rebalancing: every partition is re-assigned and read again from its commit
        # point, so what this member holds in memory is dropped, not handed over.
        self.collector = self._new_collector()
        self.pending.clear()
        self.folded.clear()
        self.ready.clear()
        self.rejected.clear()

    def poll_timeout(self) -> float:
        return _POLL_S

    def committable(self, tp: TopicPartition, handled: int) -> int:
        held = self.pending.get(tp)
        return min(held) if held else handled

    async def handle(self, batch: Batch) -> None:
        now = time.monotonic()
        done: list[Token] = []
        for tp, messages in batch.items():
            start = self.folded.get(tp, -1)
            for message in messages:
                if message.offset < start:
                    continue  # folded before a failed send: the retry only sends
                token = (tp, message.offset)
                got, at_once = self._take(tp, message, token, now)
                self.ready += got
                done += at_once
                self.folded[tp] = message.offset + 1
        self._done(done)
        await self._flush()

    async def tick(self) -> None:
        now = time.monotonic()
        if now - self._last_tick < min(1.0, max(0.1, self.settle_s / 5)):
            return
        self._last_tick = now
        settled, evicted = self.collector.tick(now)
        self.ready += settled
        self._done(self._evicted(evicted))
        try:
            await self._flush()
        except (KafkaError, TimeoutError) as error:  # kept: the next batch or tick sends them
            log.warning("sending settled attempts failed, will retry", error=describe(error)[:300])

    # -- folding and sending ----------------------------------------------------------------

    def _take(
        self, tp: TopicPartition, message: ConsumerRecord[bytes, bytes], token: Token, now: float
    ) -> tuple[list[ReadyAttempt[Token]], list[Token]]:
        self.pending[tp][message.offset] = 1
        if message.value is None:  # a tombstone on the state topic: a forgotten rollout
            return [], [token]
        try:
            if tp.topic == self.spans_topic:  # an agl.Span or an agl.SpanBatch, validated
                # Held as what the adapter reads (the replay decodes the same straight from bytes).
                groups = spans_by_attempt([lean_span(span) for span in spans_of(self.codec, message.value)])
            else:
                return self.collector.add_state(self.codec.decode(message.value, RolloutState), token, now)
        except CodecError as error:
            self.rejected.append((token, Rejected.of(message, error)))
            return [], []
        if not groups:  # an empty batch
            return [], [token]
        self.pending[tp][message.offset] = len(groups)
        ready: list[ReadyAttempt[Token]] = []
        done: list[Token] = []
        for group in groups:
            got, at_once = self.collector.add_spans(group, token, now)
            ready += got
            done += at_once
        return ready, done

    async def _flush(self) -> None:
        """DLQ records, then the records of ready attempts, each acknowledged before the inputs
        they came from stop being pending."""
        assert self.outbox is not None
        if self.rejected:
            await self.outbox.reject([r for _, r in self.rejected])
            self._done(token for token, _ in self.rejected)
            self.rejected = []
        if self.ready:
            await self._emit(self.ready)
            self._done(token for attempt in self.ready for token in attempt.tokens)
            self.ready = []

    def _evicted(self, evicted: Iterable[EvictedAttempt[Token]]) -> list[Token]:
        tokens: list[Token] = []
        for attempt in evicted:
            log.warning(
                "spans of an unfinished attempt evicted",
                rollout=attempt.rollout_id,
                attempt=attempt.attempt_id,
                spans=attempt.spans,
                reason=attempt.reason,
            )
            tokens += attempt.tokens
        return tokens

    async def _emit(self, ready: list[ReadyAttempt[Token]]) -> None:
        assert self.outbox is not None
        topic = self.settings.topic("triplets")
        records = [await self._record(attempt) for attempt in ready]
        # Acknowledged before the inputs count as done.
        await self.outbox.send_all(Record(topic, r.group_id.encode(), self.encoder.encode(r)) for r in records)
        self.emitted += len(ready)

    async def _record(self, ready: ReadyAttempt[Token]) -> TripletRecord:
        assert self.resources is not None
        resources_id = resources_id_of(ready.finished)
        snapshot = await self.resources.get(resources_id) if resources_id else None
        record, result = triplet_record(ready.finished, ready.spans, self.adapter, snapshot)
        metrics.count_samples(len(record.triplets), result.breaks)
        if result.issues or not ready.complete:
            log.info(
                "attempt's trace had issues",
                rollout=record.rollout_id,
                attempt=record.attempt_id,
                complete=ready.complete,
                spans=len(ready.spans),
                expected=ready.finished.expected_spans,
                issues=result.issues[:5],
            )
        return record

    def _done(self, tokens: Iterable[Token]) -> None:
        for tp, offset in tokens:
            held = self.pending[tp]
            left = held.get(offset, 0) - 1
            if left > 0:
                held[offset] = left
            else:
                held.pop(offset, None)

    # -- running ----------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        self.resources = ResourcesCache(self.settings, self.codec)
        async with Outbox.started(self.settings, PROCESSOR, self.codec) as self.outbox:
            try:
                await self.resources.start()
                await run_processor(
                    self.settings,
                    self,
                    name=PROCESSOR,
                    topics=[self.spans_topic, self.states_topic],
                    stop=stop,
                    ready_as="triplets",
                    max_records=5000,
                    commit_interval_s=_COMMIT_EVERY_S,
                )
            finally:
                await self.resources.stop()
        log.info("triplet builder stopped", emitted=self.emitted, **vars(self.collector.stats))


def main(
    settings: Settings,
    *,
    adapter: AdapterConfig | None = None,
    settle_s: float = 5.0,
    max_wait_s: float = 600.0,
    max_spans: int = 200_000,
) -> None:
    """Run the triplet builder in the foreground until SIGTERM/SIGINT."""

    builder = TripletBuilder(settings, adapter=adapter, settle_s=settle_s, max_wait_s=max_wait_s, max_spans=max_spans)
    run_until_stopped(builder.run)
