"""A local, always-current copy of the compacted ``agl.resources`` topic.

Runners (and anything else that resolves resources per rollout) keep one of these instead of
asking the read side for every rollout: it reads the topic from the beginning (compaction keeps
the latest snapshot per ``resources_id``) and then follows it. A lookup that misses first
catches up to the topic's current end, so a snapshot written before the lookup began is always
found; only an id that was never written stays missing.

``on_update`` callbacks see every snapshot as it arrives (the inference backend reloads its
weights when a new policy version is published).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from agl_stream.config import Settings
from agl_stream.errors import AglError
from agl_stream.kafka.io import IDLE_WAITS
from agl_stream.logs import describe, get_logger
from agl_stream.models import ResourcesUpdate
from agl_stream.wire.codec import Codec

log = get_logger("agl.store.resources")


class ResourcesCache:
    def __init__(self, settings: Settings, codec: Codec | None = None) -> None:
        self.settings = settings
        self.codec = codec or Codec.default()
        self.topic = settings.topic("resources")
        self.by_id: dict[str, ResourcesUpdate] = {}
        self.latest: ResourcesUpdate | None = None
        self._latest_position = (-1, -1)  # (partition, offset) of the latest snapshot
        self._positions: dict[int, int] = {}  # next offset to read, per partition
        self._progress = asyncio.Condition()
        self._consumer: AIOKafkaConsumer | None = None
        # Topic ends are asked on a connection of their own: the broker answers one request per
        # connection at a time, so on the follower's they waited behind its long-poll fetch
        # (up to fetch_max_wait_ms, 500 ms: every enqueue that pinned "no resources" paid it).
        self._ends: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None
        self._starting = asyncio.Lock()
        self.on_update: list[Callable[[ResourcesUpdate], None]] = []

    async def start(self) -> None:
        consumer = AIOKafkaConsumer(
            **self.settings.kafka_client_options(),
            enable_auto_commit=False,
            isolation_level="read_committed",
            # A new snapshot ends the broker's hold at once; a long hold only makes an idle
            # follower ask less often (topic ends are asked on ``_ends``, never behind it).
            **IDLE_WAITS,
        )
        await consumer.start()
        found = consumer.partitions_for_topic(self.topic)
        if not found:
            await consumer._client.force_metadata_update()
            found = consumer.partitions_for_topic(self.topic) or set()
        if not found:
            await consumer.stop()
            raise AglError(f"topic {self.topic} does not exist: run `agl-stream up` (or `agl-stream topics apply`)")
        partitions = [TopicPartition(self.topic, p) for p in sorted(found)]
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        self._consumer = consumer
        self._ends = AIOKafkaConsumer(**self.settings.kafka_client_options(), enable_auto_commit=False)
        try:
            await self._ends.start()
        except BaseException:
            await consumer.stop()
            raise
        self._task = asyncio.create_task(self._follow(), name="agl-resources-cache")
        await self.catch_up()

    async def started(self) -> ResourcesCache:
        """Start it on first use (callers at once wait for the one start)."""
        async with self._starting:
            if self._task is None:
                await self.start()
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._consumer is not None:
            await self._consumer.stop()
        if self._ends is not None:
            await self._ends.stop()

    async def catch_up(self, timeout: float = 30.0) -> None:
        """Wait until everything written to the topic before this call has been read."""
        assert self._consumer is not None and self._ends is not None, "start() first"
        ends = await self._ends.end_offsets(list(self._consumer.assignment()))

        def reached() -> bool:
            return all(self._positions.get(tp.partition, 0) >= end for tp, end in ends.items())

        async with self._progress:
            await asyncio.wait_for(self._progress.wait_for(reached), timeout)

    async def reach(self, offsets: Mapping[int, int], timeout: float = 30.0) -> None:
        """Wait until the records at ``offsets`` (partition -> offset) were read: a writer's own
        snapshots, without asking the broker anything."""

        def reached() -> bool:
            return all(self._positions.get(partition, 0) > offset for partition, offset in offsets.items())

        async with self._progress:
            await asyncio.wait_for(self._progress.wait_for(reached), timeout)

    async def get(self, resources_id: str | None) -> ResourcesUpdate | None:
        """The snapshot with this id (the latest one for ``None``), or None if none was ever written."""
        found = self.latest if resources_id is None else self.by_id.get(resources_id)
        if found is None:
            await self.catch_up()
            found = self.latest if resources_id is None else self.by_id.get(resources_id)
        return found

    async def _follow(self) -> None:
        assert self._consumer is not None
        consumer = self._consumer
        while True:
            try:
                batches = await consumer.getmany(timeout_ms=500)
                # Positions move even when a fetch returns nothing (control records, compacted gaps).
                positions = {tp.partition: await consumer.position(tp) for tp in consumer.assignment()}
            except asyncio.CancelledError:
                raise
            except Exception as error:  # a broker hiccup must not freeze the cache for good
                log.warning("reading resources failed; retrying", error=describe(error))
                continue
            for tp, messages in batches.items():
                for message in messages:
                    if message.value is not None:
                        self._apply(message.value, tp.partition, message.offset)
            async with self._progress:
                self._positions.update(positions)
                self._progress.notify_all()

    def _apply(self, value: bytes, partition: int, offset: int) -> None:
        try:
            update = self.codec.decode(value, ResourcesUpdate)
        except AglError as error:  # the sink dead-letters it; here it is only skipped
            log.warning("undecodable resources snapshot", partition=partition, offset=offset, error=describe(error))
            return
        self.by_id[update.resources_id] = update
        if (partition, offset) >= self._latest_position:
            self.latest, self._latest_position = update, (partition, offset)
        for callback in self.on_update:
            callback(update)


def snapshot(
    resources_id: str, resources: Mapping[str, Any], current: ResourcesUpdate | None = None
) -> ResourcesUpdate:
    """A snapshot of ``resources`` to publish under ``resources_id``: version 1, or the version
    after ``current``."""
    now = time.time()
    return ResourcesUpdate(
        resources_id=resources_id,
        create_time=now if current is None else current.create_time,
        update_time=now,
        version=1 if current is None else current.version + 1,
        resources=dict(resources),
    )
