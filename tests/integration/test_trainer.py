"""The trainer against a real broker: every batch trained once across kill -9, bad batches dead-lettered."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agl_stream.config import Settings
from agl_stream.kafka import admin
from agl_stream.kafka.io import Outbox, make_producer
from agl_stream.local.processes import role_environment
from agl_stream.models import DlqRecord, ResourcesUpdate, TrainerStep, Triplet, TripletBatch, TripletRecord
from agl_stream.policy import load_checkpoint
from agl_stream.wire.codec import Codec
from tests.integration.helpers import read_to_end, read_topic, start_role, stop_role

pytestmark = pytest.mark.integration


def _batch(index: int, *, empty: bool = False, version: int | None = 0) -> TripletBatch:
    records = [
        TripletRecord(
            rollout_id=f"ro-{index:04d}{member:08d}",
            attempt_id=f"at-{index:04d}{member:04d}",
            group_id=f"g-{index}",
            policy_version=version,
            triplets=[
                Triplet(
                    prompt_token_ids=[2, 10 + member, 11, 1],
                    response_token_ids=[] if empty else [20 + member, 21, 1],
                    reward=float(member % 2),
                )
            ],
            final_reward=float(member % 2),
            finish_time=1.0,
        )
        for member in range(4)
    ]
    return TripletBatch(
        batch_id=f"tb-{index:04d}",
        records=records,
        created_time=1.0,
        min_policy_version=version,
        max_policy_version=version,
    )


def _progress(root: Path) -> dict:  # type: ignore[type-arg]
    path = root / "progress.json"
    return json.loads(path.read_text()) if path.exists() else {"trained": [], "skipped": []}


def _wait_progress(root: Path, process: subprocess.Popen[bytes], done: int, timeout: float = 300) -> dict:  # type: ignore[type-arg]
    # A deadline, not a speed goal: a trainer starting (torch) beside a busy test took ~2 min.
    deadline = time.monotonic() + timeout
    while True:
        progress = _progress(root)
        if len(progress["trained"]) + len(progress.get("skipped", [])) >= done:
            return progress
        assert process.poll() is None, "the trainer exited"
        assert time.monotonic() < deadline, f"trainer progress stuck at {progress}"
        time.sleep(0.05)  # another process's progress file


@pytest.mark.timeout(900)
async def test_a_killed_trainer_trains_every_batch_exactly_once(settings: Settings, tmp_path: Path) -> None:
    await admin.apply(settings)
    good = [_batch(i) for i in range(8)]
    bad = [_batch(100, empty=True), _batch(101, version=99)]  # empty responses; a version from the future
    producer = make_producer(settings)
    await producer.start()
    try:
        typed = Outbox(settings, producer, "test")
        # All into one partition (one key), in this order: bad ones in the middle.
        for batch in good[:3] + bad + good[3:]:
            await typed.send(settings.topic("triplet-batches"), batch, key="p0")
    finally:
        await producer.stop()
    root = tmp_path / "checkpoints"
    trainer = start_role(settings, "trainer", "--checkpoints", str(root), "--lr", "0.01", log_name="trainer")
    try:
        _wait_progress(root, trainer, 4)
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait()
        trainer = start_role(settings, "trainer", "--checkpoints", str(root), "--lr", "0.01", log_name="trainer2")
        progress = _wait_progress(root, trainer, 10)
    finally:
        stop_role(trainer, timeout=60)
    assert progress["trained"] == [b.batch_id for b in good]  # no duplicates, no gaps, in order
    assert sorted(progress["skipped"]) == ["tb-0100", "tb-0101"]
    assert progress["policy_version"] == 8 and (root / "v8").is_dir()
    codec = Codec.default()
    dlq = [codec.decode(r.value, DlqRecord) for r in await read_topic(settings, settings.topic("dlq"), 2)]
    reasons = " | ".join(d.reason for d in dlq)
    assert "future" in reasons or "version 99" in reasons
    assert len(dlq) >= 2
    published = [
        codec.decode(r.value, ResourcesUpdate) for r in await read_topic(settings, settings.topic("resources"), 9)
    ]
    versions = sorted({u.version for u in published})
    assert versions[-1] == 8 and 0 in versions
    # One TrainerStep per trained batch (the batch trained again after the kill may be sent twice).
    steps = [codec.decode(r.value, TrainerStep) for r in await read_to_end(settings, settings.topic("trainer-metrics"))]
    assert {s.batch_id for s in steps} == {b.batch_id for b in good}
    assert {s.policy_version for s in steps} == set(range(1, 9))
    assert all(s.tokens > 0 and s.samples == 4 and s.staleness is not None for s in steps)
    assert all(math.isfinite(s.metrics["loss"]) for s in steps)


async def test_the_verl_backend_trains_from_the_topic_on_two_ranks(settings: Settings, tmp_path: Path) -> None:
    """VERL's FSDP2 engine on two CPU ranks under torchrun: rank 0 reads Kafka, rank 1 follows."""
    await admin.apply(settings)
    good = [_batch(i) for i in range(3)]
    producer = make_producer(settings)
    await producer.start()
    try:
        typed = Outbox(settings, producer, "test")
        for batch in good:
            await typed.send(settings.topic("triplet-batches"), batch, key="p0")
    finally:
        await producer.stop()
    root = tmp_path / "checkpoints"
    code = _torchrun_trainer(settings, root, tmp_path / "torchrun.log", "--max-batches", "3")
    assert code == 0, (tmp_path / "torchrun.log").read_text()[-3000:]
    progress = _progress(root)
    assert progress["trained"] == [b.batch_id for b in good] and progress["policy_version"] == 3
    model, _ = load_checkpoint(root / "v3")  # an HF folder the inference backend (or vLLM) loads
    assert model.config.vocab_size > 0
    records = await read_to_end(settings, settings.topic("trainer-metrics"))
    steps = [Codec.default().decode(r.value, TrainerStep) for r in records]
    assert [s.batch_id for s in steps] == [b.batch_id for b in good]


def _torchrun_trainer(settings: Settings, root: Path, log_path: Path, *args: str) -> int:
    env = role_environment(settings)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["-m", "agl_stream", "trainer", "--backend", "verl", "--checkpoints", str(root), *args]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return process.wait(timeout=300)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)  # its own session: the ranks go with it
                process.wait()
