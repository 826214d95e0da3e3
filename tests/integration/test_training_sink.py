"""Triplets and training batches in ClickHouse: the row transforms, and the sinks on the real broker."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from agl_stream.config import Settings
from agl_stream.domain.batching import Batcher, BatchPolicy
from agl_stream.kafka import admin
from agl_stream.kafka.io import Fetched, Outbox, make_producer
from agl_stream.kafka.offsets import end_offsets
from agl_stream.models import AglModel, TrainerStep, Triplet, TripletBatch, TripletRecord
from agl_stream.wire.codec import HEADER_SIZE, Codec
from consumers.clickhouse_sink import SinkGroup, TableSink
from consumers.sink_specs import TRAINER_STEPS, TRIPLET_BATCHES, TRIPLETS
from tests.integration.helpers import clickhouse

pytestmark = pytest.mark.integration


def record(i: int, group: str, *, reward: float | None, triplets: int = 2) -> TripletRecord:
    return TripletRecord(
        rollout_id=f"ro-{i:012x}",
        attempt_id=f"at-{i:08x}",
        group_id=group,
        resources_id="rs-000000000001",
        policy_version=3,
        triplets=[
            Triplet(
                prompt_token_ids=[10 + k, 11, 12],
                response_token_ids=[20 + k, 2**40],
                response_logprobs=[-0.5, -0.25] if k == 0 else None,
                reward=0.5 if k == 0 else None,
                metadata={"response_id": f"r{k}"},
                response_extra={"finish_reason": "stop"},
            )
            for k in range(triplets)
        ],
        final_reward=reward,
        finish_time=1_700_000_000.0 + i,
    )


def _fetched(items: Sequence[AglModel], partition: int = 2) -> list[Fetched[memoryview]]:
    codec = Codec.default()
    out = []
    for offset, item in enumerate(items):
        raw = codec.encode(item)
        out.append(Fetched("t", partition, offset, b"k", memoryview(raw)[HEADER_SIZE:], raw, 0))
    return out


async def _run_until(sinks: SinkGroup, event: asyncio.Event, *, timeout: float) -> None:
    """Run the sinks until ``event`` is set (failing after ``timeout``), then stop them."""
    task = asyncio.create_task(sinks.run())
    try:
        await asyncio.wait_for(event.wait(), timeout=timeout)
    finally:
        sinks.stop()
        await asyncio.wait_for(task, timeout=60)


def _rows(ch: Any, sql: str) -> list[dict[str, Any]]:
    result = ch.query(sql)
    return [dict(zip(result.column_names, row, strict=True)) for row in result.result_rows]


def test_triplet_records_and_batches_become_rows_and_copies_collapse(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    records = [record(0, "g-a", reward=1.0), record(1, "g-a", reward=0.0), record(2, "g-b", reward=None, triplets=0)]
    batcher = Batcher(BatchPolicy(max_rollouts=3, max_staleness=0), partition=2)
    [batch] = [b for offset, r in enumerate(records) for b in batcher.add(r, offset + 7, 5.0)]
    unrewarded = TripletBatch(batch_id="tb-none", records=[records[2]], created_time=6.0)
    with clickhouse(settings) as ch:
        triplets, batches = TableSink(settings, ch, TRIPLETS), TableSink(settings, ch, TRIPLET_BATCHES)
        triplets.prepare_tables()
        batches.prepare_tables()
        for _ in range(2):  # a replay (or a batch the batcher sent twice) inserts again
            triplets._insert(_fetched(records), {})
            batches._insert(_fetched([batch, unrewarded]), {})
        rows = _rows(ch, "SELECT * FROM agl.triplets FINAL ORDER BY rollout_id, triplet_index")
        attempts = _rows(ch, "SELECT * FROM agl.triplet_records FINAL ORDER BY rollout_id")
        [row, empty] = _rows(ch, "SELECT * FROM agl.batches FINAL ORDER BY created_time")

    assert [(r["rollout_id"], r["triplet_index"]) for r in rows] == [
        ("ro-000000000000", 0),
        ("ro-000000000000", 1),
        ("ro-000000000001", 0),
        ("ro-000000000001", 1),
    ]
    first = rows[0]
    assert (first["prompt_token_ids"], first["response_token_ids"]) == ([10, 11, 12], [20, 2**40])
    assert (first["prompt_tokens"], first["response_tokens"]) == (3, 2)
    assert (first["response_logprobs"], rows[1]["response_logprobs"]) == ([-0.5, -0.25], [])
    assert (first["reward"], rows[1]["reward"], first["final_reward"]) == (0.5, None, 1.0)
    assert first["metadata"] == '{"response_id":"r0"}' and first["prompt_extra"] is None
    assert (first["group_id"], first["resources_id"], first["policy_version"]) == ("g-a", "rs-000000000001", 3)
    assert (first["kafka_partition"], first["kafka_offset"]) == (2, 0)

    assert [(a["rollout_id"], a["n_triplets"], a["prompt_tokens"], a["response_tokens"]) for a in attempts] == [
        ("ro-000000000000", 2, 6, 4),
        ("ro-000000000001", 2, 6, 4),
        ("ro-000000000002", 0, 0, 0),  # no triplets: no triplets rows, but the attempt is here
    ]
    assert [a["final_reward"] for a in attempts] == [1.0, 0.0, None]

    assert row["batch_id"] == batch.batch_id and row["sequence"] == 1 and row["source_partition"] == 2
    assert (row["n_records"], row["n_triplets"], row["n_tokens"]) == (3, 4, 20)
    assert row["group_ids"] == ["g-a", "g-b"] and row["mean_final_reward"] == 0.5
    assert row["rollout_ids"] == [r.rollout_id for r in records]
    assert row["attempt_ids"] == [r.attempt_id for r in records]
    assert (row["input_offsets"], row["input_position"]) == ([7, 8, 9], 10)
    assert (row["min_policy_version"], row["max_policy_version"], row["newest_policy_version"]) == (3, 3, 3)
    assert (row["group_size"], row["incomplete_groups"], row["dropped_offsets"]) == (None, 0, [])
    assert row["created_time"] == datetime.fromtimestamp(5.0, timezone.utc).replace(tzinfo=None)  # DateTime64, UTC
    assert (row["kafka_partition"], row["kafka_offset"]) == (2, 0)
    assert empty["batch_id"] == "tb-none" and empty["mean_final_reward"] is None


def test_the_rollouts_mode_reaches_the_rows_and_refused_val_records_are_counted(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    records = [
        record(0, "g-a", reward=1.0).model_copy(update={"mode": "train"}),
        record(1, "g-v", reward=0.25).model_copy(update={"mode": "val"}),
        record(2, "g-a", reward=0.0),  # written before records carried a mode
    ]
    batcher = Batcher(BatchPolicy(max_rollouts=2), partition=2)
    [batch] = [b for offset, r in enumerate(records) for b in batcher.add(r, offset, 5.0)]
    with clickhouse(settings) as ch:
        triplets, batches = TableSink(settings, ch, TRIPLETS), TableSink(settings, ch, TRIPLET_BATCHES)
        triplets.prepare_tables()
        batches.prepare_tables()
        triplets._insert(_fetched(records), {})
        batches._insert(_fetched([batch]), {})
        modes = ch.query("SELECT rollout_id, mode FROM agl.triplet_records FINAL ORDER BY rollout_id").result_rows
        triplet_modes = ch.query("SELECT DISTINCT rollout_id, mode FROM agl.triplets FINAL ORDER BY 1").result_rows
        [row] = _rows(ch, "SELECT * FROM agl.batches FINAL")
        view = ch.query(
            "SELECT mode, policy_version, attempts, mean_reward FROM agl.reward_by_mode_and_version ORDER BY mode"
        ).result_rows
    expected = [("ro-000000000000", "train"), ("ro-000000000001", "val"), ("ro-000000000002", None)]
    assert [tuple(m) for m in modes] == [tuple(m) for m in triplet_modes] == expected
    assert row["rollout_ids"] == ["ro-000000000000", "ro-000000000002"]
    assert (row["dropped_eval"], row["dropped_offsets"]) == (1, [1])
    assert [tuple(v) for v in view] == [("train", 3, 1, 1.0), ("val", 3, 1, 0.25), (None, 3, 1, 0.0)]


def test_a_merged_samples_mask_calls_and_versions_and_a_batchs_staleness_reach_the_rows(tmp_path: Path) -> None:
    """A trajectory sample keeps its response mask, its calls, their spans and serving versions
    (migration 009); a transition sample written before those fields reads the defaults; the
    batch keeps its staleness histogram."""
    settings = Settings(data_dir=tmp_path)
    merged = Triplet(
        prompt_token_ids=[1, 2],
        response_token_ids=[3, 4, 5, 6, 7],
        response_mask=[1, 1, 0, 0, 1],  # two generated tokens, the tool result, one more generated
        span_ids=["sp-a", "sp-b"],
        calls=2,
        policy_versions=[4, None],  # the second call's server named no version
    )
    fresh = TripletRecord(
        rollout_id="ro-000000000010",
        attempt_id="at-00000010",
        group_id="g-a",
        policy_version=4,
        triplets=[merged],
        final_reward=1.0,
        finish_time=1.0,
    )
    old = record(11, "g-a", reward=0.0, triplets=1)  # no mask, spans or versions: as before the fields
    old = old.model_copy(update={"policy_version": 2})
    batcher = Batcher(BatchPolicy(max_rollouts=2, max_staleness=4), partition=0)
    [batch] = [b for offset, r in enumerate([fresh, old]) for b in batcher.add(r, offset, 5.0)]
    with clickhouse(settings) as ch:
        triplets, batches = TableSink(settings, ch, TRIPLETS), TableSink(settings, ch, TRIPLET_BATCHES)
        triplets.prepare_tables()
        batches.prepare_tables()
        triplets._insert(_fetched([fresh, old]), {})
        batches._insert(_fetched([batch]), {})
        rows = _rows(
            ch,
            "SELECT rollout_id, response_mask, calls, span_ids, policy_versions FROM agl.triplets FINAL "
            "ORDER BY rollout_id",
        )
        [row] = _rows(ch, "SELECT staleness_counts, kept_stale FROM agl.batches FINAL")
    assert [tuple(r.values()) for r in rows] == [
        ("ro-00000000000b", [], 1, [], []),
        ("ro-000000000010", [1, 1, 0, 0, 1], 2, ["sp-a", "sp-b"], [4, None]),
    ]
    assert batch.staleness_counts == [1, 0, 1]  # newest version 4: one record at 4, one 2 behind
    assert (row["staleness_counts"], row["kept_stale"]) == ([1, 0, 1], 1)


async def test_the_sinks_materialize_triplets_and_batches_from_the_topics(settings: Settings) -> None:
    await admin.apply(settings)
    records = [record(i, f"g-{i % 3}", reward=float(i)) for i in range(12)]
    batch = TripletBatch(
        batch_id="tb-x", records=records[:4], created_time=1.0, n_tokens=80, sequence=1, source_partition=0
    )
    producer = make_producer(settings)
    await producer.start()
    try:
        typed = Outbox(settings, producer, "test")
        await typed.send_many(settings.topic("triplets"), [(r.group_id, r) for r in records])
        # The same batch twice, as after a lost acknowledgement: one row.
        await typed.send_many(settings.topic("triplet-batches"), [(batch.batch_id, batch), (batch.batch_id, batch)])
    finally:
        await producer.stop()
    targets: dict[str, dict[int, int]] = {}
    for spec in (TRIPLETS, TRIPLET_BATCHES):
        topic = settings.topic(spec.topic)
        targets[topic] = {tp.partition: offset for tp, offset in (await end_offsets(settings, topic)).items()}
    applied: dict[str, dict[int, int]] = {topic: {} for topic in targets}
    done = asyncio.Event()

    def on_applied(topic: str, offsets: Mapping[int, int]) -> None:
        applied[topic].update(offsets)
        if all(applied[t].get(p, 0) >= o for t, ends in targets.items() for p, o in ends.items()):
            done.set()

    await _run_until(SinkGroup(settings, (TRIPLETS, TRIPLET_BATCHES), on_applied=on_applied), done, timeout=120)

    with clickhouse(settings) as ch:
        db = settings.clickhouse_database
        counts = ch.query(
            f"SELECT (SELECT count() FROM {db}.triplets FINAL), (SELECT count() FROM {db}.triplet_records FINAL), "
            f"(SELECT count() FROM {db}.batches FINAL)"
        ).result_rows
        [row] = _rows(ch, f"SELECT * FROM {db}.batches FINAL")
    assert counts == [(24, 12, 1)]
    assert row["batch_id"] == "tb-x" and row["n_records"] == 4 and row["mean_final_reward"] == 1.5


async def test_a_lingering_batch_is_flushed_as_soon_as_a_reader_waits_for_its_topic(settings: Settings) -> None:
    await admin.apply(settings)
    topic = settings.topic(TRIPLETS.topic)
    producer = make_producer(settings)
    await producer.start()
    try:
        sent = await Outbox(settings, producer, "test").send_many(
            topic, [(r.group_id, r) for r in [record(1, "g", reward=1.0)]]
        )
    finally:
        await producer.stop()
    [written] = sent
    applied = asyncio.Event()
    asked: list[str] = []

    def wanted(name: str) -> bool:
        asked.append(name)
        return True  # a reader waits (the gateway's AppliedOffsets.wanted)

    def on_applied(name: str, offsets: Mapping[int, int]) -> None:
        if name == topic and offsets.get(written.partition, 0) > written.offset:
            applied.set()

    # Without a reader the batch would linger ten minutes after its first record.
    sinks = SinkGroup(
        settings, (TRIPLETS,), on_applied=on_applied, wanted=wanted, options={TRIPLETS.name: {"flush_ms": 600_000}}
    )
    await _run_until(sinks, applied, timeout=60)
    assert topic in asked


def test_trainer_steps_become_rows_and_a_step_sent_again_is_one_row(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)

    def step(batch: str, version: int, loss: float) -> TrainerStep:
        return TrainerStep(
            batch_id=batch,
            model="agl-tiny",
            policy_version=version,
            step_time=1_700_000_000.0 + version,
            step_seconds=0.5,
            idle_seconds=0.25,
            tokens=120,
            samples=8,
            min_policy_version=version - 2,
            staleness=1.0,
            metrics={"loss": loss, "reward_mean": 0.5},
        )

    # tb-1 trained, the trainer killed before recording it, tb-1 trained again: the later row wins.
    steps = [step("tb-1", 1, 0.9), step("tb-1", 1, 0.8), step("tb-2", 2, 0.7)]
    with clickhouse(settings) as ch:
        sink = TableSink(settings, ch, TRAINER_STEPS)
        sink.prepare_tables()
        sink._insert(_fetched(steps), {})
        rows = _rows(ch, "SELECT * FROM agl.trainer_steps FINAL ORDER BY batch_id")
    assert [(r["batch_id"], r["policy_version"], r["metrics"]["loss"]) for r in rows] == [
        ("tb-1", 1, 0.8),
        ("tb-2", 2, 0.7),
    ]
    first = rows[0]
    assert (first["tokens"], first["samples"], first["min_policy_version"], first["staleness"]) == (120, 8, -1, 1.0)
    assert (first["step_seconds"], first["idle_seconds"], first["model"]) == (0.5, 0.25, "agl-tiny")


def test_a_batch_keeps_its_samples_span_ids_and_the_lineage_query_finds_them_by_trained_version(
    tmp_path: Path,
) -> None:
    """batch_samples: one row per sample in batch order, with the spans it was built from (a
    record written before Triplet.span_ids gives its metadata's span id); copies collapse; the
    cookbook's lineage query (the version page's) answers from these rows and trainer_steps."""
    from consumers import dashboard_sql as dsql

    settings = Settings(data_dir=tmp_path)

    def lineage_record(i: int, spans: list[list[str]]) -> TripletRecord:
        return TripletRecord(
            rollout_id=f"ro-{i:012x}",
            attempt_id=f"at-{i:08x}",
            group_id="g-a",
            policy_version=i,
            triplets=[
                Triplet(prompt_token_ids=[1, 2], response_token_ids=[3] * (k + 1), span_ids=ids, calls=len(ids))
                for k, ids in enumerate(spans)
            ],
            final_reward=float(i),
            finish_time=1_700_000_000.0 + i,
        )

    merged = lineage_record(0, [["sp-a", "sp-b", "sp-c"], ["sp-d"]])  # a trajectory of 3 calls, then one call
    older = TripletRecord.model_validate(
        {**record(1, "g-a", reward=0.5, triplets=1).model_dump(), "rollout_id": "ro-old", "policy_version": 1}
    )
    older.triplets[0].metadata["span_id"] = "sp-old"  # no span_ids: as records written before the field
    batch = TripletBatch(batch_id="tb-lineage", records=[merged, older], created_time=5.0)
    other = TripletBatch(batch_id="tb-other", records=[lineage_record(2, [["sp-z"]])], created_time=6.0)
    step = TrainerStep(
        batch_id="tb-lineage",
        model="agl-tiny",
        policy_version=4,
        step_time=7.0,
        step_seconds=1.0,
        idle_seconds=0.0,
        tokens=10,
        samples=3,
    )
    with clickhouse(settings) as ch:
        batches, steps = TableSink(settings, ch, TRIPLET_BATCHES), TableSink(settings, ch, TRAINER_STEPS)
        batches.prepare_tables()
        steps.prepare_tables()
        for _ in range(2):  # the batcher sent it twice, or the sink read the topic again
            batches._insert(_fetched([batch, other]), {})
        steps._insert(_fetched([step, step.model_copy(update={"batch_id": "tb-other", "policy_version": 5})]), {})
        samples = _rows(ch, "SELECT * FROM agl.batch_samples FINAL WHERE batch_id = 'tb-lineage' ORDER BY sample_index")
        lineage = _rows(ch, dsql.trained_by_version("agl").replace("{version:Int64}", "4"))
        none = _rows(ch, dsql.trained_by_version("agl").replace("{version:Int64}", "3"))
        page = {}  # the version page's statements, with the version bound as the gateway binds it
        for name, query in dsql.version_lineage("agl", 4).items():
            result = ch.query(query.sql, parameters=query.parameters)
            page[name] = [dict(zip(result.column_names, row, strict=True)) for row in result.result_rows]

    assert [(s["sample_index"], s["rollout_id"], s["triplet_index"], s["span_ids"], s["calls"]) for s in samples] == [
        (0, "ro-000000000000", 0, ["sp-a", "sp-b", "sp-c"], 3),
        (1, "ro-000000000000", 1, ["sp-d"], 1),
        (2, "ro-old", 0, ["sp-old"], 1),
    ]
    assert [(s["policy_version"], s["response_tokens"], s["final_reward"]) for s in samples] == [
        (0, 1, 0.0),
        (0, 2, 0.0),
        (1, 2, 0.5),
    ]
    assert [(r["sample_index"], r["call_index"], r["span_id"], r["trace_id"]) for r in lineage] == [
        (0, 1, "sp-a", ""),  # no spans in otel_traces here: no trace id
        (0, 2, "sp-b", ""),
        (0, 3, "sp-c", ""),
        (1, 1, "sp-d", ""),
        (2, 1, "sp-old", ""),
    ]
    assert {r["batch_id"] for r in lineage} == {"tb-lineage"} and none == []
    assert [s["batch_id"] for s in page["steps"]] == [b["batch_id"] for b in page["batches"]] == ["tb-lineage"]
    assert [(a["rollout_id"], a["samples"], a["spans"], a["served_version"]) for a in page["attempts"]] == [
        ("ro-000000000000", 2, 4, 0),
        ("ro-old", 1, 1, 1),
    ]
    assert page["lineage"] == lineage
