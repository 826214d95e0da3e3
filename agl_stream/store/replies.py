"""Replies addressed to their writer: one reply topic per store client (Kafka's request-reply).

Concurrency model: a :class:`ReplyChannel` belongs to one event loop; one task reads the
client's topic and resolves the futures registered on that loop. :class:`ReplyTopics` is used
by the processor's single task.

Every store client creates ``<prefix>.replies.<client id>`` (one partition) when it starts and
deletes it when it closes. An event that wants an answer carries the topic in its
``agl-reply-to`` header (a store request in its ``reply_to`` field); the processor writes the
:class:`~agl_stream.models.Reply` there. So a client reads its own answers and nothing else:
the cost of a reply does not grow with the number of clients. A client killed with -9 leaves
its topic behind: a live client writes a keepalive record to its own topic every
``KEEPALIVE_S``, and :func:`prune_reply_topics` (``agl-stream topics prune-replies``; the
processor runs it hourly) deletes reply topics whose newest record is older than ``idle_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from agl_stream.config import Settings
from agl_stream.domain.queue import QUEUE_FULL
from agl_stream.errors import AglError, CodecError
from agl_stream.kafka.admin import admin_client, broker_count
from agl_stream.kafka.io import IDLE_WAITS
from agl_stream.logs import describe, get_logger
from agl_stream.models import Reply
from agl_stream.wire.codec import Codec
from agl_stream.wire.reply_wire import replies_of

__all__ = [
    "REPLY_HEADER",
    "REPLY_STATE_HEADER",
    "QueueFullError",
    "RejectedError",
    "ReplyChannel",
    "ReplyTopics",
    "prune_reply_topics",
    "reply_topic",
]

log = get_logger("agl.store.replies")

REPLY_HEADER = "agl-reply-to"
REPLY_STATE_HEADER = "agl-reply-state"
"""Present (any value): the answer carries the rollout's state; absent: just the verdict."""
REPLY_RETENTION_MS = 3_600_000  # an answer nobody read within an hour is useless
KEEPALIVE_S = 300.0
PRUNE_IDLE_S = 1_800.0  # six missed keepalives
_CLIENT_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


class RejectedError(AglError, ValueError):
    """The processor rejected the event (unknown id, illegal transition, ...); the reason says why.

    A ValueError, as the LightningStore contract asks for missing ids and invalid updates.
    """


class QueueFullError(RejectedError):
    """The processor refused an enqueue: the queue of the rollout's partition is at its limit
    (``AGL_MAX_QUEUED_PER_PARTITION``). The rollout does not exist; enqueue it again once runners
    claimed queued rollouts. Of an ``enqueue_many_rollouts`` call, others may have been enqueued.
    """


def reply_topic(settings: Settings, client_id: str) -> str:
    """The reply topic of one store client."""
    if _CLIENT_ID.fullmatch(client_id) is None:
        raise ValueError(f"a client id is 1-64 letters, digits, '-' or '_', not {client_id!r}")
    return f"{settings.topic('replies')}.{client_id}"


class ReplyTopics:
    """The processor's view of reply topics: which names are valid, which exist.

    Producing to a topic that does not exist would hold a batch until the producer times out,
    so answers go only to topics seen in the cluster's metadata, looked up again when an unknown
    one is named (once per batch at most) and every few seconds (clients delete theirs on close).
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.prefix = f"{settings.topic('replies')}."
        self._known: set[str] = set()
        self._looked = 0.0
        self._admin: AIOKafkaAdminClient | None = None

    def valid(self, name: str) -> bool:
        return name.startswith(self.prefix) and _CLIENT_ID.fullmatch(name[len(self.prefix) :]) is not None

    def of(self, headers: Sequence[tuple[str, bytes]] | None) -> tuple[str | None, bool]:
        """The valid reply topic the headers name (None: no answer wanted, or a bad name) and
        whether the answer should carry the state."""
        topic: str | None = None
        with_state = False
        for name, value in headers or ():
            if name == REPLY_HEADER:
                candidate = value.decode(errors="replace")
                topic = candidate if self.valid(candidate) else None
            elif name == REPLY_STATE_HEADER:
                with_state = True
        return topic, with_state

    def exists(self, name: str) -> bool:
        return name in self._known

    def gone(self, name: str) -> None:
        """A send found the topic missing: stop answering there until it shows up again."""
        self._known.discard(name)

    async def refresh(self, names: set[str]) -> bool:
        """Look the reply topics up again when ``names`` holds one not known, or every few
        seconds; True when it looked."""
        if names <= self._known and time.monotonic() - self._looked < 5.0:
            return False
        self._looked = time.monotonic()
        if self._admin is None:
            self._admin = admin_client(self.settings)
            await self._admin.start()
        topics = await self._admin.list_topics()
        self._known = {t for t in topics if t.startswith(self.prefix)}
        return True

    async def close(self) -> None:
        if self._admin is not None:
            await self._admin.close()


class ReplyChannel:
    """A store client's reply topic: futures for answers, and a hook for notices."""

    def __init__(self, settings: Settings, client_id: str, codec: Codec | None = None) -> None:
        self.settings = settings
        self.codec = codec or Codec.default()
        self.topic = reply_topic(settings, client_id)
        self._pending: dict[str, asyncio.Future[Reply]] = {}
        self.on_state: Callable[[Reply], None] | None = None
        """Called with every reply that carries a state (answers and notices alike)."""
        self.on_queue: Callable[[Reply], None] | None = None
        """Called, in arrival order, with every claim answer that names partitions (empty, or
        with the rollout that emptied their queues) and every notice that work was queued (a
        notice without a state that names partitions)."""
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None
        self._keepalive: asyncio.Task[None] | None = None
        self.send_keepalive: Callable[[str, bytes], Awaitable[object]] | None = None
        """How the client writes to its own topic (set by the store client)."""

    async def start(self) -> None:
        admin = admin_client(self.settings)
        await admin.start()
        try:
            replication = min(self.settings.replication_factor or 3, await broker_count(admin))
            configs = {
                "retention.ms": str(REPLY_RETENTION_MS),
                "cleanup.policy": "delete",
                "min.insync.replicas": str(max(1, min(2, replication - 1))),
            }
            response = await admin.create_topics([NewTopic(self.topic, 1, replication, topic_configs=configs)])
            codes = [code for _, code, *_ in response.topic_errors if code != 0]
            if codes:
                raise AglError(f"cannot create the reply topic {self.topic} (Kafka error codes {codes})")
        finally:
            await admin.close()
        consumer = AIOKafkaConsumer(
            **self.settings.kafka_client_options(),
            enable_auto_commit=False,
            isolation_level="read_committed",
            **IDLE_WAITS,  # an answer ends the hold at once
        )
        await consumer.start()
        partition = TopicPartition(self.topic, 0)
        for _ in range(50):  # the new topic's metadata reaches the broker we ask within moments
            if consumer.partitions_for_topic(self.topic):
                break
            await consumer._client.force_metadata_update()
            await asyncio.sleep(0.02)  # metadata propagation has no event to wait on
        consumer.assign([partition])
        await consumer.seek_to_beginning(partition)
        self._consumer = consumer
        self._task = asyncio.create_task(self._run(), name="agl-store-replies")
        self._keepalive = asyncio.create_task(self._keep_alive(), name="agl-store-replies-keepalive")

    async def stop(self) -> None:
        for task in (self._task, self._keepalive):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._consumer is not None:
            await self._consumer.stop()
        for future in self._pending.values():
            if not future.done():
                future.cancel()
        admin = admin_client(self.settings)
        try:
            await admin.start()
            await admin.delete_topics([self.topic])
        except Exception as error:
            log.warning("could not delete the reply topic; prune it later", topic=self.topic, error=describe(error))
        finally:
            await admin.close()

    async def _keep_alive(self) -> None:
        """Say "still here" on our own topic now and then, so pruning leaves it alone."""
        record = self.codec.encode(Reply(request_id="", outcome="notice"))
        while True:
            if self.send_keepalive is not None:
                try:
                    await self.send_keepalive(self.topic, record)
                except Exception as error:
                    log.warning("keepalive failed; the next one tries again", topic=self.topic, error=describe(error))
            await asyncio.sleep(KEEPALIVE_S)  # the keepalive's period, not a wait on state

    def expect(self, request_id: str) -> asyncio.Future[Reply]:
        """Register before sending, so the answer cannot slip past."""
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        future.add_done_callback(lambda done: self._forget(request_id, done))
        return future

    @contextlib.contextmanager
    def expecting(self, request_ids: Iterable[str]) -> Iterator[list[asyncio.Future[Reply]]]:
        """:meth:`expect` each request; the futures still unanswered on leaving are cancelled
        (their caller stopped waiting)."""
        futures = [self.expect(request_id) for request_id in request_ids]
        try:
            yield futures
        finally:
            for future in futures:
                if not future.done():
                    future.cancel()

    def _forget(self, request_id: str, future: asyncio.Future[Reply]) -> None:
        # Only this future: the same request may be expected again (a claim sent anew).
        if self._pending.get(request_id) is future:
            del self._pending[request_id]

    async def _run(self) -> None:
        assert self._consumer is not None
        while True:
            try:
                batches = await self._consumer.getmany(timeout_ms=1000)
            except asyncio.CancelledError:
                raise
            except Exception as error:
                log.warning("reading replies failed; retrying", error=describe(error))
                continue
            for messages in batches.values():
                for message in messages:
                    self._on_record(message.value or b"")

    def _on_record(self, value: bytes) -> None:
        try:
            replies = replies_of(self.codec, value)
        except CodecError as error:
            log.warning("undecodable reply", error=describe(error))
            return
        for reply in replies:
            self._on_reply(reply)

    def _on_reply(self, reply: Reply) -> None:
        if reply.state is not None and self.on_state is not None:
            self.on_state(reply)
        if self.on_queue is not None and reply.covered_partitions:
            self.on_queue(reply)  # only claim answers and notices of queued work name partitions
        if reply.outcome == "notice":
            return
        future = self._pending.get(reply.request_id)
        if future is None or future.done():
            return  # a second answer after a processor restart, or one we stopped waiting for
        if reply.outcome == "rejected":
            reason = reply.error or "rejected"
            future.set_exception((QueueFullError if reason.startswith(QUEUE_FULL) else RejectedError)(reason))
        else:
            future.set_result(reply)


async def prune_reply_topics(settings: Settings, *, idle_s: float = PRUNE_IDLE_S) -> list[str]:
    """Delete the reply topics of clients gone for ``idle_s`` (no record, keepalives included,
    for that long; an empty topic counts as gone). Returns the names deleted."""
    prefix = f"{settings.topic('replies')}."
    admin = admin_client(settings)
    await admin.start()
    consumer = AIOKafkaConsumer(**settings.kafka_client_options(), enable_auto_commit=False)
    await consumer.start()
    try:
        names = [t for t in await admin.list_topics() if t.startswith(prefix)]
        if not names:
            return []
        partitions = [TopicPartition(name, 0) for name in names]
        ends = await consumer.end_offsets(partitions)
        cutoff_ms = (time.time() - idle_s) * 1000
        idle = []
        for tp in partitions:
            if ends[tp] == 0:
                idle.append(tp.topic)
                continue
            consumer.assign([tp])
            consumer.seek(tp, ends[tp] - 1)
            fetched = await consumer.getmany(tp, timeout_ms=2000, max_records=1)
            records = fetched.get(tp, [])
            if records and records[-1].timestamp < cutoff_ms:
                idle.append(tp.topic)
        if idle:
            await admin.delete_topics(idle)
        return idle
    finally:
        await consumer.stop()
        await admin.close()
