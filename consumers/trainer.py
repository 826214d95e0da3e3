"""The trainer: consumes agl.triplet-batches, updates the policy, publishes each new version.

For every batch: validate it and build VERL's ``DataProto`` (``agl_stream.training.data``),
train one step through the policy backend (``agl_stream.training.backend``), save the new
weights as checkpoint ``<checkpoints>/v<version>``, publish a ResourcesUpdate naming it (a
``ModelCheckpoint`` the inference backend reloads, and the ``ProxyLLM`` runners call), and
record progress.

**Exactly-once training** rests on one file, ``<checkpoints>/progress.json``, replaced
atomically after a checkpoint is complete: the checkpoint it names, the next offset to read of
every partition, and the ids of the batches trained so far. A trainer killed at any instant
restarts from that file: it loads that checkpoint (weights and optimizer state) and seeks to
those offsets, so a batch whose step was not recorded is trained again on the recorded
weights, and a recorded one never is. Kafka's committed offsets are also updated, but only
for monitoring. The last checkpoint's resources are published again at start (idempotent), in
case the trainer died between saving and publishing.

Bad batches (empty responses, mismatched lengths, a policy version from the future) go to
agl.dlq with the reason, and the trainer moves past them (their offsets are recorded too).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import OffsetAndMetadata

from agl_stream import metrics as agl_metrics  # `metrics` here names a step's numbers
from agl_stream.config import Settings
from agl_stream.errors import AglError, CodecError
from agl_stream.ids import new_resources_id
from agl_stream.kafka.io import IDLE_WAITS, Outbox, Rejected
from agl_stream.local.processes import run_until_stopped
from agl_stream.logs import get_logger
from agl_stream.models import ModelCheckpoint, ProxyLLM, ResourcesUpdate, TrainerStep, TripletBatch
from agl_stream.rl_options import TrainerOptions
from agl_stream.wire.codec import Codec

if TYPE_CHECKING:
    from agl_stream.training.tracking import Tracking

log = get_logger("agl.trainer")

PROCESSOR = "trainer"
PROGRESS_FILE = "progress.json"


class FutureVersionError(AglError, ValueError):
    """A batch claims a policy version the trainer has not produced yet."""


@dataclass
class Progress:
    """What progress.json holds: the source of truth for what has been trained."""

    checkpoint: str | None = None  # directory name under the checkpoints root
    policy_version: int = 0
    offsets: dict[int, int] = field(default_factory=dict)  # partition -> next offset to read
    trained: list[str] = field(default_factory=list)  # batch ids, in training order
    skipped: list[str] = field(default_factory=list)  # batch ids dead-lettered

    @classmethod
    def load(cls, root: Path) -> Progress:
        path = root / PROGRESS_FILE
        if not path.exists():
            return cls()
        data = json.loads(path.read_text())
        return cls(
            checkpoint=data["checkpoint"],
            policy_version=int(data["policy_version"]),
            offsets={int(p): int(o) for p, o in data["offsets"].items()},
            trained=list(data["trained"]),
            skipped=list(data.get("skipped", [])),
        )

    def save(self, root: Path) -> None:
        body = json.dumps(
            {
                "checkpoint": self.checkpoint,
                "policy_version": self.policy_version,
                "offsets": {str(p): o for p, o in sorted(self.offsets.items())},
                "trained": self.trained,
                "skipped": self.skipped,
            },
            indent=1,
        )
        tmp = root / f".{PROGRESS_FILE}.tmp"
        with open(tmp, "w") as handle:
            handle.write(body)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, root / PROGRESS_FILE)


@dataclass
class TrainerStats:
    trained: int = 0
    skipped: int = 0
    tokens: int = 0
    busy_s: float = 0.0
    idle_s: float = 0.0
    staleness: list[float] = field(default_factory=list)  # policy versions behind, per trained batch


class PolicyTrainer:
    """The trainer role: trains the policy on each triplet batch and publishes every new version
    (not the seed's :class:`agl_stream.trainer.Trainer`, which runs a whole training job)."""

    def __init__(self, settings: Settings, options: TrainerOptions) -> None:
        self.settings = settings
        self.options = options
        self.codec = Codec.default()
        self.root = options.checkpoints
        self.root.mkdir(parents=True, exist_ok=True)
        self.progress = Progress.load(self.root)
        self.backend: Any = None
        self.stats = TrainerStats()
        self.tracking: Tracking | None = None  # --track: each step to TensorBoard, W&B, MLflow

    # -- checkpoints ----------------------------------------------------------------------

    def _open_backend(self) -> None:
        from agl_stream.training import open_backend

        # With the verl backend under torchrun, the other ranks open the same checkpoint
        # (follower_main); rank 0 tells them which one progress.json names.
        checkpoint = _shared_with_ranks(self.options, self.progress.checkpoint)
        if checkpoint is not None:
            self.backend = open_backend(self.options.backend, self.root / checkpoint)
            log.info("resumed", checkpoint=checkpoint, trained=len(self.progress.trained))
            return
        self.backend = open_backend(self.options.backend, self.options.initial_model, **self.options.backend_options())
        self._save_checkpoint()  # version 0: what the inference backend starts from

    def _save_checkpoint(self) -> None:
        name = f"v{self.backend.policy_version}"
        self.backend.save(self.root / name)
        self.progress.checkpoint = name
        self.progress.policy_version = self.backend.policy_version
        self.progress.save(self.root)

    def resources(self) -> ResourcesUpdate:
        version = self.progress.policy_version
        resources: dict[str, Any] = {
            "checkpoint": ModelCheckpoint(
                uri=str((self.root / (self.progress.checkpoint or "")).resolve()),
                model=self.options.model_name,
                policy_version=version,
            )
        }
        if self.options.proxy_endpoint:
            resources["policy"] = ProxyLLM(endpoint=self.options.proxy_endpoint, model=self.options.model_name)
        now = time.time()
        return ResourcesUpdate(
            resources_id=new_resources_id(), create_time=now, update_time=now, version=version, resources=resources
        )

    # -- the loop -------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> TrainerStats:
        from agl_stream.training.tracking import open_tracking

        await asyncio.to_thread(self._open_backend)
        self.tracking = open_tracking(self.options)  # its backends start on a thread of their own
        try:
            async with Outbox.started(self.settings, PROCESSOR, self.codec) as outbox:
                await self._consume(stop, outbox)
        finally:
            if self.backend is not None and hasattr(self.backend, "close"):
                self.backend.close()  # releases the other ranks of a verl backend
            if self.tracking is not None:
                await asyncio.to_thread(self.tracking.close)
        log.info("trainer stopped", **{k: v for k, v in vars(self.stats).items() if k != "staleness"})
        return self.stats

    async def _consume(self, stop: asyncio.Event, outbox: Outbox) -> None:
        topic = self.options.batches_topic or self.settings.topic("triplet-batches")
        group = f"{self.settings.topic_prefix}.{PROCESSOR}"
        consumer = AIOKafkaConsumer(
            **self.settings.kafka_client_options(),
            group_id=group,  # for monitoring only: offsets live in progress.json
            enable_auto_commit=False,
            isolation_level="read_committed",
            max_partition_fetch_bytes=64 << 20,
            fetch_max_bytes=128 << 20,
            **IDLE_WAITS,  # a new batch ends the hold at once
        )
        await consumer.start()
        try:
            await self._publish(outbox)
            found = consumer.partitions_for_topic(topic)
            if not found:  # metadata of a topic nobody subscribed to yet
                await consumer._client.force_metadata_update()
                found = consumer.partitions_for_topic(topic)
            partitions = [TopicPartition(topic, p) for p in sorted(found or [])]
            if not partitions:
                raise AglError(f"topic {topic} does not exist: run `agl-stream up`")
            consumer.assign(partitions)
            for tp in partitions:
                offset = self.progress.offsets.get(tp.partition)
                if offset is None:
                    await consumer.seek_to_beginning(tp)
                else:
                    consumer.seek(tp, offset)
            idle_since = time.monotonic()
            limit = self.options.max_batches
            while not stop.is_set() and (limit is None or self.stats.trained < limit):
                fetched = await consumer.getmany(timeout_ms=500, max_records=1)
                if not fetched:
                    continue
                idle = time.monotonic() - idle_since
                self.stats.idle_s += idle
                for tp, messages in fetched.items():
                    agl_metrics.RECORDS_IN.labels(agl_metrics.role(), group, tp.topic).inc(len(messages))
                    for message in messages:
                        await self._one(message, outbox, idle)
                        self.progress.offsets[tp.partition] = message.offset + 1
                        self.progress.save(self.root)
                await consumer.commit(
                    {TopicPartition(topic, p): OffsetAndMetadata(o, "") for p, o in self.progress.offsets.items()}
                )
                idle_since = time.monotonic()
        finally:
            await consumer.stop()

    async def _publish(self, outbox: Outbox) -> None:
        update = self.resources()
        await outbox.send(self.settings.topic("resources"), update, key=update.resources_id)

    async def _one(self, message: Any, outbox: Outbox, idle_s: float) -> None:
        from agl_stream.training.data import batch_to_dataproto

        try:
            batch = self.codec.decode(message.value or b"", TripletBatch)
        except CodecError as error:
            await outbox.reject([Rejected.of(message, error)])
            self.stats.skipped += 1
            return
        if batch.batch_id in self.progress.trained:
            return  # a batch re-sent by the batcher after a lost acknowledgement
        try:
            newest = batch.max_policy_version
            if newest is not None and newest > self.progress.policy_version:
                raise FutureVersionError(
                    f"batch {batch.batch_id} holds policy version {newest}, but the trainer is at "
                    f"{self.progress.policy_version}: it was not produced by this trainer's policy"
                )
            data = batch_to_dataproto(
                batch,
                pad_token_id=self.backend.tokenizer.pad_token_id,
                vocab_size=self.backend.model.config.vocab_size,
                max_prompt_length=self.options.max_prompt_length,
                max_response_length=self.options.max_response_length,
            )
        except ValueError as error:
            await outbox.reject([Rejected.of(message, error)])
            self.progress.skipped.append(batch.batch_id)
            self.stats.skipped += 1
            log.warning("batch rejected", batch=batch.batch_id, reason=str(error))
            return
        started = time.monotonic()
        metrics = await asyncio.to_thread(self.backend.step, data)
        if metrics.get("updates", 1) > 0:
            await asyncio.to_thread(self._save_after, batch.batch_id)
        else:  # nothing to learn from (all rows masked): same weights, same version
            self.progress.trained.append(batch.batch_id)
        seconds = time.monotonic() - started
        agl_metrics.TRAINER_STEP_SECONDS.labels(agl_metrics.role()).observe(seconds)
        self.stats.busy_s += seconds
        self.stats.trained += 1
        self.stats.tokens += int(metrics.get("tokens", 0))
        staleness = None
        if batch.min_policy_version is not None:
            staleness = float(self.progress.policy_version - 1 - batch.min_policy_version)
            self.stats.staleness.append(staleness)
        await self._publish(outbox)
        # Before progress.json records the batch: a crash in between trains it again and sends
        # its step again under the same batch_id, which the trainer_steps table keeps once.
        step = TrainerStep(
            batch_id=batch.batch_id,
            model=self.options.model_name,
            policy_version=self.progress.policy_version,
            step_time=time.time(),
            step_seconds=seconds,
            idle_seconds=idle_s,
            tokens=int(metrics.get("tokens", 0)),
            samples=len(data),
            min_policy_version=batch.min_policy_version,
            staleness=staleness,
            metrics={k: float(v) for k, v in metrics.items()},
        )
        await outbox.send(self.settings.topic("trainer-metrics"), step, key=batch.batch_id)
        totals = self._write_metrics(metrics)
        if self.tracking is not None:
            from agl_stream.training.tracking import step_scalars

            self.tracking.log(step_scalars(step, totals), step=step.policy_version)
        log.info(
            "trained",
            batch=batch.batch_id,
            version=self.progress.policy_version,
            reward=round(metrics.get("reward_mean", float("nan")), 4),
            loss=round(metrics.get("loss", float("nan")), 4),
            seconds=round(time.monotonic() - started, 2),
        )

    def _write_metrics(self, last_step: dict[str, float]) -> dict[str, float]:
        """``metrics.json`` beside the checkpoints: how busy the trainer is and how stale its data.
        Returns its running totals (what tracking records under ``trainer/``)."""
        stats = self.stats
        busy = stats.busy_s / max(stats.busy_s + stats.idle_s, 1e-9)
        staleness = stats.staleness
        totals: dict[str, float] = {
            "trained_batches": stats.trained,
            "skipped_batches": stats.skipped,
            "tokens": stats.tokens,
            "busy_fraction": busy,
            "idle_fraction": 1.0 - busy,
            "tokens_per_busy_s": stats.tokens / max(stats.busy_s, 1e-9),
            "staleness_mean": sum(staleness) / len(staleness) if staleness else 0.0,
            "staleness_max": max(staleness) if staleness else 0.0,
        }
        body = {"policy_version": self.progress.policy_version, **totals, "last_step": last_step}
        tmp = self.root / ".metrics.json.tmp"
        tmp.write_text(json.dumps(body, indent=1))
        os.replace(tmp, self.root / "metrics.json")
        return totals

    def _save_after(self, batch_id: str) -> None:
        # The checkpoint directory is complete before progress.json names it: a crash in
        # between leaves an unnamed directory, and the batch is trained again on restart.
        name = f"v{self.backend.policy_version}"
        self.backend.save(self.root / name)
        self.progress.checkpoint = name
        self.progress.policy_version = self.backend.policy_version
        self.progress.trained.append(batch_id)


def _distributed(options: TrainerOptions) -> bool:
    return options.backend == "verl" and int(os.environ.get("WORLD_SIZE", "1")) > 1


def _shared_with_ranks(options: TrainerOptions, checkpoint: str | None) -> str | None:
    if not _distributed(options):
        return checkpoint
    from agl_stream.training.verl_backend import broadcast_object

    shared: str | None = broadcast_object(checkpoint)
    return shared


def follower_main(options: TrainerOptions) -> None:
    """A rank other than 0 of a verl trainer under torchrun: no Kafka, it repeats rank 0's steps."""
    from agl_stream.training import open_backend

    checkpoint = _shared_with_ranks(options, None)
    if checkpoint is not None:
        backend = open_backend("verl", options.checkpoints / checkpoint)
    else:
        backend = open_backend("verl", options.initial_model, **options.backend_options())
    backend.follow()  # type: ignore[attr-defined]


def main(settings: Settings, options: TrainerOptions) -> None:
    if _distributed(options):
        from agl_stream.training.verl_backend import init_distributed

        rank, _ = init_distributed()
        if rank != 0:
            follower_main(options)
            return

    stats = run_until_stopped(PolicyTrainer(settings, options).run)
    busy = stats.busy_s / max(stats.busy_s + stats.idle_s, 1e-9)
    print(
        f"trainer: trained {stats.trained} batches ({stats.tokens} tokens), skipped {stats.skipped}, busy {busy:.0%}",
        flush=True,
    )
