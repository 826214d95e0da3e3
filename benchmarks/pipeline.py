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
throughput of a live pipeline.

Run: `make bench` (or `python benchmarks/pipeline.py --spans 100000`). Results are also
written as JSON to benchmarks/results/pipeline.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from agl_stream.clickhouse.client import get_client
from agl_stream.codec import Codec
from agl_stream.config import Settings
from agl_stream.kafka import admin, broker
from agl_stream.kafka.io import make_consumer, make_producer
from consumers.clickhouse_sink import TableSink
from producers.synthetic_spans import synthetic_span

STAGES = ("raw", "codec", "codec_sink")


def _spans(count: int, text_bytes: int, start: int = 0) -> list[dict[str, Any]]:
    return [synthetic_span(i, rollouts=1000, text_bytes=text_bytes) for i in range(start, start + count)]


async def produce(settings: Settings, stage: str, count: int, text_bytes: int, start: int = 0) -> tuple[float, float]:
    """Produce the stage's messages; returns wall-clock times of the first send and the last ack."""
    codec = Codec.default()
    spans = _spans(count, text_bytes, start)
    prebuilt = [(s["rollout_id"].encode(), codec.encode_dict("agl.Span", s)) for s in spans] if stage == "raw" else None
    topic = settings.topic("spans")
    producer = make_producer(settings)
    await producer.start()
    try:
        started = time.time()
        if prebuilt is not None:
            futures = [await producer.send(topic, value, key=key) for key, value in prebuilt]
        else:
            futures = [
                await producer.send(topic, codec.encode_dict("agl.Span", s), key=s["rollout_id"].encode())
                for s in spans
            ]
        for future in futures:
            await future
        return started, time.time()
    finally:
        await producer.stop()


async def consume(settings: Settings, stage: str, count: int) -> tuple[float, float]:
    """Consume `count` records; returns wall-clock times of the first and the last record."""
    if stage == "codec_sink":
        return await _sink(settings, count)
    codec = Codec.default() if stage == "codec" else None
    consumer = make_consumer(settings, settings.topic("spans"), group_id=f"bench-{uuid.uuid4().hex[:8]}")
    await consumer.start()
    seen, first = 0, None
    try:
        while seen < count:
            batch = await consumer.getmany(timeout_ms=1000, max_records=10_000)
            for messages in batch.values():
                if first is None and messages:
                    first = time.time()
                if codec is not None:
                    for message in messages:
                        codec.decode_dict(message.value)
                seen += len(messages)
        return first or time.time(), time.time()
    finally:
        await consumer.stop()


async def _sink(settings: Settings, count: int) -> tuple[float, float]:
    client = get_client(settings)
    sink = TableSink(settings, client, batch_size=20_000, flush_ms=100)
    await asyncio.to_thread(sink.prepare_tables)
    task = asyncio.create_task(sink.run())
    while sink.stats.rows < count:
        if task.done():
            task.result()
        await asyncio.sleep(0.005)  # polling the sink's counter; the timing comes from its stats
    last = time.time()
    first = last - (time.monotonic() - (sink.stats.first_record_at or time.monotonic()))
    sink.stop()
    await task
    rows = int(client.command(f"SELECT count() FROM {settings.clickhouse_database}.otel_traces"))
    client.close()
    if rows != count:
        raise RuntimeError(f"the sink wrote {rows} rows, expected {count}")
    return first, last


async def stage_sequential(settings: Settings, stage: str, count: int, text_bytes: int) -> dict[str, float]:
    await admin.apply(settings)
    produce_started, produce_done = await produce(settings, stage, count, text_bytes)
    first, last = await consume(settings, stage, count)
    return {"produce_per_s": count / (produce_done - produce_started), "consume_per_s": count / (last - first)}


async def stage_pipelined(settings: Settings, stage: str, count: int, text_bytes: int, producers: int) -> float:
    """Producer processes and the consumer at the same time; N / (first send -> last record)."""
    await admin.apply(settings)
    if stage == "codec_sink":
        # Open the engine and create tables first: part of starting a sink, not of its throughput.
        client = get_client(settings)
        TableSink(settings, client).prepare_tables()
        client.close()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGL_")}
    env.update(settings.as_env())
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])  # noqa: ASYNC240 - once per stage
    share = count // producers
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
            ],
            env=env,
            stdout=subprocess.PIPE,
        )
        for i in range(producers)
    ]
    try:
        _, last = await consume(settings, stage, count)
    finally:
        outputs = [p.communicate(timeout=120)[0] for p in processes]
    started = min(json.loads(out.decode().strip().splitlines()[-1])["started"] for out in outputs)
    return count / (last - started)


async def run(base: Settings, count: int, text_bytes: int, producers: int) -> dict[str, Any]:
    codec = Codec.default()
    sample = [codec.encode_dict("agl.Span", s) for s in _spans(min(count, 1000), text_bytes)]
    results: dict[str, Any] = {"spans": count, "mean_span_bytes": round(sum(map(len, sample)) / len(sample))}
    for stage in STAGES:
        fresh = {"topic_prefix": f"bench{uuid.uuid4().hex[:6]}", "data_dir": base.data_dir / uuid.uuid4().hex[:6]}
        results[stage] = await stage_sequential(base.model_copy(update=fresh), stage, count, text_bytes)
        fresh = {"topic_prefix": f"bench{uuid.uuid4().hex[:6]}", "data_dir": base.data_dir / uuid.uuid4().hex[:6]}
        results[stage]["pipelined_per_s"] = await stage_pipelined(
            base.model_copy(update=fresh), stage, count, text_bytes, producers
        )
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
    parser.add_argument("--produce-only", choices=STAGES, help=argparse.SUPPRESS)  # a pipelined producer
    parser.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.produce_only:
        started, done = asyncio.run(produce(Settings(), args.produce_only, args.spans, args.text_bytes, args.start))
        print(json.dumps({"started": started, "done": done}))
        return
    with tempfile.TemporaryDirectory(prefix="agl-bench-") as tmp:
        base = Settings(data_dir=Path(tmp), log_level="WARNING")
        started = False
        if base.uses_local_broker:
            port, controller_port = broker.free_ports(2)
            base = base.model_copy(update={"kafka_port": port, "kafka_controller_port": controller_port})
            broker.start(base)
            started = True
            base = base.model_copy(update={"kafka_bootstrap": base.bootstrap_servers})
        try:
            results = asyncio.run(run(base, args.spans, args.text_bytes, args.producers))
        finally:
            if started:
                broker.stop(base.model_copy(update={"kafka_bootstrap": None}))
    results["producers"] = args.producers
    print(f"\n{args.spans:,} spans of {results['mean_span_bytes']} bytes (mean), messages per second")
    print(f"(pipelined: {args.producers} producer process(es) and the consumer running at once)")
    print(f"{'stage':<12}{'produce':>12}{'consume':>12}{'pipelined':>12}")
    for stage in STAGES:
        r = results[stage]
        print(f"{stage:<12}{r['produce_per_s']:>12,.0f}{r['consume_per_s']:>12,.0f}{r['pipelined_per_s']:>12,.0f}")
    print(f"codec + sink end to end = {results['codec_sink_vs_raw_pipelined']:.0%} of raw (pipelined)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
