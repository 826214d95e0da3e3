"""The batcher process against the real broker: whole groups, sizes, staleness, the DLQ, and
``kill -9`` while groups are open: every record ends in exactly one batch, none is lost."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from agl_stream.config import Settings
from agl_stream.kafka import admin
from agl_stream.kafka.io import Outbox, make_producer
from agl_stream.kafka.offsets import committed_offsets, end_offsets
from agl_stream.local.processes import role_environment, start_budget, stop_role
from agl_stream.models import DlqRecord, Triplet, TripletBatch, TripletRecord
from agl_stream.wire.codec import Codec
from processors.batcher import group_id
from tests.integration.helpers import read_to_end, read_topic

pytestmark = pytest.mark.integration

GROUP = 4
VERSION = 5
OPTIONS = ("--max-rollouts", "8", "--group-size", str(GROUP), "--max-staleness", "1", "--linger", "0.5")


def start_batcher(settings: Settings, *options: str, log_name: str) -> subprocess.Popen[bytes]:
    """``agl-stream batcher <options>`` as a child process (registered here in case the root
    command does not list it yet)."""
    launcher = (
        "from agl_stream.cli import app, main\n"
        "from agl_stream.cli.batcher_cmd import batcher\n"
        "app.command('batcher')(batcher)\n"
        "main()\n"
    )
    env = role_environment(settings)
    log_path = Path(settings.data_dir) / f"{log_name}.log"
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-c", launcher, "batcher", *options], env=env, stdout=log, stderr=subprocess.STDOUT
        )


def member(group: int, k: int, *, version: int = VERSION) -> TripletRecord:
    i = group * GROUP + k
    return TripletRecord(
        rollout_id=f"ro-{i:012x}",
        attempt_id=f"at-{i:08x}",
        group_id=f"g-{group}",
        policy_version=version,
        triplets=[Triplet(prompt_token_ids=[1, 2, 3], response_token_ids=[4, 5], reward=float(k))],
        final_reward=float(k),
        finish_time=1_700_000_000.0 + i,
    )


@dataclass(frozen=True)
class Written:
    record: TripletRecord
    partition: int
    offset: int


async def produce(settings: Settings, records: list[TripletRecord]) -> list[Written]:
    producer = make_producer(settings)
    await producer.start()
    try:
        typed = Outbox(settings, producer, "test")
        sent = await typed.send_many(settings.topic("triplets"), [(r.group_id, r) for r in records])
    finally:
        await producer.stop()
    return [Written(r, m.partition, m.offset) for r, m in zip(records, sent, strict=True)]


async def read_batches(settings: Settings) -> list[tuple[int, TripletBatch]]:
    """Every batch written so far, as (output partition, batch), in log order per partition."""
    codec = Codec.default()
    records = await read_to_end(settings, settings.topic("triplet-batches"), timeout=60)
    return [(r.partition, codec.decode(r.value, TripletBatch)) for r in records]


async def wait_for_batches(
    settings: Settings, done: Callable[[list[TripletBatch]], bool], *, timeout: float = 120.0
) -> list[TripletBatch]:
    deadline = time.monotonic() + timeout
    while True:
        batches = [b for _, b in await read_batches(settings)]
        if done(batches):
            return batches
        assert time.monotonic() < deadline, f"batches did not arrive: {len(batches)} so far"
        await asyncio.sleep(0.2)  # polling the output topic for a condition, with a deadline


def batched(batches: list[TripletBatch]) -> set[str]:
    return {r.rollout_id for b in batches for r in b.records}


def kill_9(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait(30)


async def check_exactly_once(
    settings: Settings, written: list[Written], stale: set[tuple[int, int]], complete: set[str]
) -> None:
    """Every valid record in exactly one batch, the stale ones counted as dropped once, whole
    groups only, gap-free sequences, and commits at the end of the topic."""
    log = await read_batches(settings)
    distinct: dict[str, TripletBatch] = {}
    for _, batch in log:
        # A batch may be re-sent after a lost acknowledgement, but only as the same batch.
        assert distinct.setdefault(batch.batch_id, batch).input_offsets == batch.input_offsets
    batches = list(distinct.values())
    places = Counter((b.source_partition, o) for b in batches for o in b.input_offsets)
    expected = {(w.partition, w.offset) for w in written} - stale
    assert set(places) == expected and set(places.values()) == {1}
    assert Counter(r.rollout_id for b in batches for r in b.records) == dict.fromkeys(complete, 1)
    dropped = {(b.source_partition, o) for b in batches for o in b.dropped_offsets}
    assert dropped == stale and sum(b.dropped_stale for b in batches) == len(stale)

    # Whole groups, at most 8 records (two groups) per batch, from one source partition each.
    sequences: dict[int, list[int]] = defaultdict(list)
    seen: set[str] = set()
    for output_partition, batch in log:
        assert batch.source_partition == output_partition
        assert len(batch.records) in (GROUP, 2 * GROUP) and batch.incomplete_groups == 0
        assert set(Counter(r.group_id for r in batch.records).values()) == {GROUP}
        assert batch.newest_policy_version == VERSION and batch.group_size == GROUP
        if batch.batch_id not in seen:
            seen.add(batch.batch_id)
            sequences[output_partition].append(batch.sequence)
    for partition, numbers in sequences.items():
        assert numbers == list(range(1, len(numbers) + 1)), partition

    # Everything decided: the group's commits reached the end of the topic.
    ends = await end_offsets(settings, settings.topic("triplets"))
    final = await committed_offsets(settings, group_id(settings))
    assert {tp.partition: o for tp, o in final.items()} == {tp.partition: o for tp, o in ends.items()}


async def test_batcher_killed_with_open_groups_loses_and_repeats_nothing(settings: Settings) -> None:
    await admin.apply(settings)
    codec = Codec.default()
    # Phase 1: groups 0-39 complete and 40-59 half, interleaved, so the half groups' first
    # records hold every partition's commit point while later groups go out in batches. A stale
    # group (versions far behind) and one undecodable record come in the middle.
    phase1 = [member(g, k) for k in range(2) for g in range(60)]
    phase1 += [member(100, k, version=VERSION - 3) for k in range(GROUP)]
    phase1 += [member(g, k) for k in range(2, GROUP) for g in range(40)]
    written = await produce(settings, phase1)
    producer = make_producer(settings)
    await producer.start()
    try:
        garbage = await producer.send_and_wait(settings.topic("triplets"), b"\xc3\x01garbage", key=b"g-7")
    finally:
        await producer.stop()
    stale = {(w.partition, w.offset) for w in written if w.record.group_id == "g-100"}
    complete = {member(g, k).rollout_id for g in range(40) for k in range(GROUP)}

    first = start_batcher(settings, *OPTIONS, log_name="batcher1")
    try:
        before_kill = await wait_for_batches(
            settings, lambda bs: batched(bs) >= complete and sum(b.dropped_stale for b in bs) == GROUP
        )
        kill_9(first)
    finally:
        stop_role(first)
    # The crash matters: batches hold records after the committed offsets, which a restart reads again.
    committed = {tp.partition: o for tp, o in (await committed_offsets(settings, group_id(settings))).items()}
    after_commit = [o for b in before_kill for o in b.input_offsets if o >= committed.get(b.source_partition or 0, 0)]
    assert len(after_commit) > 40, "the batcher committed past the open groups"

    # Phase 2, while the batcher is down: the half groups complete, 20 new groups, 10 new halves.
    phase2 = [member(g, k) for k in range(2, GROUP) for g in range(40, 60)]
    phase2 += [member(g, k) for k in range(GROUP) for g in range(60, 80)]
    phase2 += [member(g, k) for k in range(2) for g in range(80, 90)]
    written += await produce(settings, phase2)
    second = start_batcher(settings, *OPTIONS, log_name="batcher2")
    try:
        complete |= {member(g, k).rollout_id for g in range(40, 80) for k in range(GROUP)}
        await wait_for_batches(settings, lambda bs: batched(bs) >= complete)
        kill_9(second)
    finally:
        stop_role(second)

    written += await produce(settings, [member(g, k) for k in range(2, GROUP) for g in range(80, 90)])
    complete |= {member(g, k).rollout_id for g in range(80, 90) for k in range(GROUP)}
    third = start_batcher(settings, *OPTIONS, log_name="batcher3")
    try:
        await wait_for_batches(settings, lambda bs: batched(bs) >= complete)
    finally:
        assert stop_role(third) == 0  # SIGTERM: commits and exits cleanly

    await check_exactly_once(settings, written, stale, complete)

    # Dead-lettered (again after a restart if the crash came before its offset was committed).
    for dead in await read_topic(settings, settings.topic("dlq"), 1):
        record = codec.decode(dead.value, DlqRecord)
        assert (record.source_partition, record.source_offset) == (garbage.partition, garbage.offset)
        assert record.processor == "processor.batcher" and record.error_type == "NotSingleObjectEncodedError"


async def test_partitions_move_between_live_batchers_and_from_a_dead_one(settings: Settings) -> None:
    await admin.apply(settings)
    # Open halves first (they hold the commit points), then complete groups.
    written = await produce(settings, [member(g, k) for k in range(2) for g in range(40, 60)])
    written += await produce(settings, [member(g, k) for k in range(GROUP) for g in range(40)])
    complete = {member(g, k).rollout_id for g in range(40) for k in range(GROUP)}
    a = start_batcher(settings, *OPTIONS, log_name="batcher-a")
    b: subprocess.Popen[bytes] | None = None
    try:
        await wait_for_batches(settings, lambda bs: batched(bs) >= complete)
        # b joins: a hands some partitions over (committing up to their open halves) and b
        # recovers them from a's batches, which lie after those commit points.
        b = start_batcher(settings, *OPTIONS, log_name="batcher-b")
        # (Its log, not the shared ready file, which the other member may rewrite just after.)
        b_log = Path(settings.data_dir) / "batcher-b.log"
        deadline = time.monotonic() + start_budget(settings, "batcher")
        while "partition recovered" not in b_log.read_text(errors="replace"):
            assert time.monotonic() < deadline, "the second batcher never got partitions"
            await asyncio.sleep(0.1)  # polling b's log for its first assignment, with a deadline
        kill_9(a)
        # b takes a's partitions too once a's session expires, and gets the records that
        # complete every open group.
        written += await produce(settings, [member(g, k) for k in range(2, GROUP) for g in range(40, 60)])
        complete |= {member(g, k).rollout_id for g in range(40, 60) for k in range(GROUP)}
        await wait_for_batches(settings, lambda bs: batched(bs) >= complete)
    finally:
        stop_role(a)
        if b is not None:
            assert stop_role(b) == 0
    await check_exactly_once(settings, written, set(), complete)


async def test_val_and_test_records_are_refused_counted_and_never_batched(settings: Settings) -> None:
    await admin.apply(settings)
    # Each group gets a val and a test record of its own group id between its train records: same
    # partition, so the batch of that group reports them. Records without a mode (written before
    # records carried it) train.
    evaluation = [
        member(g, k).model_copy(update={"rollout_id": f"ro-e{g:02d}{k:09x}", "mode": mode})
        for g in range(20)
        for k, mode in ((10, "val"), (11, "test"))
    ]
    train = [
        member(g, k).model_copy(update={"mode": "train" if g % 2 else None}) for g in range(20) for k in range(GROUP)
    ]
    records = [r for g in range(20) for r in (*train[g * GROUP : g * GROUP + 2], *evaluation[2 * g : 2 * g + 2])]
    records += [r for g in range(20) for r in train[g * GROUP + 2 : (g + 1) * GROUP]]
    written = await produce(settings, records)
    refused = {(w.partition, w.offset) for w in written if w.record.mode in ("val", "test")}
    complete = {r.rollout_id for r in train}
    batcher = start_batcher(settings, *OPTIONS, log_name="batcher")
    try:
        await wait_for_batches(settings, lambda bs: batched(bs) >= complete)
    finally:
        assert stop_role(batcher) == 0
    batches = [b for _, b in await read_batches(settings)]
    assert not batched(batches) & {r.rollout_id for r in evaluation}
    assert {r.mode for b in batches for r in b.records} == {"train", None}
    assert sum(b.dropped_eval for b in batches) == len(refused) == 40
    assert {(b.source_partition, o) for b in batches for o in b.dropped_offsets} == refused
    log = (Path(settings.data_dir) / "batcher.log").read_text(errors="replace")
    assert "val/test records refused: never trained on" in log
    # Decided, so committed: the group's commits reached the end of the topic.
    ends = await end_offsets(settings, settings.topic("triplets"))
    final = await committed_offsets(settings, group_id(settings))
    assert {tp.partition: o for tp, o in final.items()} == {tp.partition: o for tp, o in ends.items()}
