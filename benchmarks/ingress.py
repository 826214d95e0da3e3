"""Task ingress throughput on this machine: agl.task-requests -> RolloutEnqueued (and -> rollouts).

Two figures, every process on the same cores (broker, ingress, rollout processor, this script):

- ``drain``: N requests already on agl.task-requests; the ingress process alone, from its
  partition assignment until it has committed all of them (each one validated, its event
  acknowledged on agl.rollouts, the offsets committed). CPU per request of the ingress.
- ``live``: ingress and rollout processor running; this script produces M requests as fast as it
  can; from the first send until the processor has folded all M into rollout states (the
  rollouts exist), i.e. requests/s end to end (ClickHouse not included: no gateway runs).

Run: `python benchmarks/ingress.py --requests 20000 --live 5000` (starts a broker on free ports in
a temporary folder unless AGL_KAFKA_BOOTSTRAP is set; stops everything it started). JSON results
go to benchmarks/results/ingress.json.
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

from _measure import cpu_seconds  # type: ignore[import-not-found]

from agl_stream.config import Settings
from agl_stream.kafka import admin, broker
from agl_stream.kafka.io import make_producer
from agl_stream.kafka.offsets import committed_offsets, end_offsets
from agl_stream.local.processes import start_role, stop_role
from agl_stream.models import RolloutConfig, TaskRequest
from agl_stream.ports import free_ports
from agl_stream.wire.codec import Codec

READY = "ingress.ready"


def _requests(count: int, tag: str) -> list[tuple[bytes, bytes]]:
    codec = Codec.default()
    out = []
    for i in range(count):
        request = TaskRequest(
            request_id=f"{tag}-{i:07d}",
            input={"question": f"What is {i} + {i}?", "expected": str(2 * i), "tags": ["math", "easy"]},
            mode="train",
            config=RolloutConfig(max_attempts=3, timeout_seconds=60.0, retry_condition=["failed", "timeout"]),
            metadata={"source": "benchmark", "row": i},
            request_time=time.time(),
        )
        out.append((request.request_id.encode(), codec.encode(request)))
    return out


async def _produce(settings: Settings, records: list[tuple[bytes, bytes]]) -> None:
    producer = make_producer(settings)
    await producer.start()
    try:
        topic = settings.topic("task-requests")
        futures = [await producer.send(topic, value, key=key) for key, value in records]
        for future in futures:
            await future
    finally:
        await producer.stop()


async def _wait_until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} after {timeout}s")
        await asyncio.sleep(0.02)  # polling committed offsets of another process


async def run(settings: Settings, requests: int, live: int) -> dict[str, Any]:
    await admin.apply(settings)
    group = f"{settings.topic_prefix}.processor.ingress"
    logs = settings.data_dir / "logs"
    await _produce(settings, _requests(requests, "drain"))

    async def committed() -> int:
        return sum((await committed_offsets(settings, group)).values())

    ingress = start_role(settings, "ingress", log_path=logs / "ingress.log")
    processor = None
    try:
        ready = settings.run_dir / READY

        async def is_ready() -> bool:
            return ready.exists()

        await _wait_until(is_ready, 120, "the ingress was not assigned its partitions")
        started, cpu0 = time.perf_counter(), cpu_seconds(ingress.pid)

        async def drained() -> bool:
            return await committed() >= requests

        await _wait_until(drained, 600, "the ingress did not drain the backlog")
        drain_s, drain_cpu = time.perf_counter() - started, cpu_seconds(ingress.pid) - cpu0

        processor = start_role(settings, "processor", log_path=logs / "processor.log")
        state_topic = settings.topic("rollout-state")

        async def states() -> int:
            return sum((await end_offsets(settings, state_topic)).values())

        # The processor folds the drained backlog first; the live run starts from a quiet pipeline.
        async def folded_backlog() -> bool:
            return await states() >= requests

        await _wait_until(folded_backlog, 600, "the processor did not fold the backlog")
        records = _requests(live, "live")
        started = time.perf_counter()
        cpu_live0 = cpu_seconds(ingress.pid)
        await _produce(settings, records)
        produced_s = time.perf_counter() - started

        async def folded_live() -> bool:
            return await states() >= requests + live

        await _wait_until(folded_live, 600, "the live requests did not all become rollouts")
        live_s = time.perf_counter() - started
        live_cpu = cpu_seconds(ingress.pid) - cpu_live0
    finally:
        stop_role(ingress)
        if processor is not None:
            stop_role(processor)
    return {
        "drain": {
            "requests": requests,
            "seconds": round(drain_s, 3),
            "requests_per_s": round(requests / drain_s, 1),
            "ingress_cpu_us_per_request": round(drain_cpu / requests * 1e6, 1),
        },
        "live": {
            "requests": live,
            "produce_seconds": round(produced_s, 3),
            "seconds_to_rollouts": round(live_s, 3),
            "requests_per_s_to_rollouts": round(live / live_s, 1),
            "ingress_cpu_us_per_request": round(live_cpu / live * 1e6, 1),
        },
        "request_bytes": len(_requests(1, "size")[0][1]),
        "machine": "2 cores shared by the broker, the ingress, the rollout processor and this script",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20_000, help="backlog the ingress drains alone")
    parser.add_argument("--live", type=int, default=5_000, help="requests produced with ingress and processor running")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/ingress.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="agl-bench-ingress-") as tmp:
        settings = Settings(data_dir=Path(tmp), topic_prefix=f"b{uuid.uuid4().hex[:6]}", log_level="WARNING")
        own_broker = settings.uses_local_broker
        if own_broker:
            port, controller = free_ports(2)
            settings = settings.model_copy(update={"kafka_port": port, "kafka_controller_port": controller})
            broker.start(settings)
        try:
            results = asyncio.run(run(settings, args.requests, args.live))
        finally:
            if own_broker:
                broker.stop(settings)
    print(json.dumps(results, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
