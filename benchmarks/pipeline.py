"""Throughput of the span path on this machine, side by side.

Stages (each on fresh topics of a broker started for the run, or AGL_KAFKA_BOOTSTRAP):
1. raw:        aiokafka produce of pre-built span-sized byte strings, then consume (no decoding);
2. codec:      encode each span dict on produce, decode each record on consume;
3. codec_sink: encode on produce, then the ClickHouse sink (header check, Avro container,
               INSERT into the embedded ClickHouse, commit).

Each stage reports produce/s and consume/s measured one after the other (consume timed from the
first record received, so the consumer-group join is not counted), and `pipelined/s`: the
producer in its own process running at the same time as the consumer (two cores, two
processes), N / (first send -> last record consumed). That last figure is the end-to-end
throughput of a live pipeline. Every rate is in spans per second.

`--spans-per-record K` writes agl.SpanBatch records of K spans of one attempt (as a writer
flushing K spans per attempt does; 1: one agl.Span per record, the old form), for every stage:
raw sends pre-built records of that shape. `--without-span-json` runs the sink with SpanJson
left empty (the view computes '' instead), to measure what the column costs; the sink stage
also reports otel_traces' column sizes.

Run: `make bench` (or `python benchmarks/pipeline.py --spans 100000`). Results are also
written as JSON to benchmarks/results/pipeline.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from _measure import SHORT_LIVED_JIT  # type: ignore[import-not-found]  # noqa: F401  (C1 brokers)

from agl_stream.clickhouse import avro_ingest
from agl_stream.clickhouse.client import get_client
from agl_stream.config import Settings
from agl_stream.kafka import admin, broker
from agl_stream.kafka.io import make_consumer, make_producer
from agl_stream.local.processes import role_environment
from agl_stream.ports import free_ports
from agl_stream.wire.codec import Codec
from agl_stream.wire.span_records import SPAN, span_dict_records, span_dicts_of
from consumers.clickhouse_sink import TableSink
from consumers.sink_specs import SPANS
from producers.synthetic_spans import synthetic_span

STAGES = ("raw", "codec", "codec_sink")
ROLLOUTS = 1000


def _spans(count: int, text_bytes: int, start: int = 0) -> list[dict[str, Any]]:
    return [synthetic_span(i, rollouts=ROLLOUTS, text_bytes=text_bytes) for i in range(start, start + count)]


def _encoded(codec: Codec, spans: list[dict[str, Any]], per_record: int) -> list[tuple[bytes, bytes]]:
    """The records for ``spans``: one agl.Span each, or the next ``per_record`` spans of every
    rollout in one agl.SpanBatch (what a writer flushing per attempt sends)."""
    if per_record == 1:
        return [(s["rollout_id"].encode(), codec.encode_dict(SPAN, s)) for s in spans]
    step = per_record * ROLLOUTS
    return [
        (key.encode(), value)
        for start in range(0, len(spans), step)
        for key, value in span_dict_records(spans[start : start + step], codec)
    ]


def record_count(count: int, per_record: int) -> int:
    """How many records :func:`_encoded` makes of ``count`` consecutive spans (no byte split)."""
    if per_record == 1:
        return count
    step = per_record * ROLLOUTS
    return sum(min(step, count - start, ROLLOUTS) for start in range(0, count, step))


async def produce(
    settings: Settings, stage: str, count: int, text_bytes: int, per_record: int, start: int = 0
) -> tuple[float, float]:
    """Produce the stage's messages; returns wall-clock times of the first send and the last ack."""
    codec = Codec.default()
    spans = _spans(count, text_bytes, start)
    prebuilt = _encoded(codec, spans, per_record) if stage == "raw" else None
    topic = settings.topic("spans")
    producer = make_producer(settings)
    await producer.start()
    try:
        started = time.time()
        if prebuilt is not None:
            futures = [await producer.send(topic, value, key=key) for key, value in prebuilt]
        elif per_record == 1:
            futures = [
                await producer.send(topic, codec.encode_dict(SPAN, s), key=s["rollout_id"].encode()) for s in spans
            ]
        else:  # encoded as they are sent, a flush at a time
            step = per_record * ROLLOUTS
            futures = [
                await producer.send(topic, value, key=key)
                for chunk in range(0, len(spans), step)
                for key, value in _encoded(codec, spans[chunk : chunk + step], per_record)
            ]
        for future in futures:
            await future
        return started, time.time()
    finally:
        await producer.stop()


async def consume(settings: Settings, stage: str, count: int, per_record: int, span_json: bool) -> tuple[float, float]:
    """Consume the records of `count` spans; returns wall-clock times of the first and the last record."""
    records = record_count(count, per_record)
    if stage == "codec_sink":
        return await _sink(settings, count, records, span_json)
    codec = Codec.default() if stage == "codec" else None
    consumer = make_consumer(settings, settings.topic("spans"), group_id=f"bench-{uuid.uuid4().hex[:8]}")
    await consumer.start()
    seen, spans, first = 0, 0, None
    try:
        while seen < records:
            batch = await consumer.getmany(timeout_ms=1000, max_records=10_000)
            for messages in batch.values():
                if first is None and messages:
                    first = time.time()
                if codec is not None:
                    for message in messages:
                        spans += len(span_dicts_of(codec, message.value))
                seen += len(messages)
        if codec is not None and spans != count:
            raise RuntimeError(f"decoded {spans} spans, expected {count}")
        return first or time.time(), time.time()
    finally:
        await consumer.stop()


def without_span_json(client: Any, database: str) -> None:
    """Recreate the spans ingest view with SpanJson left empty: the view without its cost."""
    fingerprint = Codec.default().contract.schema(SPANS.record).fingerprint_hex
    view = f"{avro_ingest.ingest_table(database, SPANS.ingest, fingerprint)}_mv_otel_traces"
    database_name, view_name = view.split(".", 1)
    query = "SELECT create_table_query FROM system.tables WHERE database = {d:String} AND name = {n:String}"
    [(create,)] = client.query(query, parameters={"d": database_name, "n": view_name}).result_rows
    stripped, found = re.subn(r"concat\(\s*'\{\"rollout_id\":.*?\) AS SpanJson", "'' AS SpanJson", create, flags=re.S)
    if found == 0 and "'' AS SpanJson" in create:
        return  # done already
    if found != 1:
        raise RuntimeError("could not find the SpanJson expression in the ingest view")
    client.command(f"DROP VIEW {view}")
    client.command(stripped)


def _table_sizes(client: Any, database: str) -> dict[str, int]:
    """otel_traces on disk once merged into one part (per column where the part is wide)."""
    client.command(f"OPTIMIZE TABLE {database}.otel_traces FINAL")
    [(on_disk, compressed, uncompressed)] = client.query(
        "SELECT sum(bytes_on_disk), sum(data_compressed_bytes), sum(data_uncompressed_bytes) FROM system.parts "
        f"WHERE database = '{database}' AND table = 'otel_traces' AND active"
    ).result_rows
    [(span_json,)] = client.query(
        "SELECT data_compressed_bytes FROM system.columns "
        f"WHERE database = '{database}' AND table = 'otel_traces' AND name = 'SpanJson'"
    ).result_rows
    return {
        "bytes_on_disk": int(on_disk),
        "compressed_bytes": int(compressed),
        "uncompressed_bytes": int(uncompressed),
        "span_json_compressed_bytes": int(span_json),  # 0 when the part is compact (small tables)
    }


SIZES: dict[str, Any] = {}


async def _sink(settings: Settings, count: int, records: int, span_json: bool) -> tuple[float, float]:
    client = get_client(settings)
    sink = TableSink(settings, client, batch_size=20_000, flush_ms=100)
    await asyncio.to_thread(sink.prepare_tables)
    if not span_json:
        without_span_json(client, settings.clickhouse_database)
    task = asyncio.create_task(sink.run())
    while sink.stats.records < records:
        if task.done():
            task.result()
        await asyncio.sleep(0.005)  # polling the sink's counter; the timing comes from its stats
    last = time.time()
    first = last - (time.monotonic() - (sink.stats.first_record_at or time.monotonic()))
    sink.stop()
    await task
    rows = int(str(client.command(f"SELECT count() FROM {settings.clickhouse_database}.otel_traces")))
    SIZES.update(_table_sizes(client, settings.clickhouse_database))
    client.close()
    if rows != count:
        raise RuntimeError(f"the sink wrote {rows} rows, expected {count}")
    return first, last


async def stage_sequential(
    settings: Settings, stage: str, count: int, text_bytes: int, per_record: int, span_json: bool
) -> dict[str, float]:
    await admin.apply(settings)
    produce_started, produce_done = await produce(settings, stage, count, text_bytes, per_record)
    first, last = await consume(settings, stage, count, per_record, span_json)
    return {"produce_per_s": count / (produce_done - produce_started), "consume_per_s": count / (last - first)}


async def stage_pipelined(
    settings: Settings, stage: str, count: int, text_bytes: int, producers: int, per_record: int, span_json: bool
) -> float:
    """Producer processes and the consumer at the same time; N / (first send -> last record)."""
    await admin.apply(settings)
    if stage == "codec_sink":
        # Open the engine and create tables first: part of starting a sink, not of its throughput.
        client = get_client(settings)
        TableSink(settings, client).prepare_tables()
        if not span_json:
            without_span_json(client, settings.clickhouse_database)
        client.close()
    env = role_environment(settings)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])  # noqa: ASYNC240 - once per stage
    share = count // producers
    if per_record > 1:  # whole flushes per producer, so the records are what record_count says
        share -= share % (per_record * ROLLOUTS)
    # Started before the consumer so they all run at once; Popen returns immediately.
    processes = [
        subprocess.Popen(  # noqa: ASYNC220
            [
                sys.executable,
                __file__,
                "--produce-only",
                stage,
                "--text-bytes",
                str(text_bytes),
                "--spans",
                str(share if i < producers - 1 else count - share * i),
                "--start",
                str(share * i),
                "--spans-per-record",
                str(per_record),
            ],
            env=env,
            stdout=subprocess.PIPE,
        )
        for i in range(producers)
    ]
    try:
        _, last = await consume(settings, stage, count, per_record, span_json)
    finally:
        outputs = [p.communicate(timeout=120)[0] for p in processes]
    started = min(json.loads(out.decode().strip().splitlines()[-1])["started"] for out in outputs)
    return count / (last - started)


async def run(
    base: Settings,
    count: int,
    text_bytes: int,
    producers: int,
    per_record: int,
    span_json: bool,
    stages: tuple[str, ...] = STAGES,
) -> dict[str, Any]:
    codec = Codec.default()
    sample = [codec.encode_dict(SPAN, s) for s in _spans(min(count, 1000), text_bytes)]
    results: dict[str, Any] = {
        "spans": count,
        "mean_span_bytes": round(sum(map(len, sample)) / len(sample)),
        "spans_per_record": per_record,
        "records": record_count(count, per_record),
        "span_json": span_json,
    }
    for stage in stages:
        fresh = {"topic_prefix": f"bench{uuid.uuid4().hex[:6]}", "data_dir": base.data_dir / uuid.uuid4().hex[:6]}
        results[stage] = await stage_sequential(
            base.model_copy(update=fresh), stage, count, text_bytes, per_record, span_json
        )
        fresh = {"topic_prefix": f"bench{uuid.uuid4().hex[:6]}", "data_dir": base.data_dir / uuid.uuid4().hex[:6]}
        results[stage]["pipelined_per_s"] = await stage_pipelined(
            base.model_copy(update=fresh), stage, count, text_bytes, producers, per_record, span_json
        )
    results["otel_traces"] = dict(SIZES)
    if "raw" in stages and "codec_sink" in stages:
        results["codec_sink_vs_raw_pipelined"] = (
            results["codec_sink"]["pipelined_per_s"] / results["raw"]["pipelined_per_s"]
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spans", type=int, default=100_000)
    parser.add_argument("--text-bytes", type=int, default=1200, help="prompt text per span (sets the span size)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/pipeline.json"))
    parser.add_argument("--producers", type=int, default=1, help="producer processes in the pipelined runs")
    parser.add_argument("--spans-per-record", type=int, default=1, help="spans of one attempt per record (1: agl.Span)")
    parser.add_argument("--without-span-json", action="store_true", help="the sink leaves SpanJson empty")
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES), help="stages to run")
    parser.add_argument("--produce-only", choices=STAGES, help=argparse.SUPPRESS)  # a pipelined producer
    parser.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.produce_only:
        started, done = asyncio.run(
            produce(Settings(), args.produce_only, args.spans, args.text_bytes, args.spans_per_record, args.start)
        )
        print(json.dumps({"started": started, "done": done}))
        return
    with tempfile.TemporaryDirectory(prefix="agl-bench-") as tmp:
        base = Settings(data_dir=Path(tmp), log_level="WARNING")
        started = False
        if base.uses_local_broker:
            port, controller_port = free_ports(2)
            base = base.model_copy(update={"kafka_port": port, "kafka_controller_port": controller_port})
            broker.start(base)
            started = True
            base = base.model_copy(update={"kafka_bootstrap": base.bootstrap_servers})
        try:
            span_json, stages = not args.without_span_json, tuple(s for s in STAGES if s in args.stages)
            results = asyncio.run(
                run(base, args.spans, args.text_bytes, args.producers, args.spans_per_record, span_json, stages)
            )
        finally:
            if started:
                broker.stop(base.model_copy(update={"kafka_bootstrap": None}))
    results["producers"] = args.producers
    print(
        f"\n{args.spans:,} spans of {results['mean_span_bytes']} bytes (mean) in {results['records']:,} records "
        f"({args.spans_per_record} per record{'' if not args.without_span_json else ', no SpanJson'}), spans per second"
    )
    print(f"(pipelined: {args.producers} producer process(es) and the consumer running at once)")
    print(f"{'stage':<12}{'produce':>12}{'consume':>12}{'pipelined':>12}")
    for stage in stages:
        r = results[stage]
        print(f"{stage:<12}{r['produce_per_s']:>12,.0f}{r['consume_per_s']:>12,.0f}{r['pipelined_per_s']:>12,.0f}")
    if "codec_sink_vs_raw_pipelined" in results:
        print(f"codec + sink end to end = {results['codec_sink_vs_raw_pipelined']:.0%} of raw (pipelined)")
    if results["otel_traces"]:
        mib = {k: v / 2**20 for k, v in results["otel_traces"].items()}
        print(
            f"otel_traces {mib['bytes_on_disk']:.1f} MiB on disk ({mib['uncompressed_bytes']:.1f} MiB uncompressed), "
            f"SpanJson {mib['span_json_compressed_bytes']:.1f} MiB of it"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
