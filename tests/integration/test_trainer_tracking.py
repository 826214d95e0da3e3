"""The trainer role with --track tensorboard: a real run on batches from Kafka writes every step's
metrics to TensorBoard event files, the same numbers it publishes on agl.trainer-metrics."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agl_stream.config import Settings
from agl_stream.kafka import admin
from agl_stream.kafka.io import Outbox, make_producer
from agl_stream.models import TrainerStep, Triplet, TripletBatch, TripletRecord
from agl_stream.training.tracking import metric_name
from agl_stream.wire.codec import Codec
from tests.integration.helpers import read_to_end, start_role, stop_role

pytestmark = pytest.mark.integration

BATCHES = 3


def _batch(index: int) -> TripletBatch:
    records = [
        TripletRecord(
            rollout_id=f"ro-{index:04d}{member:08d}",
            attempt_id=f"at-{index:04d}{member:04d}",
            group_id=f"g-{index}",
            policy_version=0,
            triplets=[
                Triplet(
                    prompt_token_ids=[2, 10 + member, 11, 1],
                    response_token_ids=[20 + member, 21, 1],
                    reward=float(member % 2),
                )
            ],
            final_reward=float(member % 2),
            finish_time=1.0,
        )
        for member in range(4)
    ]
    return TripletBatch(
        batch_id=f"tb-{index:04d}", records=records, created_time=1.0, min_policy_version=0, max_policy_version=0
    )


@pytest.mark.timeout(900)
async def test_a_trainer_run_writes_its_steps_to_tensorboard(settings: Settings, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing import event_accumulator  # type: ignore[import-untyped]

    await admin.apply(settings)
    producer = make_producer(settings)
    await producer.start()
    try:
        outbox = Outbox(settings, producer, "test")
        for index in range(BATCHES):
            await outbox.send(settings.topic("triplet-batches"), _batch(index), key="p0")
    finally:
        await producer.stop()
    root = tmp_path / "checkpoints"
    flags = ["--checkpoints", str(root), "--max-batches", str(BATCHES), "--track", "tensorboard"]
    flags += ["--track-project", "it", "--track-run", "tracked"]
    trainer = start_role(settings, "trainer", *flags, log_name="trainer")
    try:
        # A deadline, not a speed goal: the trainer stops by itself after --max-batches.
        await asyncio.to_thread(trainer.wait, 600)
    finally:
        stop_role(trainer, timeout=60)
    log = (Path(settings.data_dir) / "trainer.log").read_text()
    assert trainer.returncode == 0, log[-3000:]

    codec = Codec.default()
    records = await read_to_end(settings, settings.topic("trainer-metrics"))
    steps = {s.policy_version: s for s in (codec.decode(r.value, TrainerStep) for r in records)}
    assert sorted(steps) == list(range(1, BATCHES + 1))

    events = event_accumulator.EventAccumulator(str(root / "tracking" / "tensorboard" / "it" / "tracked"))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    published = {metric_name(key) for step in steps.values() for key in step.metrics if key != "policy_version"}
    assert {"actor/loss", "reward/mean", "perf/tokens_per_s", "staleness/batch"} | published <= scalars
    loss = [(e.step, e.value) for e in events.Scalars("actor/loss")]
    assert loss == [(v, pytest.approx(steps[v].metrics["loss"], rel=1e-5)) for v in sorted(steps)]
    samples = [(e.step, e.value) for e in events.Scalars("perf/samples")]
    assert samples == [(v, float(steps[v].samples)) for v in sorted(steps)]
    trained = [e.value for e in events.Scalars("trainer/trained_batches")]
    assert trained == [float(n) for n in range(1, BATCHES + 1)]
