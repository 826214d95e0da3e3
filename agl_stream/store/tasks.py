"""The task queue as seen by a claimer: a consumer-group member on agl.tasks.

Tasks are handed out in partition order (FIFO per partition) and may be claimed concurrently.
Offsets are committed in order: up to the oldest task whose claim is not decided yet, so a
claimer that dies re-delivers exactly the undecided tasks (and maybe some decided after them:
a re-delivered task whose rollout was claimed meanwhile is simply lost at the fold).

Commits are coalesced: deciding a task only moves a per-partition mark, and one background
commit per ``COMMIT_INTERVAL_S`` sends the marks. A commit per claim was one broker write per
rollout, a large share of the broker's work under load; a crash now re-delivers at most the
last interval's decided tasks, which lose at the fold like any stale task.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, ConsumerRecord, TopicPartition
from aiokafka.errors import CommitFailedError, IllegalGenerationError, RebalanceInProgressError, UnknownMemberIdError
from aiokafka.structs import OffsetAndMetadata

from agl_stream.config import Settings
from agl_stream.kafka.io import make_consumer

COMMIT_INTERVAL_S = 0.2


class _Assigned(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, claimer: TaskClaimer) -> None:
        self.claimer = claimer

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        # Decided tasks are committed while the partitions are still ours; tasks fetched but
        # not claimed yet belong to the partitions' next owner.
        await self.claimer.commit()
        gone = set(revoked)
        self.claimer.buffer = deque(r for r in self.claimer.buffer if TopicPartition(r.topic, r.partition) not in gone)
        for tp in gone:
            self.claimer.undecided.pop(tp, None)

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
        self.lock = asyncio.Lock()  # guards handing out tasks, not claiming them
        # Per partition: offsets handed out -> decided yet? Commits stop at the first undecided.
        self.undecided: dict[TopicPartition, dict[int, bool]] = {}
        self.to_commit: dict[TopicPartition, int] = {}  # next offset per partition, not sent yet
        self._committer: asyncio.Task[None] | None = None

    async def _ensure_started(self) -> AIOKafkaConsumer:
        if self.consumer is None:
            consumer = make_consumer(self.settings, group_id=self.group_id, max_poll_records=32)
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
        async with self.lock:
            consumer = await self._ensure_started()
            if not self.buffer:
                self._keep(await consumer.getmany(timeout_ms=timeout_ms, max_records=32))
            if not self.buffer:
                return None
            record = self.buffer.popleft()
            self.undecided.setdefault(TopicPartition(record.topic, record.partition), {})[record.offset] = False
            return record

    async def done(self, record: ConsumerRecord[bytes, bytes]) -> None:
        """The task's claim was decided: commit past it and every decided task before it."""
        assert self.consumer is not None
        tp = TopicPartition(record.topic, record.partition)
        handed = self.undecided.get(tp)
        if handed is None or record.offset not in handed:
            return  # the partition moved meanwhile; its new owner re-delivers
        handed[record.offset] = True
        decided = []
        for offset in sorted(handed):
            if not handed[offset]:
                break
            decided.append(offset)
        if not decided:
            return
        for offset in decided:
            del handed[offset]
        self.to_commit[tp] = decided[-1] + 1
        if self._committer is None or self._committer.done():
            self._committer = asyncio.create_task(self._commit_soon())

    async def _commit_soon(self) -> None:
        await asyncio.sleep(COMMIT_INTERVAL_S)  # coalescing window, not synchronisation
        await self.commit()

    async def commit(self) -> None:
        """Send the pending commit marks of the partitions this claimer still owns."""
        consumer = self.consumer
        if consumer is None or not self.to_commit:
            return
        owned = consumer.assignment()
        marks = {tp: OffsetAndMetadata(offset, "") for tp, offset in self.to_commit.items() if tp in owned}
        self.to_commit = {}
        if not marks:
            return
        try:
            await consumer.commit(marks)
        except (CommitFailedError, IllegalGenerationError, RebalanceInProgressError, UnknownMemberIdError):
            # The partition moved mid-commit: its next owner gets the task again and loses
            # the claim at the fold, which already decided it. Nothing runs twice.
            pass

    async def stop(self) -> None:
        if self._committer is not None:
            self._committer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._committer
        await self.commit()
        if self.consumer is not None:
            await self.consumer.stop()
            self.consumer = None
