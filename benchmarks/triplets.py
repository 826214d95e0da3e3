"""Attempt finished -> its TripletRecord on agl.triplets, under load, on this machine.

Starts the local stack with the training roles (processor, gateway, triplet builder, batcher)
and runner processes whose agent makes 10 LLM-call spans (shaped like the proxy's, with token
ids) and a reward per rollout. Rollouts are enqueued at ``--rate`` per second; the latency of
an attempt is the Kafka timestamp of its record on agl.triplets minus the attempt's end time
(both from this machine's clock). Reports p50/p99 and the rate actually reached.

Run: `python benchmarks/triplets.py [--rollouts 1500 --rate 100]`; JSON to benchmarks/results/triplets.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from _measure import bench_settings, percentile  # type: ignore[import-not-found]
from aiokafka import AIOKafkaConsumer

from agl_stream import connect
from agl_stream.config import Settings
from agl_stream.local import stack
from agl_stream.local.processes import start_role, stop_role
from agl_stream.models import TripletRecord
from agl_stream.wire.codec import Codec


async def _measure(settings: Settings, rollouts: int, rate: float) -> dict[str, Any]:
    async with connect(**settings.model_dump(exclude_none=True)) as store:
        started = time.perf_counter()
        made = []
        step = max(1, int(rate / 10))  # enqueue in tenths of a second
        for start in range(0, rollouts, step):
            batch = [{"input": {"i": i}} for i in range(start, min(rollouts, start + step))]
            made += await store.enqueue_many_rollouts(batch)
            target = started + len(made) / rate
            await asyncio.sleep(max(0.0, target - time.perf_counter()))  # pacing the load
        finished = await store.wait_for_rollouts(rollout_ids=[r.rollout_id for r in made], timeout=900)
        elapsed = time.perf_counter() - started
    wanted = {r.rollout_id for r in made}
    consumer = AIOKafkaConsumer(
        settings.topic("triplets"), **settings.kafka_client_options(), auto_offset_reset="earliest"
    )
    await consumer.start()
    latencies: dict[str, float] = {}
    codec = Codec.default()
    try:
        deadline = time.monotonic() + 120
        while len(latencies) < len(wanted) and time.monotonic() < deadline:
            for messages in (await consumer.getmany(timeout_ms=500)).values():
                for message in messages:
                    record = codec.decode(message.value or b"", TripletRecord)
                    if record.rollout_id in wanted and record.rollout_id not in latencies:
                        latencies[record.rollout_id] = message.timestamp / 1000 - record.finish_time
    finally:
        await consumer.stop()
    values = list(latencies.values())
    return {
        "rollouts": len(made),
        "succeeded": sum(r.status == "succeeded" for r in finished),
        "records": len(latencies),
        "target_rate": rate,
        "rollouts_per_s": len(made) / elapsed,
        "llm_calls_per_s": 10 * len(made) / elapsed,
        "finish_to_record_ms": {
            "p50": percentile(values, 0.5) * 1e3,
            "p99": percentile(values, 0.99) * 1e3,
            "max": max(values) * 1e3 if values else float("nan"),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=1500)
    parser.add_argument("--rate", type=float, default=100.0, help="rollouts enqueued per second")
    parser.add_argument("--workers", type=int, default=2, help="runner processes")
    parser.add_argument("--concurrency", type=int, default=32, help="attempts per runner process")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/triplets.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="agl-bench-triplets-") as tmp:
        settings = bench_settings(Path(tmp), "b")
        stack.up(settings, training=True)
        try:
            running = stack.local_stack_settings(settings)
            runners = start_role(
                running,
                "runner",
                "--agent",
                "benchmarks.bench_agents:ten_calls",
                "--workers",
                str(args.workers),
                "--concurrency",
                str(args.concurrency),
                log_path=Path(tmp) / "runners.log",
            )
            try:
                results = asyncio.run(_measure(running, args.rollouts, args.rate))
            finally:
                stop_role(runners, timeout=60)
        finally:
            stack.down(settings)
    print(json.dumps(results, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
