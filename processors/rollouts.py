"""The rollout processor: folds agl.rollouts into rollout state, emits tasks, runs the watchdog.

A faust-streaming app: for each event it applies the pure fold (agl_stream/store/fold.py) to
the rollout's state and writes the new state to the compacted ``agl.rollout-state`` topic (the
faust table's changelog, which is also the read side's feed and the writer's reply), the
rollout's new tasks to ``agl.tasks``, and rejected events to ``agl.dlq`` with the reason. Those
writes are flushed before the input offset is committed; after a crash the replayed events at
or below a state's ``input_offset`` are skipped, so each event is applied exactly once (a
rejection may be dead-lettered twice).

The watchdog is a timer that folds nothing itself: it writes ``WatchdogFired`` events to
``agl.rollouts`` so verdicts are folded in order with everything else; a verdict that lost a
race with a heartbeat is ignored by the fold, so an attempt is never timed out twice.

Memory stays bounded: a finished rollout is forgotten (table entry deleted, a tombstone in the
changelog) ``finished_retention_s`` after it finished, when its partition next sees an event.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any

import faust
from aiokafka import AIOKafkaProducer

from agl_stream.codec import Codec
from agl_stream.config import Settings
from agl_stream.errors import CodecError
from agl_stream.ids import new_event_id
from agl_stream.kafka.faust_apps import RAW_TOPIC, make_app, run_app
from agl_stream.kafka.io import make_producer
from agl_stream.logs import get_logger
from agl_stream.models import DlqRecord, RolloutEvent, RolloutState, TaskItem, WatchdogFired
from agl_stream.models.base import QUEUING_STATUSES
from agl_stream.store.fold import FoldResult, fold
from agl_stream.store.watchdog import due_verdicts, next_deadline

log = get_logger("agl.processor")

PROCESSOR = "processor.rollouts"
_RAW = RAW_TOPIC


class RolloutStates:
    """Decoded rollout states of this worker's partitions, over the faust table of encoded ones.

    The table (bytes; changelog = agl.rollout-state) is what survives a restart: recovery
    replays the changelog through :meth:`recovered`, so the watchdog knows every live attempt
    again before the first new event arrives. The dict spares decoding the state per event.
    """

    def __init__(self, table: Any, codec: Codec) -> None:
        self.table = table
        self.codec = codec
        self.decoded: dict[str, tuple[int, RolloutState]] = {}  # rollout_id -> (partition, state)
        self.deadlines: dict[str, float] = {}  # rollout_id -> earliest possible watchdog verdict
        self.finished: dict[str, tuple[int, float]] = {}  # rollout_id -> (partition, finished_time)

    def get(self, rollout_id: str, partition: int) -> RolloutState | None:
        entry = self.decoded.get(rollout_id)
        if entry is not None:
            return entry[1]
        raw = self.table.get(rollout_id.encode())
        if raw is None:
            return None
        state = self.codec.decode(raw, RolloutState)
        self._track(state, partition)
        return state

    def put(self, state: RolloutState, partition: int) -> None:
        self.table[state.rollout.rollout_id.encode()] = self.codec.encode(state)
        self._track(state, partition)

    def forget(self, rollout_id: str) -> None:
        self._untrack(rollout_id)
        key = rollout_id.encode()
        if key in self.table:
            del self.table[key]

    async def recovered(self, event: Any) -> None:
        """A changelog record replayed while the table recovers (faust's on_changelog_event)."""
        rollout_id = (event.key or b"").decode()
        if event.value is None:
            self._untrack(rollout_id)
        else:
            self._track(self.codec.decode(event.value, RolloutState), event.message.partition)

    def _track(self, state: RolloutState, partition: int) -> None:
        rollout_id = state.rollout.rollout_id
        self.decoded[rollout_id] = (partition, state)
        deadline = next_deadline(state)
        if deadline is None:
            self.deadlines.pop(rollout_id, None)
        else:
            self.deadlines[rollout_id] = deadline
        if state.finished_time is not None:
            self.finished[rollout_id] = (partition, state.finished_time)
        else:
            self.finished.pop(rollout_id, None)

    def _untrack(self, rollout_id: str) -> None:
        self.decoded.pop(rollout_id, None)
        self.deadlines.pop(rollout_id, None)
        self.finished.pop(rollout_id, None)

    def expired(self, partition: int, before: float) -> list[str]:
        return [rid for rid, (p, t) in self.finished.items() if p == partition and t < before]

    def due(self, now: float) -> Iterable[RolloutState]:
        for rollout_id, deadline in list(self.deadlines.items()):
            entry = self.decoded.get(rollout_id)
            if deadline <= now and entry is not None:
                yield entry[1]

    def drop_partitions(self, partitions: set[int]) -> None:
        for rollout_id in [r for r, (p, _) in self.decoded.items() if p in partitions]:
            self._untrack(rollout_id)


def create_app(settings: Settings, *, partitions: int) -> faust.App:
    watchdog_interval_s = settings.watchdog_interval_s
    finished_retention_s = settings.finished_retention_s
    codec = Codec.default()
    # At-least-once with an idempotent fold (input_offset): see make_app.
    app = make_app(
        settings,
        PROCESSOR,
        partitions=partitions,
        producer_linger=0.002,  # batch the state/task writes of events arriving together
        broker_commit_every=100,
        broker_commit_interval=0.05,
        table_cleanup_interval=3600.0,
        table_standby_replicas=0,  # the changelog is the standby; recovery replays it
    )
    events_topic = app.topic(settings.topic("rollouts"), partitions=partitions, **_RAW)
    state_topic = app.topic(settings.topic("rollout-state"), partitions=partitions, **_RAW)
    tasks_topic = app.topic(settings.topic("tasks"), partitions=partitions, **_RAW)
    dlq_topic = app.topic(settings.topic("dlq"), **_RAW)
    states_holder: list[RolloutStates] = []

    async def on_changelog_event(event: Any) -> None:
        await states_holder[0].recovered(event)

    table = app.Table(
        "rollout-state",
        default=None,
        partitions=partitions,
        changelog_topic=state_topic,
        key_type=bytes,
        value_type=bytes,
        on_changelog_event=on_changelog_event,
    )
    states = RolloutStates(table, codec)
    states_holder.append(states)
    watchdog: dict[str, AIOKafkaProducer] = {}

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
        log.info("event rejected", partition=event.message.partition, offset=event.message.offset, reason=reason[:200])

    async def apply(event: Any, decoded: RolloutEvent) -> FoldResult | None:
        state = states.get(decoded.rollout_id, event.message.partition)
        if state is not None and event.message.offset <= state.input_offset:
            # Replayed after a restart: the state has this event's effects. Its task may not: a
            # crash can land the state record without the task record, so a queued rollout's
            # task is sent again (a duplicate claim just loses at the fold).
            if event.message.offset == state.input_offset and state.rollout.status in QUEUING_STATUSES:
                task = TaskItem(
                    task_id=state.cause_event_id,
                    rollout=state.rollout,
                    attempt_sequence_id=len(state.attempts) + 1,
                    enqueue_time=state.cause_time,
                )
                await tasks_topic.send(key=decoded.rollout_id.encode(), value=codec.encode(task))
            return None
        result = fold(state, decoded)
        if result.outcome == "applied" and result.state is not None:
            new_state = result.state.model_copy(update={"input_offset": event.message.offset})
            states.put(new_state, event.message.partition)
            for task in result.tasks:
                await tasks_topic.send(key=decoded.rollout_id.encode(), value=codec.encode(task))
        elif result.outcome == "rejected":
            await dead_letter(event, result.error or "rejected", "RejectedEvent")
        return result

    @app.agent(events_topic)
    async def fold_rollout_events(stream: Any) -> None:
        async for event in stream.events():
            try:
                decoded = codec.decode(event.value or b"", RolloutEvent)
            except CodecError as error:
                await dead_letter(event, str(error), type(error).__name__)
                continue
            if (event.key or b"").decode(errors="replace") != decoded.rollout_id:
                await dead_letter(event, f"key {event.key!r} is not the rollout id {decoded.rollout_id}", "KeyMismatch")
                continue
            await apply(event, decoded)
            # Forget finished rollouts of this partition inside this transaction (tombstones).
            for rollout_id in states.expired(event.message.partition, time.time() - finished_retention_s):
                states.forget(rollout_id)

    @app.timer(interval=watchdog_interval_s)
    async def run_watchdog() -> None:
        now = time.time()
        verdicts = [(s.rollout.rollout_id, v) for s in states.due(now) for v in due_verdicts(s, now)]
        if not verdicts:
            return
        producer = watchdog.get("producer")
        if producer is None:
            producer = watchdog["producer"] = make_producer(settings)
            await producer.start()
        for rollout_id, verdict in verdicts:
            event = RolloutEvent(
                event_id=new_event_id(), rollout_id=rollout_id, time=now, writer=PROCESSOR, payload=verdict
            )
            await producer.send(settings.topic("rollouts"), codec.encode(event), key=rollout_id.encode())
            # Until the verdict is folded, don't send it again on the next tick.
            states.deadlines[rollout_id] = now + max(watchdog_interval_s * 4, 1.0)
        await producer.flush()
        log.info("watchdog verdicts", count=len(verdicts))

    @app.on_partitions_revoked.connect
    async def forget_revoked(app_: Any, revoked: set[Any], **_: Any) -> None:
        gone = {tp.partition for tp in revoked if tp.topic == settings.topic("rollouts")}
        if gone:
            states.drop_partitions(gone)

    @app.on_rebalance_complete.connect
    async def _ready(app_: Any, **_: Any) -> None:
        # `agl-stream up` waits for this file: the processor owns partitions and folds events.
        settings.run_dir.mkdir(parents=True, exist_ok=True)
        (settings.run_dir / "processor.ready").write_text(str(os.getpid()))
        log.info("rollout processor ready", group=app.conf.id, partitions=partitions)

    app.agl_states = states  # type: ignore[attr-defined]
    app.agl_watchdog = watchdog  # type: ignore[attr-defined]
    _ = WatchdogFired  # the verdict record the watchdog writes (see due_verdicts)
    return app


def main(settings: Settings) -> None:
    """Run the processor in the foreground until SIGTERM/SIGINT."""
    from agl_stream.topics import load_topic_specs

    partitions = next(s.partitions for s in load_topic_specs() if s.name == "rollouts")
    app = create_app(settings, partitions=partitions)
    run_app(app, settings)
