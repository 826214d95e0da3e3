"""What a queued rollout costs the rollout processor: memory (tracemalloc) or CPU, no broker.

Hands ``--rollouts`` enqueue events (each with ``--input-bytes`` of task input and the client's
reply topic, as the store client writes them) to the processor's handler in batches of 1,000
(``RolloutProcessor.handle``: decode, pure fold, tracking, claim queue, state records and
answers, sent to stand-ins that acknowledge at once) and reports the bytes held per queued
rollout, with the biggest allocation sites. ``--cpu``: instead, the handler's CPU per enqueue
(no tracemalloc), best and median of ``--repeats`` runs, each with a fresh processor: the
processor's own share of an enqueue, to compare two trees side by side (run each in its tree).

    .venv/bin/python benchmarks/processor_memory.py --rollouts 20000 --input-bytes 200
    .venv/bin/python benchmarks/processor_memory.py --cpu --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time
import tracemalloc
from typing import Any

from aiokafka import ConsumerRecord, TopicPartition
from aiokafka.structs import RecordMetadata

from agl_stream.config import Settings
from agl_stream.ids import new_event_id, new_rollout_id
from agl_stream.kafka.io import Outbox
from agl_stream.models import Rollout, RolloutEnqueued, RolloutEvent
from agl_stream.store.replies import REPLY_HEADER
from agl_stream.wire.codec import Codec
from processors.rollouts import RolloutProcessor


class _Batch:
    """A producer batch that takes every record and keeps none."""

    def __init__(self) -> None:
        self.records = 0

    def append(self, **_: Any) -> bool:
        self.records += 1
        return True


class _Producer:
    """Acknowledges every send and batch at once and keeps nothing (the producer's own work on
    a record is not counted, by ``send`` or by a batch)."""

    def __init__(self) -> None:
        self.offset = 0

    async def send(self, topic: str, value: bytes | None, **_: Any) -> asyncio.Future[RecordMetadata]:
        return self._acknowledged(topic, 1)

    def create_batch(self) -> _Batch:
        return _Batch()

    async def send_batch(self, batch: _Batch, topic: str, *, partition: int) -> asyncio.Future[RecordMetadata]:
        return self._acknowledged(topic, batch.records, partition)

    def _acknowledged(self, topic: str, records: int, partition: int = 0) -> asyncio.Future[RecordMetadata]:
        done: asyncio.Future[RecordMetadata] = asyncio.get_running_loop().create_future()
        done.set_result(RecordMetadata(topic, partition, TopicPartition(topic, partition), self.offset, -1, 0, 0))
        self.offset += records
        return done


class _ReplyTopics:
    def __init__(self, real: Any) -> None:
        self.real = real

    def of(self, headers: Any) -> Any:
        return self.real.of(headers)

    def exists(self, name: str) -> bool:
        return True

    async def refresh(self, names: set[str]) -> None:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=20_000)
    parser.add_argument("--input-bytes", type=int, default=200, help="size of each task's input text")
    parser.add_argument("--top", type=int, default=8, help="allocation sites to show")
    parser.add_argument("--cpu", action="store_true", help="the handler's CPU per enqueue, not memory")
    parser.add_argument("--repeats", type=int, default=5, help="runs with --cpu (each a fresh processor)")
    args = parser.parse_args()

    settings = Settings(topic_prefix="mem", max_queued_per_partition=0)
    codec = Codec.default()
    topic = settings.topic("rollouts")
    reply_to = f"{settings.topic('replies')}.client-0123456789abcdef".encode()
    records: list[ConsumerRecord[bytes, bytes]] = []
    now = time.time()
    for offset in range(args.rollouts):
        rollout = Rollout(
            rollout_id=new_rollout_id(),
            input={"question": "x" * args.input_bytes, "id": offset},
            start_time=now,
            mode="train",
            resources_id="rs-0123456789ab",
            metadata={},
        )
        event = RolloutEvent(
            event_id=new_event_id(), rollout_id=rollout.rollout_id, time=now, writer="client",
            payload=RolloutEnqueued(rollout=rollout),
        )  # fmt: skip
        value = codec.encode(event)
        key = rollout.rollout_id.encode()
        records.append(
            ConsumerRecord(topic, 0, offset, 0, 0, key, value, None, len(key), len(value), [(REPLY_HEADER, reply_to)])
        )
    record_bytes = sum(len(r.value or b"") for r in records) / len(records)

    def new_processor() -> Any:
        producer = _Producer()
        outbox = Outbox(settings, producer, "memory", codec)  # type: ignore[arg-type]
        processor: Any = RolloutProcessor(settings, outbox, producer, codec)  # type: ignore[arg-type]
        processor.reply_topics = _ReplyTopics(processor.reply_topics)
        return processor

    async def fold_all(processor: Any) -> None:
        for start in range(0, len(records), 1000):
            await processor.handle({TopicPartition(topic, 0): records[start : start + 1000]})
            await asyncio.sleep(0)  # the answers' deliveries finish

    if args.cpu:
        runs = []
        for _ in range(args.repeats):
            processor = new_processor()
            gc.collect()
            started = time.process_time()
            asyncio.run(fold_all(processor))
            runs.append((time.process_time() - started) / args.rollouts * 1e6)
            assert len(processor.queue) == args.rollouts, (len(processor.queue), args.rollouts)
        print(
            f"{args.rollouts:,} enqueues, record {record_bytes:,.0f} bytes: handler CPU per enqueue "
            f"best {min(runs):.1f} us, median {statistics.median(runs):.1f} us ({len(runs)} runs)"
        )
        return

    processor = new_processor()
    gc.collect()
    tracemalloc.start(1)
    before = tracemalloc.take_snapshot()
    asyncio.run(fold_all(processor))
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    queued = len(processor.queue)
    assert queued == args.rollouts, (queued, args.rollouts)
    stats = after.compare_to(before, "lineno")
    held = sum(s.size_diff for s in stats)
    print(f"{args.rollouts:,} queued rollouts, enqueue record {record_bytes:,.0f} bytes")
    print(f"held by the processor: {held / 2**20:,.1f} MiB, {held / args.rollouts:,.0f} bytes per queued rollout")
    for stat in stats[: args.top]:
        frame = stat.traceback[0]
        print(f"  {stat.size_diff / args.rollouts:8,.0f} B/rollout  {frame.filename}:{frame.lineno}")


if __name__ == "__main__":
    main()
