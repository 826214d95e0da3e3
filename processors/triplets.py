"""The triplet builder: when an attempt finishes, turn all of its spans into one TripletRecord.

A faust-streaming app over two co-partitioned topics, ``agl.spans`` and ``agl.rollout-state``
(both keyed by rollout id, so one worker sees every span and every state of a rollout). The
pure :class:`~agl_stream.trace_collector.TraceCollector` holds each attempt's spans until the
attempt finished and the span count its writers reported has arrived (or it settled); then the
pure adapter (:mod:`agl_stream.adapter`) extracts the triplets and the record goes to
``agl.triplets`` with the group id, the resources snapshot the attempt ran with and its policy
version.

Input records are acknowledged by hand (a ``noack`` stream): a span or state is acknowledged
only with the attempt it belongs to, after that attempt's record was sent, and faust commits an
offset only once everything before it is acknowledged and the producer is flushed. A crash
therefore re-reads the spans of every attempt not emitted yet; an attempt emitted just before
a crash may be emitted again (same rollout and attempt ids; the batcher drops the repeat).
Undecodable records go to ``agl.dlq``; spans of attempts that never finish are evicted after a
bound (counted, logged), so memory and the uncommitted range stay bounded.
"""

from __future__ import annotations

import os
import time
from typing import Any

import faust

from agl_stream.adapter import AdapterConfig, extract_triplets
from agl_stream.codec import Codec
from agl_stream.config import Settings
from agl_stream.errors import CodecError
from agl_stream.kafka.faust_apps import RAW_TOPIC, make_app, run_app
from agl_stream.logs import get_logger
from agl_stream.models import DlqRecord, ModelCheckpoint, ResourcesUpdate, RolloutState, Span, TripletRecord
from agl_stream.store.resources_cache import ResourcesCache
from agl_stream.trace_collector import EvictedAttempt, ReadyAttempt, TraceCollector, group_id_of

log = get_logger("agl.triplets")

PROCESSOR = "processor.triplets"
_RAW = RAW_TOPIC


def policy_version_of(snapshot: ResourcesUpdate | None) -> int | None:
    """The policy version a resources snapshot serves: its model checkpoint's, if it has one."""
    if snapshot is None:
        return None
    versions = [r.policy_version for r in snapshot.resources.values() if isinstance(r, ModelCheckpoint)]
    return max(versions) if versions else None


def create_app(
    settings: Settings,
    *,
    partitions: int,
    adapter: AdapterConfig | None = None,
    settle_s: float = 5.0,
    max_wait_s: float = 600.0,
    max_spans: int = 200_000,
) -> faust.App:
    config = adapter or AdapterConfig()
    codec = Codec.default()
    app = make_app(
        settings,
        PROCESSOR,
        partitions=partitions,
        producer_linger=0.005,
        broker_commit_every=500,
        broker_commit_interval=0.5,
        # Attempts hold their partition's commit until they finish; that is by design.
        broker_commit_livelock_soft_timeout=max_wait_s * 2,
    )
    spans_topic = settings.topic("spans")
    source = app.topic(spans_topic, settings.topic("rollout-state"), partitions=partitions, **_RAW)
    triplets_topic = app.topic(settings.topic("triplets"), **_RAW)
    dlq_topic = app.topic(settings.topic("dlq"), **_RAW)
    collector: TraceCollector[Any] = TraceCollector(settle_s=settle_s, max_wait_s=max_wait_s, max_spans=max_spans)
    shared: dict[str, Any] = {}

    async def resources() -> ResourcesCache:
        cache = shared.get("resources")
        if cache is None:
            cache = shared["resources"] = ResourcesCache(settings, codec)
            await cache.start()
        return cache

    async def ack(events: list[Any]) -> None:
        stream = shared["stream"]
        for event in events:
            await stream.ack(event)

    async def dead_letter(event: Any, reason: str, error_type: str) -> None:
        record = DlqRecord(
            source_topic=event.message.topic,
            source_partition=event.message.partition,
            source_offset=event.message.offset,
            key=event.key,
            value=event.value or b"",
            reason=reason,
            error_type=error_type,
            processor=PROCESSOR,
            time=time.time(),
        )
        await dlq_topic.send(key=event.message.topic.encode(), value=codec.encode(record))

    async def emit(ready: ReadyAttempt[Any]) -> None:
        rollout, attempt = ready.finished.rollout, ready.finished.attempt
        result = extract_triplets(ready.spans, config)
        metadata = attempt.metadata if isinstance(attempt.metadata, dict) else {}
        resources_id = metadata.get("resources_id") or rollout.resources_id
        snapshot = await (await resources()).get(resources_id) if resources_id else None
        record = TripletRecord(
            rollout_id=rollout.rollout_id,
            attempt_id=attempt.attempt_id,
            group_id=group_id_of(rollout),
            resources_id=resources_id,
            policy_version=policy_version_of(snapshot),
            triplets=result.triplets,
            final_reward=result.final_reward,
            finish_time=ready.finished.finish_time,
        )
        await triplets_topic.send(key=rollout.rollout_id.encode(), value=codec.encode(record))
        if result.issues or not ready.complete:
            log.info(
                "attempt's trace had issues",
                rollout=rollout.rollout_id,
                attempt=attempt.attempt_id,
                complete=ready.complete,
                spans=len(ready.spans),
                expected=ready.finished.expected_spans,
                issues=result.issues[:5],
            )
        await ack(ready.tokens)

    async def evicted(gone: list[EvictedAttempt[Any]]) -> None:
        for attempt in gone:
            log.warning(
                "spans of an unfinished attempt evicted",
                rollout=attempt.rollout_id,
                attempt=attempt.attempt_id,
                spans=attempt.spans,
                reason=attempt.reason,
            )
            await ack(attempt.tokens)

    @app.agent(source)
    async def build_triplets(stream: Any) -> None:
        manual = stream.noack()
        shared["stream"] = manual
        async for event in manual.events():
            now = time.monotonic()
            if event.value is None:  # a tombstone on the state topic: a forgotten rollout
                await ack([event])
                continue
            try:
                if event.message.topic == spans_topic:
                    ready, at_once = collector.add_span(codec.decode(event.value, Span), event, now)
                else:
                    ready, at_once = collector.add_state(codec.decode(event.value, RolloutState), event, now)
            except CodecError as error:
                await dead_letter(event, str(error), type(error).__name__)
                await ack([event])
                continue
            await ack(at_once)
            for attempt in ready:
                await emit(attempt)

    @app.timer(interval=max(0.2, min(1.0, settle_s / 5)))
    async def settle() -> None:
        if "stream" not in shared:
            return
        ready, gone = collector.tick(time.monotonic())
        for attempt in ready:
            await emit(attempt)
        await evicted(gone)

    @app.on_rebalance_complete.connect
    async def _ready(app_: Any, **_: Any) -> None:
        settings.run_dir.mkdir(parents=True, exist_ok=True)
        (settings.run_dir / "triplets.ready").write_text(str(os.getpid()))
        log.info("triplet builder ready", group=app.conf.id, partitions=partitions)

    app.agl_collector = collector  # type: ignore[attr-defined]
    return app


def main(settings: Settings, *, adapter: AdapterConfig | None = None, settle_s: float = 5.0) -> None:
    """Run the triplet builder in the foreground until SIGTERM/SIGINT."""
    from agl_stream.topics import load_topic_specs

    partitions = next(s.partitions for s in load_topic_specs() if s.name == "spans")
    app = create_app(settings, partitions=partitions, adapter=adapter, settle_s=settle_s)
    run_app(app, settings)
