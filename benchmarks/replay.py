"""Replay throughput: committed span history -> triplet records on a replay topic, on this machine.

Two modes:

* default: writes a history of ``--rollouts`` attempts (each: 8 LLM-call spans with 64 prompt
  and 16 response token ids and logprobs, a reward span and the agent's root span; ~1.6 KB a
  span) as events on agl.rollouts and spans on agl.spans of a local broker, then runs the
  replay twice into two topics and reports spans/s of the read-and-derive phase (what the
  progress bar shows) and end to end, and whether the two outputs' digests agree. A third run
  with ``--reward`` measures the validated-span path. Wall-clock figures: run it on a quiet machine.
* ``--cpu``: no broker. Builds the same history in memory and measures the CPU time (this
  process's, ``time.process_time``, the best of ``--repeats``) of each pure step per span:
  decoding span records (and, for comparison, the codec's full decode), folding the rollout
  events, collecting spans per attempt, the adapter, writing the records (and the codec's
  encoder), and the whole derivation of a partition (``PartitionReplay``: everything the replay
  does between the Kafka fetch and the produce). The history itself is frozen for the cyclic
  GC first (its walks of the benchmark's own inputs are no step's cost), as the replay freezes
  its folded states. CPU time is what stays comparable while other work shares the machine;
  expect it to be inflated, not only noisy, on a busy one: compare runs made side by side.

`--spans-per-record K` writes each attempt's spans as agl.SpanBatch records of up to K spans
(a writer's flushes; 0: one agl.Span per record, the old form). `--vocab N` draws token ids from
range(N) (64 by default; a real tokenizer's ~150k make multi-byte varints).

Run: `python benchmarks/replay.py [--rollouts 10000]` (JSON to benchmarks/results/replay.json) or
`python benchmarks/replay.py --cpu --rollouts 2000 --spans-per-record 10` (replay_cpu.json).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.replay_history, from the repository root

from _measure import SHORT_LIVED_JIT  # type: ignore[import-not-found]  # noqa: F401  (C1 brokers)

from agl_stream.config import Settings
from agl_stream.domain.adapter import AdapterConfig, extract_triplets
from agl_stream.domain.adapter.lean import LeanSpan
from agl_stream.domain.adapter.span_decoder import SpanRecordDecoder, lean_of_datum
from agl_stream.domain.adapter.triplet_encoder import TripletRecordEncoder
from agl_stream.domain.replay import PartitionReplay, ReplaySettings, out_record, output_digest
from agl_stream.domain.trace_collector import ReadyAttempt, TraceCollector, spans_by_attempt, triplet_record
from agl_stream.kafka import admin, broker
from agl_stream.models import Span, TripletRecord
from agl_stream.ports import free_ports
from agl_stream.wire.codec import Codec
from agl_stream.wire.span_records import span_dicts_of
from producers.replay import replay
from tests.replay_history import attempt_history, span_values, write_history


def constant_reward(spans: list[Span]) -> float:
    return 1.0


def _best(repeats: int, step: Callable[[], object]) -> float:
    """The least CPU seconds of ``repeats`` runs of ``step`` (other work only ever adds)."""
    best = float("inf")
    for _ in range(repeats):
        started = time.process_time()
        step()
        best = min(best, time.process_time() - started)
    return best


def cpu_costs(rollouts: int, per_record: int | None, *, vocab: int = 64, repeats: int = 5) -> dict[str, Any]:
    """CPU microseconds per span of each pure step of the replay, on an in-memory history."""
    codec = Codec.default()
    histories = [attempt_history(i, groups=max(1, rollouts // 8), vocab=vocab) for i in range(rollouts)]
    events = [codec.encode(event) for history in histories for event in history.events]
    values = [value for history in histories for value in span_values(history, codec, per_record)]
    spans = sum(len(history.spans) for history in histories)
    settings = ReplaySettings()
    decoder = SpanRecordDecoder(codec)
    encoder = TripletRecordEncoder(codec)

    def whole() -> list[Any]:
        """What producers.replay does with a partition, minus Kafka (and, as it does, with the
        folded states frozen for the cyclic GC while the spans go by)."""
        derivation = PartitionReplay(0, settings, {}, codec)
        for offset, value in enumerate(events):
            derivation.add_event(offset, value)
        gc.freeze()
        try:
            for offset, value in enumerate(values):
                derivation.add_spans(offset, value)
            return derivation.finish()
        finally:
            gc.unfreeze()

    def fold_events() -> PartitionReplay:
        derivation = PartitionReplay(0, settings, {}, codec)
        for offset, value in enumerate(events):
            derivation.add_event(offset, value)
        return derivation

    lean = [decoder.decode(value) for value in values]
    folded = fold_events()

    def collect() -> list[ReadyAttempt[int]]:
        # A collector holding the folded states (copied, not timed: the fold is its own step).
        collector: TraceCollector[int] = TraceCollector(max_spans=1 << 62, remember=1 << 62)
        collector.pending.update({k: _copy_entry(e) for k, e in folded.collector.pending.items()})
        ready: list[ReadyAttempt[int]] = []
        started = time.process_time()
        for offset, record in enumerate(lean):
            for group in spans_by_attempt(record):
                ready += collector.add_spans(group, offset, 0.0)[0]
        collect_s[0] = min(collect_s[0], time.process_time() - started)
        return ready

    collect_s = [float("inf")]
    for _ in range(repeats):
        attempts = collect()
    groups: list[list[LeanSpan]] = [a.spans for a in attempts]  # type: ignore[misc]
    config = AdapterConfig()
    made = [triplet_record(a.finished, a.spans, config, None)[0] for a in attempts]

    def write() -> None:
        for record in made:
            out_record((0, 0, 0), record, encoder.encode(record), "digest")

    def records() -> None:
        for attempt, record in zip(attempts, made, strict=True):
            TripletRecord(
                rollout_id=record.rollout_id, attempt_id=record.attempt_id, group_id=record.group_id,
                resources_id=None, policy_version=None, triplets=record.triplets, final_reward=record.final_reward,
                finish_time=attempt.finished.finish_time,
            )  # fmt: skip

    per_span = 1e6 / spans
    # This benchmark's own inputs and intermediate results are long-lived: not the steps' cost.
    gc.collect()
    gc.freeze()
    costs = {
        "decode_us": _best(repeats, lambda: [decoder.decode(v) for v in values]) * per_span,
        "events_fold_us": _best(repeats, fold_events) * per_span,
        "collect_us": collect_s[0] * per_span,
        "adapter_us": _best(repeats, lambda: [extract_triplets(g, config) for g in groups]) * per_span,
        "record_model_us": _best(repeats, records) * per_span,
        "write_us": _best(repeats, write) * per_span,
        "whole_partition_us": _best(repeats, whole) * per_span,
        # the codec's paths, for comparison (the decoder's fallback; what the replay used before)
        "codec_decode_us": _best(repeats, lambda: [[lean_of_datum(d) for d in span_dicts_of(codec, v)] for v in values])
        * per_span,
        "codec_encode_us": _best(repeats, lambda: [codec.encode(r) for r in made]) * per_span,
    }
    gc.unfreeze()
    identical = all(encoder.encode(r) == codec.encode(r) for r in made)
    out = whole()
    return {
        "rollouts": rollouts,
        "spans": spans,
        "spans_per_record": per_record or 1,
        "vocab": vocab,
        "repeats": repeats,
        "fast_path_records": decoder.fast_records,
        "codec_path_records": decoder.codec_records,
        "encoder_bytes_equal_codec": identical,
        "records": len(out),
        "digest": output_digest(out),
        "cpu_us_per_span": {k: round(v, 2) for k, v in costs.items()},
        "whole_partition_spans_per_cpu_s": round(1e6 / costs["whole_partition_us"]),
    }


def _copy_entry(entry: Any) -> Any:
    copy = type(entry)()
    copy.finished, copy.finished_at, copy.tokens = entry.finished, entry.finished_at, list(entry.tokens)
    return copy


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
    parser.add_argument("--cpu", action="store_true", help="CPU time of the pure steps, in this process, no broker")
    parser.add_argument("--vocab", type=int, default=64, help="token ids from range(VOCAB)")
    parser.add_argument("--repeats", type=int, default=5, help="--cpu: the best of this many runs")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    per_record = args.spans_per_record or None
    if args.cpu:
        results = cpu_costs(args.rollouts, per_record, vocab=args.vocab, repeats=args.repeats)
        out = args.out or Path("benchmarks/results/replay_cpu.json")
    else:
        with tempfile.TemporaryDirectory(prefix="agl-bench-replay-") as tmp:
            settings = Settings(data_dir=Path(tmp), topic_prefix=f"b{uuid.uuid4().hex[:6]}", log_level="WARNING")
            started = False
            if settings.uses_local_broker:
                port, controller = free_ports(2)
                settings = settings.model_copy(update={"kafka_port": port, "kafka_controller_port": controller})
                broker.start(settings)
                started = True
            try:
                results = asyncio.run(_measure(settings, args.rollouts, per_record))
            finally:
                if started:
                    broker.stop(settings)
        results["cpu"] = cpu_costs(min(args.rollouts, 1000), per_record, repeats=3)
        out = args.out or Path("benchmarks/results/replay.json")
    print(json.dumps(results, indent=2))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
