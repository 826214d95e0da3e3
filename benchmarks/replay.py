"""Replay throughput: committed span history -> triplet records on a replay topic, on this machine.

Writes a history of ``--rollouts`` attempts (each: 8 LLM-call spans with 64 prompt and 16
response token ids and logprobs, a reward span and the agent's root span; ~1.6 KB a span) as
events on agl.rollouts and spans on agl.spans of a local broker, then runs the replay twice
into two topics and reports spans/s of the read-and-derive phase (what the progress bar shows)
and end to end, and whether the two outputs' digests agree. A third run with ``--reward``
measures the validated-span path. Also times the pure steps per span (decode, span view,
adapter) to show where the time goes.

`--spans-per-record K` writes each attempt's spans as agl.SpanBatch records of up to K spans
(a writer's flushes; 0: one agl.Span per record, the old form).

Run: `python benchmarks/replay.py [--rollouts 10000]`; JSON to benchmarks/results/replay.json.
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

from agl_stream.codec import Codec
from agl_stream.config import Settings
from agl_stream.domain.adapter import AdapterConfig, extract_triplets
from agl_stream.domain.replay import ReplaySettings, span_view
from agl_stream.kafka import admin, broker
from agl_stream.models import Span
from agl_stream.span_records import span_dicts_of
from producers.replay import replay
from producers.replay_history import attempt_history, span_values, write_history


def constant_reward(spans: list[Span]) -> float:
    return 1.0


def _pure_costs(per_record: int | None, rollouts: int = 500) -> dict[str, float]:
    """Microseconds per span of each pure step, on the same history shape."""
    codec = Codec.default()
    raw = [value for i in range(rollouts) for value in span_values(attempt_history(i), codec, per_record)]
    t = time.perf_counter()
    dicts = [datum for r in raw for datum in span_dicts_of(codec, r)]
    decode = time.perf_counter() - t
    t = time.perf_counter()
    views = [span_view(d) for d in dicts]
    view = time.perf_counter() - t
    t = time.perf_counter()
    validated = [Span.model_validate(d) for d in dicts]
    validate = time.perf_counter() - t
    per_attempt = len(dicts) // rollouts
    t = time.perf_counter()
    for i in range(rollouts):
        extract_triplets(views[i * per_attempt : (i + 1) * per_attempt], AdapterConfig())
    adapter = time.perf_counter() - t
    del validated
    n = len(dicts) / 1e6
    return {
        "decode_us": decode / n,
        "span_view_us": view / n,
        "pydantic_validate_us": validate / n,
        "adapter_us": adapter / n,
    }


async def _measure(settings: Settings, rollouts: int, per_record: int | None) -> dict[str, Any]:
    await admin.apply(settings)
    t = time.perf_counter()
    step = 2000
    for start in range(0, rollouts, step):
        await write_history(
            settings,
            [attempt_history(i, groups=rollouts // 8) for i in range(start, min(rollouts, start + step))],
            batch=per_record,
        )
    written_s = time.perf_counter() - t
    runs = {}
    for name, settings_ in (("a", ReplaySettings()), ("b", ReplaySettings())):
        summary = await replay(settings, name, replay_settings=settings_)
        runs[name] = summary
    with_reward = await replay(settings, "reward", replay_settings=ReplaySettings(reward=f"{__name__}:constant_reward"))
    a, b = runs["a"], runs["b"]
    return {
        "rollouts": rollouts,
        "spans_per_record": per_record or 1,
        "span_records": sum(hi - lo for lo, hi in a.ranges.values()),
        "spans": a.spans,
        "records": a.records,
        "history_write_s": written_s,
        "replay_read_derive_spans_per_s": a.spans_per_s,
        "replay_end_to_end_spans_per_s": a.spans / a.elapsed_s,
        "replay_elapsed_s": a.elapsed_s,
        "second_run_spans_per_s": b.spans_per_s,
        "with_reward_fn_spans_per_s": with_reward.spans_per_s,
        "digests_equal": a.digest == b.digest,
        "digest": a.digest,
        "goal_spans_per_s": 50_000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=10_000)
    parser.add_argument("--spans-per-record", type=int, default=0, help="spans per agl.SpanBatch (0: agl.Span records)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/replay.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="agl-bench-replay-") as tmp:
        settings = Settings(data_dir=Path(tmp), topic_prefix=f"b{uuid.uuid4().hex[:6]}", log_level="WARNING")
        started = False
        if settings.uses_local_broker:
            port, controller = broker.free_ports(2)
            settings = settings.model_copy(update={"kafka_port": port, "kafka_controller_port": controller})
            broker.start(settings)
            started = True
        try:
            results = asyncio.run(_measure(settings, args.rollouts, args.spans_per_record or None))
        finally:
            if started:
                broker.stop(settings)
    results["pure_per_span"] = _pure_costs(args.spans_per_record or None)
    print(json.dumps(results, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
