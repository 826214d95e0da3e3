"""CPU per span on the runner's span-ingest path, in process: no Kafka, no other processes.

Spans are made through a real OpenTelemetry ``TracerProvider`` carrying our processor, inside
``AttemptTracer.attempt`` (as the runner makes them), and exported to a fake sink that does
what the store client does with them on the way to the broker: ``span_records`` (the
agl.SpanBatch records), then nothing. Every figure is CPU time of the one thread that does all
of it (``time.thread_time``), so work that other processes do on this machine meanwhile does
not count, although it still slows caches and clocks: take the minimum over repeats.

Stages, in microseconds of CPU per span:

* ``sdk``: the same spans made through a bare ``TracerProvider`` (no processor at all): the
  OpenTelemetry SDK's own cost, our floor;
* ``tracer``: the run with our processor, buffer and exporter, the sink taking the spans but
  encoding nothing, less ``sdk``: tagging at start, conversion at end, numbering, export loop;
* ``encode``: CPU spent inside ``span_records`` in the sink (the Avro of the batch records);
* ``total``: the whole run with encoding, per span (sdk + tracer + encode, measured at once).

Ids and times are deterministic (a counting id generator, fixed timestamps), so the digest of
the records is the same for the same code and shape: a change that keeps it keeps the bytes.

``--sink`` also hands the records to the span sink's INSERT into the embedded ClickHouse (no
Kafka: ``TableSink._insert`` on the records as fetched), once as the migrations define the ingest
view and once with its SpanJson expression replaced by '' (as ``pipeline.py
--without-span-json`` does), and reports the process's CPU per span (the engine's threads
included: ``time.process_time``) and otel_traces' size after a final merge, for both.

Run: ``python benchmarks/span_encode.py [--spans 20000] [--per-attempt 100] [--shape chatty] [--sink]``.
Shapes: ``chatty`` (bench_agents.chatty: a 2 KB prompt and a step number), ``calls``
(bench_agents.ten_calls: token-id lists), ``rich`` (events, a link, an error status, a parent,
lists of every attribute type).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import Link, SpanContext, Status, StatusCode, Tracer

from agl_stream.agent.tracing import AttemptTracer
from agl_stream.models import Span
from agl_stream.wire.codec import Codec
from agl_stream.wire.span_records import span_records

_PAYLOAD = "x" * 2048
_T0 = 1_760_000_000_000_000_000  # ns: a fixed epoch time, so the records are the same every run


class CountingIds(IdGenerator):
    """Deterministic span and trace ids (restarted per repeat), so runs give the same bytes."""

    def __init__(self) -> None:
        self.next = 1

    def reset(self) -> None:
        self.next = 1

    def generate_span_id(self) -> int:
        self.next += 1
        return self.next

    def generate_trace_id(self) -> int:
        self.next += 1
        return (self.next << 64) | 0xABCDEF


def _chatty(tracer: Tracer, index: int) -> None:
    span = tracer.start_span("llm.call", start_time=_T0 + index * 1000)
    with trace.use_span(span, end_on_exit=False):
        span.set_attribute("gen_ai.prompt", _PAYLOAD)
        span.set_attribute("step", index)
    span.end(end_time=_T0 + index * 1000 + 500)


def _calls(tracer: Tracer, index: int) -> None:
    span = tracer.start_span("openai.chat.completion", start_time=_T0 + index * 1000)
    with trace.use_span(span, end_on_exit=False):
        span.set_attribute("gen_ai.response.id", f"chatcmpl-{index}")
        span.set_attribute("prompt_token_ids", list(range(100 + index % 10, 164 + index % 10)))
        span.set_attribute("response_token_ids", list(range(16)))
    span.end(end_time=_T0 + index * 1000 + 500)


_LINKED = SpanContext(trace_id=0x1234, span_id=0x5678, is_remote=True)


def _rich(tracer: Tracer, index: int) -> None:
    parent = tracer.start_span("agent.step", start_time=_T0 + index * 1000)
    with trace.use_span(parent, end_on_exit=False):
        child = tracer.start_span(
            "tool.call",
            kind=trace.SpanKind.CLIENT,
            links=[Link(_LINKED, {"why": "retry", "n": 2})],
            start_time=_T0 + index * 1000 + 10,
        )
        child.set_attributes({"text": "héllo", "flag": True, "ratio": 0.25, "ints": [1, 2, 3], "strs": ["a", "b"]})
        child.add_event("token", {"i": index, "p": 0.5}, timestamp=_T0 + index * 1000 + 20)
        child.add_event("done", timestamp=_T0 + index * 1000 + 30)
        child.set_status(Status(StatusCode.ERROR, "tool failed"))
        child.end(end_time=_T0 + index * 1000 + 40)
    parent.end(end_time=_T0 + index * 1000 + 50)


SHAPES: dict[str, tuple[Callable[[Tracer, int], None], int]] = {
    "chatty": (_chatty, 1),  # (maker, spans it makes)
    "calls": (_calls, 1),
    "rich": (_rich, 2),
}


class CapturingSink:
    """The store client's part that touches spans, minus the broker: build the records, keep them."""

    def __init__(self, codec: Codec, *, encode: bool) -> None:
        self.codec = codec
        self.encode = encode
        self.records: list[tuple[str, bytes]] = []
        self.encode_cpu = 0.0
        self.spans = 0

    async def export_spans(self, spans: Sequence[Span]) -> None:
        self.spans += len(spans)
        if self.encode:
            started = time.thread_time()
            records = span_records(spans, self.codec)
            self.encode_cpu += time.thread_time() - started
            self.records += records


async def _traced_run(
    ids: CountingIds, make: Callable[[Tracer, int], None], calls: int, per_attempt: int, *, encode: bool
) -> tuple[float, CapturingSink]:
    """CPU seconds of making ``calls`` x ``make`` through our tracer into a sink (one thread)."""
    sink = CapturingSink(Codec.default(), encode=encode)
    tracer = AttemptTracer(sink, instrument_genai=False)
    await tracer.start()
    otel = tracer.tracer_provider.get_tracer("bench")
    ids.reset()
    started = time.thread_time()
    for attempt in range(0, calls, per_attempt):
        async with tracer.attempt(f"ro-{attempt:012x}", f"at-{attempt:08x}", policy_version=3):
            for index in range(attempt, min(calls, attempt + per_attempt)):
                make(otel, index)
    cpu = time.thread_time() - started
    await tracer.close()
    return cpu, sink


def _sdk_run(provider: TracerProvider, ids: CountingIds, make: Callable[[Tracer, int], None], calls: int) -> float:
    otel = provider.get_tracer("bench")
    ids.reset()
    started = time.thread_time()
    for index in range(calls):
        make(otel, index)
    return time.thread_time() - started


def _digest(records: list[tuple[str, bytes]]) -> str:
    digest = hashlib.sha256()
    for key, value in records:
        digest.update(key.encode())
        digest.update(len(value).to_bytes(8, "little"))
        digest.update(value)
    return digest.hexdigest()[:16]


def measure_sink(records: list[tuple[str, bytes]], spans: int, *, span_json: bool, repeats: int) -> dict[str, Any]:
    """CPU per span of the span sink's INSERTs of ``records`` (batches of ~20k spans, as the
    sink's default batch), and the table's size, with or without SpanJson."""
    import tempfile

    from pipeline import _table_sizes, without_span_json  # type: ignore[import-not-found]

    from agl_stream.clickhouse.client import get_client
    from agl_stream.config import Settings
    from agl_stream.kafka.io import Fetched
    from consumers.clickhouse_sink import TableSink
    from consumers.sink_specs import SPANS

    cpu: list[float] = []
    sizes: dict[str, int] = {}
    for _ in range(repeats):
        with tempfile.TemporaryDirectory(prefix="agl-bench-span-sink-") as tmp:
            settings = Settings(data_dir=Path(tmp))
            client = get_client(settings)
            try:
                sink = TableSink(settings, client, SPANS)
                sink.prepare_tables()
                if not span_json:
                    without_span_json(client, settings.clickhouse_database)
                fetched = []
                for offset, (key, value) in enumerate(records):
                    body = sink.bodies(value)
                    assert body is not None
                    fetched.append(Fetched("agl.spans", 0, offset, key.encode(), body, value, 0))
                per_insert = max(1, len(fetched) * 20_000 // spans)
                started = time.process_time()
                for start in range(0, len(fetched), per_insert):
                    sink._insert(fetched[start : start + per_insert], {})
                cpu.append((time.process_time() - started) / spans * 1e6)
                rows = client.query(f"SELECT count() FROM {settings.clickhouse_database}.otel_traces").result_rows[0][0]
                assert rows == spans, (rows, spans)
                sizes = _table_sizes(client, settings.clickhouse_database)
            finally:
                client.close()
    return {
        "span_json": span_json,
        "insert_cpu_us_per_span_min": round(min(cpu), 1),
        "insert_cpu_us_per_span_median": round(statistics.median(cpu), 1),
        "table_bytes_per_span": round(sizes["bytes_on_disk"] / spans, 1),
        "span_json_bytes_per_span": round(sizes["span_json_compressed_bytes"] / spans, 1),
    }


def measure(shape: str, spans: int, per_attempt: int, repeats: int, *, with_sink: bool = False) -> dict[str, Any]:
    make, made = SHAPES[shape]
    calls = max(1, spans // made)
    # Resource(...), not Resource.create: that adds a random service.instance.id.
    resource = Resource(
        {
            "telemetry.sdk.language": "python",
            "telemetry.sdk.name": "opentelemetry",
            "telemetry.sdk.version": "1.0",
            "service.name": "bench",
            "host.name": "bench-host",
        }
    )
    ids = CountingIds()
    # The global provider (ours goes on it, as in a runner) and a bare one for the SDK floor.
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        trace.set_tracer_provider(TracerProvider(resource=resource, id_generator=ids))
    provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider)
    ids = provider.id_generator  # type: ignore[assignment]
    bare = TracerProvider(resource=resource, id_generator=ids)
    runs: dict[str, list[float]] = {"sdk": [], "tracer": [], "encode": [], "total": []}
    digests = set()
    total_spans = calls * made
    for _ in range(repeats):
        sdk = _sdk_run(bare, ids, make, calls)
        plain, _ = asyncio.run(_traced_run(ids, make, calls, per_attempt, encode=False))
        full, sink = asyncio.run(_traced_run(ids, make, calls, per_attempt, encode=True))
        assert sink.spans == total_spans, (sink.spans, total_spans)
        digests.add(_digest(sink.records))
        runs["sdk"].append(sdk / total_spans * 1e6)
        runs["tracer"].append((plain - sdk) / total_spans * 1e6)
        runs["encode"].append(sink.encode_cpu / total_spans * 1e6)
        runs["total"].append(full / total_spans * 1e6)
    sink_results = (
        [measure_sink(sink.records, total_spans, span_json=with_json, repeats=repeats) for with_json in (True, False)]
        if with_sink
        else []
    )
    return {
        "shape": shape,
        "spans": total_spans,
        "per_attempt": per_attempt,
        "repeats": repeats,
        "bytes_per_span": round(sum(len(v) for _, v in sink.records) / total_spans),
        "cpu_us_per_span_min": {k: round(min(v), 1) for k, v in runs.items()},
        "cpu_us_per_span_median": {k: round(statistics.median(v), 1) for k, v in runs.items()},
        "digest": sorted(digests),
        **({"sink": sink_results} if sink_results else {}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spans", type=int, default=20_000)
    parser.add_argument("--per-attempt", type=int, default=100, help="spans per attempt (one flush each)")
    parser.add_argument("--shape", choices=[*SHAPES, "all"], default="all")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sink", action="store_true", help="also the sink's INSERT, with and without SpanJson")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/span_encode.json"))
    args = parser.parse_args()
    shapes = list(SHAPES) if args.shape == "all" else [args.shape]
    results = [measure(shape, args.spans, args.per_attempt, args.repeats, with_sink=args.sink) for shape in shapes]
    print(json.dumps(results, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
