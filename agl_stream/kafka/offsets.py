"""Offset fences: wait until a consumer group has committed past given positions.

A writer knows the (partition, offset) of what it wrote; a reader that needs to see it waits
until the group that materializes it has committed beyond that offset. Waiting is on the
condition with a deadline, polling the group coordinator; never a fixed sleep.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import CoordinatorLoadInProgressError, GroupCoordinatorNotAvailableError, NotCoordinatorError

from agl_stream.config import Settings
from agl_stream.errors import FenceTimeoutError
from agl_stream.kafka.admin import admin_client


async def end_offsets(settings: Settings, topic: str) -> dict[TopicPartition, int]:
    """The log-end offset of every partition of `topic`."""
    admin = admin_client(settings)
    await admin.start()
    try:
        described = await admin.describe_topics([topic])
    finally:
        await admin.close()
    tps = [TopicPartition(topic, p["partition"]) for d in described for p in d["partitions"]]
    consumer = AIOKafkaConsumer(**settings.kafka_client_options(), enable_auto_commit=False)
    await consumer.start()
    try:
        return dict(await consumer.end_offsets(tps)) if tps else {}
    finally:
        await consumer.stop()


async def _group_offsets(admin: AIOKafkaAdminClient, group_id: str) -> dict[TopicPartition, int]:
    try:
        offsets = await admin.list_consumer_group_offsets(group_id)
    except (GroupCoordinatorNotAvailableError, CoordinatorLoadInProgressError, NotCoordinatorError):
        # A new cluster creates __consumer_offsets on first use: nothing is committed yet.
        return {}
    return {tp: meta.offset for tp, meta in offsets.items() if meta.offset >= 0}


async def committed_offsets(settings: Settings, group_id: str) -> dict[TopicPartition, int]:
    """What `group_id` has committed, per partition (empty when it has committed nothing)."""
    admin = admin_client(settings)
    await admin.start()
    try:
        return await _group_offsets(admin, group_id)
    finally:
        await admin.close()


async def wait_for_group(
    settings: Settings,
    group_id: str,
    targets: Mapping[TopicPartition, int],
    *,
    timeout: float = 60.0,
    poll_interval: float = 0.05,
    on_progress: Callable[[int, int], None] | None = None,
) -> dict[TopicPartition, int]:
    """Return once `group_id` committed at least `targets` on every partition.

    ``on_progress(done, total)`` is called after each poll with the records covered so far.
    """
    total = sum(targets.values())
    deadline = time.monotonic() + timeout
    admin = admin_client(settings)
    await admin.start()
    try:
        while True:
            committed = await _group_offsets(admin, group_id)
            if on_progress is not None:
                on_progress(sum(min(committed.get(tp, 0), o) for tp, o in targets.items()), total)
            if all(committed.get(tp, 0) >= offset for tp, offset in targets.items()):
                return committed
            if time.monotonic() > deadline:
                behind = {f"{tp.topic}[{tp.partition}]": (committed.get(tp, 0), o) for tp, o in targets.items()}
                raise FenceTimeoutError(f"group {group_id} did not reach its target offsets in {timeout}s: {behind}")
            await asyncio.sleep(poll_interval)
    finally:
        await admin.close()


async def fence_at_end(settings: Settings, topic_name: str) -> dict[str, dict[int, int]]:
    """A read fence covering every record written to a topic so far (the last one of each partition).

    For readers of records other processes wrote: a query behind it sees all of them.
    ``topic_name`` is the short name (``"spans"``); the fence uses the full one.
    """
    topic = settings.topic(topic_name)
    ends = await end_offsets(settings, topic)
    return {topic: {tp.partition: end - 1 for tp, end in ends.items() if end > 0}}
