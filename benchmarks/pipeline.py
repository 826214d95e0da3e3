"""Throughput of the span path on this machine, side by side.

1. raw aiokafka: produce pre-built span-sized byte strings, then consume them (no decoding);
2. through the codec: encode each span dict on produce, decode each record on consume;
3. codec + sink: encode on produce, then the ClickHouse sink (decode, rows, INSERT, commit).

Each stage reports produce/s, consume/s and produce+consume/s = N / (produce time + consume time).
Run: `make bench` (starts a broker on free ports in a temporary folder, stops it after), or with
AGL_KAFKA_BOOTSTRAP set to use a running cluster. Options: `--spans N`, `--text-bytes B`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
from consumers.clickhouse_sink import SpanSink
from producers.synthetic_spans import synthetic_span


async def _produce(settings: Settings, topic: str, payloads: list[tuple[bytes, bytes]]) -> float:
    producer = make_producer(settings)
    await producer.start()
    started = time.perf_counter()
    futures = [await producer.send(topic, value, key=key) for key, value in payloads]
    for f in futures:
        await f
    elapsed = time.perf_counter() - started
    await producer.stop()
    return elapsed


async def _produce_encoded(settings: Settings, topic: str, spans: list[dict[str, Any]], codec: Codec) -> float:
    producer = make_producer(settings)
    await producer.start()
    started = time.perf_counter()
    futures = [
        await producer.send(topic, codec.encode_dict("agl.Span", s), key=s["rollout_id"].encode()) for s in spans
    ]
    for f in futures:
        await f
    elapsed = time.perf_counter() - started
    await producer.stop()
    return elapsed


async def _consume(settings: Settings, topic: str, count: int, codec: Codec | None) -> float:
    consumer = make_consumer(settings, topic, group_id=f"bench-{uuid.uuid4().hex[:8]}", max_poll_records=10_000)
    await consumer.start()
    seen = 0
    started = time.perf_counter()
    while seen < count:
        batch = await consumer.getmany(timeout_ms=1000, max_records=10_000)
        for messages in batch.values():
            if codec is not None:
                for m in messages:
                    codec.decode_dict(m.value)
            seen += len(messages)
    elapsed = time.perf_counter() - started
    await consumer.stop()
    return elapsed


async def _sink(settings: Settings, count: int) -> float:
    client = get_client(settings)
    sink = SpanSink(settings, client, batch_size=20_000, flush_ms=100)
    task = asyncio.create_task(sink.run())
    started = time.perf_counter()
    while sink.stats.rows < count:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    elapsed = time.perf_counter() - started
    sink.stop()
    await task
    got = int(client.command(f"SELECT count() FROM {settings.clickhouse_database}.otel_traces"))
    client.close()
    assert got == count, f"sink wrote {got} rows, expected {count}"
    return elapsed


def _rates(count: int, produce_s: float, consume_s: float) -> dict[str, float]:
    return {
        "produce_per_s": count / produce_s,
        "consume_per_s": count / consume_s,
        "end_to_end_per_s": count / (produce_s + consume_s),
    }


async def run(settings: Settings, count: int, text_bytes: int) -> dict[str, Any]:
    codec = Codec.default()
    spans = [synthetic_span(i, rollouts=1000, text_bytes=text_bytes) for i in range(count)]
    encoded = [(s["rollout_id"].encode(), codec.encode_dict("agl.Span", s)) for s in spans]
    mean_bytes = sum(len(v) for _, v in encoded) / count
    results: dict[str, Any] = {"spans": count, "mean_span_bytes": round(mean_bytes)}

    stages: list[tuple[str, Any]] = []
    for stage in ("raw", "codec", "codec_sink"):
        stage_settings = settings.model_copy(update={"topic_prefix": f"bench{uuid.uuid4().hex[:6]}"})
        await admin.apply(stage_settings)
        topic = stage_settings.topic("spans")
        if stage == "raw":
            p = await _produce(stage_settings, topic, encoded)
            c = await _consume(stage_settings, topic, count, None)
        elif stage == "codec":
            p = await _produce_encoded(stage_settings, topic, spans, codec)
            c = await _consume(stage_settings, topic, count, codec)
        else:
            p = await _produce_encoded(stage_settings, topic, spans, codec)
            c = await _sink(stage_settings, count)
        stages.append((stage, _rates(count, p, c)))
    results.update(dict(stages))
    raw = results["raw"]["end_to_end_per_s"]
    results["codec_sink_vs_raw"] = results["codec_sink"]["end_to_end_per_s"] / raw
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spans", type=int, default=100_000)
    parser.add_argument("--text-bytes", type=int, default=1200, help="prompt text per span (sets span size)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/pipeline.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="agl-bench-") as tmp:
        base = Settings(data_dir=Path(tmp))
        started = False
        if base.uses_local_broker:
            port, cport = broker.free_ports(2)
            base = base.model_copy(update={"kafka_port": port, "kafka_controller_port": cport})
            broker.start(base)
            started = True
        try:
            results = asyncio.run(run(base, args.spans, args.text_bytes))
        finally:
            if started:
                broker.stop(base)
    print(f"{'stage':<12}{'produce/s':>14}{'consume/s':>14}{'produce+consume/s':>20}")
    for stage in ("raw", "codec", "codec_sink"):
        r = results[stage]
        print(f"{stage:<12}{r['produce_per_s']:>14,.0f}{r['consume_per_s']:>14,.0f}{r['end_to_end_per_s']:>20,.0f}")
    print(f"mean span size {results['mean_span_bytes']} B; codec+sink / raw = {results['codec_sink_vs_raw']:.0%}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
