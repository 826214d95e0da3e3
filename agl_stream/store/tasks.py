"""The task queue as seen by a claimer: a consumer-group member on agl.tasks.

Tasks are claimed in partition order (FIFO per partition). A task's offset is committed once
its claim was decided, won or lost, so a claimer that dies re-delivers only undecided tasks;
a re-delivered task whose rollout was claimed meanwhile is simply lost at the fold.
"""

from __future__ import annotations

import asyncio
from collections import deque

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, ConsumerRecord, TopicPartition
from aiokafka.errors import CommitFailedError, IllegalGenerationError, RebalanceInProgressError, UnknownMemberIdError
from aiokafka.structs import OffsetAndMetadata

from agl_stream.config import Settings
from agl_stream.kafka.io import make_consumer


class _Assigned(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, claimer: TaskClaimer) -> None:
        self.claimer = claimer

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        # Tasks fetched but not claimed yet belong to the partitions' next owner.
        gone = set(revoked)
        self.claimer.buffer = deque(r for r in self.claimer.buffer if TopicPartition(r.topic, r.partition) not in gone)

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        self.claimer.assigned.set()


class TaskClaimer:
    def __init__(self, settings: Settings, *, group_id: str | None = None, join_timeout: float = 30.0) -> None:
        self.settings = settings
        self.group_id = group_id or f"{settings.topic_prefix}.runners"
        self.join_timeout = join_timeout
        self.buffer: deque[ConsumerRecord[bytes, bytes]] = deque()
        self.assigned = asyncio.Event()
        self.consumer: AIOKafkaConsumer | None = None
        self.lock = asyncio.Lock()

    async def _ensure_started(self) -> AIOKafkaConsumer:
        if self.consumer is None:
            consumer = make_consumer(self.settings, group_id=self.group_id, max_poll_records=32, fetch_max_wait_ms=10)
            consumer.subscribe([self.settings.topic("tasks")], listener=_Assigned(self))
            await consumer.start()
            self.consumer = consumer
            # Joining the group is the one wait a claimer has; after it, claims never block.
            fetch = asyncio.create_task(consumer.getmany(timeout_ms=int(self.join_timeout * 1000), max_records=32))
            joined = asyncio.create_task(self.assigned.wait())
            await asyncio.wait({fetch, joined}, timeout=self.join_timeout, return_when=asyncio.FIRST_COMPLETED)
            if fetch.done():
                self._keep(fetch.result())
            else:
                fetch.cancel()
            joined.cancel()
        return self.consumer

    def _keep(self, fetched: dict[TopicPartition, list[ConsumerRecord[bytes, bytes]]]) -> None:
        for records in fetched.values():
            self.buffer.extend(records)

    async def next(self, *, timeout_ms: int = 20) -> ConsumerRecord[bytes, bytes] | None:
        """The oldest fetched task, fetching briefly if none is buffered; None if the queue is empty."""
        consumer = await self._ensure_started()
        if not self.buffer:
            self._keep(await consumer.getmany(timeout_ms=timeout_ms, max_records=32))
        return self.buffer.popleft() if self.buffer else None

    async def done(self, record: ConsumerRecord[bytes, bytes]) -> None:
        """The task's claim was decided: never deliver it again."""
        assert self.consumer is not None
        tp = TopicPartition(record.topic, record.partition)
        if tp in self.consumer.assignment():
            try:
                await self.consumer.commit({tp: OffsetAndMetadata(record.offset + 1, "")})
            except (CommitFailedError, IllegalGenerationError, RebalanceInProgressError, UnknownMemberIdError):
                # The partition moved mid-commit: its next owner gets the task again and loses
                # the claim at the fold, which already decided it. Nothing runs twice.
                pass

    async def stop(self) -> None:
        if self.consumer is not None:
            await self.consumer.stop()
            self.consumer = None
