"""Helpers for integration tests: role subprocesses, reading topics, the embedded ClickHouse."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from uuid import uuid4

from aiokafka import AIOKafkaConsumer, TopicPartition
from clickhouse_connect.driver.client import Client

from agl_stream.clickhouse.client import get_client
from agl_stream.config import Settings
from agl_stream.kafka.offsets import committed_offsets, end_offsets
from agl_stream.local import processes, stack
from agl_stream.local.processes import stop_role
from agl_stream.models import DlqRecord
from agl_stream.wire.codec import Codec

__all__ = [
    "REWARD_BY_MODE",
    "clickhouse",
    "dlq_records",
    "read_to_end",
    "read_topic",
    "serve",
    "start_role",
    "stop_role",
    "wait_committed_at_least",
]

# An independent reading of the rewards a run reports per mode: the latest reward span of each
# succeeded rollout, averaged per mode (`{db}`: the ClickHouse database).
REWARD_BY_MODE = """
SELECT r.mode AS mode, count() AS rollouts, avg(toFloat64(t.reward)) AS mean_reward
FROM (SELECT rollout_id, mode FROM {db}.rollouts FINAL WHERE status = 'succeeded') AS r
INNER JOIN (
    SELECT RolloutId, argMax(SpanAttributes['agentlightning.reward.0.value'], SequenceId) AS reward
    FROM {db}.otel_traces FINAL
    WHERE has(mapKeys(SpanAttributes), 'agentlightning.reward.0.value')
    GROUP BY RolloutId
) AS t ON t.RolloutId = r.rollout_id
GROUP BY r.mode ORDER BY r.mode
"""


@contextmanager
def local_stack(kafka_bootstrap: str, data_dir: Path, **overrides: Any) -> Iterator[Settings]:
    """A local stack of its own (processor, gateway, ingress) on the session's broker, on topics
    of its own; yields the settings its clients use and stops it after. ``overrides``: settings."""
    settings = Settings(
        kafka_bootstrap=kafka_bootstrap,
        data_dir=data_dir,
        topic_prefix=f"s{uuid4().hex[:10]}",
        gateway_port=0,
        **overrides,
    )
    stack.up(settings)
    try:
        yield stack.local_stack_settings(settings)
    finally:
        stack.down(settings)


def start_role(settings: Settings, *args: str, log_name: str = "role") -> subprocess.Popen[bytes]:
    """Start `python -m agl_stream <args>`, logging to the test's data dir."""
    return processes.start_role(settings, *args, log_path=Path(settings.data_dir) / f"{log_name}.log")


def serve(settings: Settings, *args: str, name: str, url: str) -> subprocess.Popen[bytes]:
    """Start a role that serves HTTP and wait for ``url`` to answer, as the Trainer waits: while
    it runs, up to its start budget (a model loading beside busy tests takes minutes)."""
    process = start_role(settings, *args, log_name=name)
    processes.wait_started(
        f"{name} ({url})",
        lambda: processes.answers_http(url),
        budget_s=processes.start_budget(settings, args[0]),
        exit_code=process.poll,
        log_path=Path(settings.data_dir) / f"{name}.log",
    )
    return process


async def wait_committed_at_least(
    settings: Settings, group: str, total: int, *, timeout: float = 60.0, topic: str | None = None
) -> int:
    """Wait until the group's committed offsets (of `topic`'s partitions, if given) add up to at
    least `total`; return the sum."""
    deadline = time.monotonic() + timeout
    while True:
        done = sum(o for tp, o in (await committed_offsets(settings, group)).items() if topic in (None, tp.topic))
        if done >= total:
            return done
        if time.monotonic() > deadline:
            raise TimeoutError(f"group {group} committed {done} < {total} after {timeout}s")
        await asyncio.sleep(0.02)


async def read_topic(settings: Settings, topic: str, count: int, *, timeout: float = 30.0) -> list[Any]:
    """Read exactly `count` records from the start of `topic` (fails if fewer arrive in time)."""
    consumer = AIOKafkaConsumer(
        topic,
        **settings.kafka_client_options(),
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    records: list[Any] = []
    try:
        deadline = time.monotonic() + timeout
        while len(records) < count and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=200)
            for messages in batch.values():
                records.extend(messages)
    finally:
        await consumer.stop()
    assert len(records) >= count, f"only {len(records)} of {count} records arrived on {topic}"
    return records


async def dlq_records(
    settings: Settings, count: int, where: Callable[[DlqRecord], bool], *, timeout: float = 30.0
) -> list[DlqRecord]:
    """The first ``count`` records on agl.dlq that ``where`` selects (fails if fewer arrive in time)."""
    codec = Codec.default()
    consumer = AIOKafkaConsumer(
        settings.topic("dlq"), **settings.kafka_client_options(), auto_offset_reset="earliest", enable_auto_commit=False
    )
    await consumer.start()
    found: list[DlqRecord] = []
    try:
        deadline = time.monotonic() + timeout
        while len(found) < count and time.monotonic() < deadline:
            for messages in (await consumer.getmany(timeout_ms=200)).values():
                found += [r for r in (codec.decode(m.value or b"", DlqRecord) for m in messages) if where(r)]
    finally:
        await consumer.stop()
    assert len(found) >= count, f"only {len(found)} of {count} DLQ records: {[r.reason for r in found]}"
    return found


async def read_to_end(settings: Settings, topic: str, *, timeout: float = 30.0) -> list[Any]:
    """Every record of `topic` up to its end offsets as of the call."""
    ends = await end_offsets(settings, topic)
    consumer = AIOKafkaConsumer(**settings.kafka_client_options(), enable_auto_commit=False)
    await consumer.start()
    records: list[Any] = []
    try:
        consumer.assign(list(ends))
        await consumer.seek_to_beginning(*ends)
        deadline = time.monotonic() + timeout
        while [tp for tp, end in ends.items() if await consumer.position(tp) < end]:
            assert time.monotonic() < deadline, f"{topic} not read to its end in {timeout}s"
            for tp, messages in (await consumer.getmany(timeout_ms=200)).items():
                records.extend(m for m in messages if m.offset < ends[tp])
    finally:
        await consumer.stop()
    return records


@contextmanager
def clickhouse(settings: Settings) -> Iterator[Client]:
    """The embedded engine for this test's data dir; closed after, so a child process can open it."""
    client = get_client(settings)
    try:
        yield client
    finally:
        client.close()


def partitions_total(offsets: dict[TopicPartition, int]) -> int:
    return sum(offsets.values())
