"""AttemptTracer against a fake sink: attribution, sequence ids, flush, back-pressure, failures."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence

import pytest
from opentelemetry import trace

from agl_stream.agent.tracing import (
    ATTEMPT_ID_KEY,
    ROLLOUT_ID_KEY,
    SEQUENCE_ID_KEY,
    AttemptTracer,
    Cut,
    ExportPolicy,
    Wait,
)
from agl_stream.models import Span, SpanBatch
from agl_stream.wire.codec import Codec
from agl_stream.wire.semconv import POLICY_VERSION
from agl_stream.wire.span_records import span_records

TIMEOUT = 60.0  # generous: the machine may be busy with a benchmark
tracer_api = trace.get_tracer("tests.tracing")


class FakeSink:
    """Records batches; ``gate`` (when given) holds every export until it is set."""

    def __init__(self, gate: asyncio.Event | None = None) -> None:
        self.batches: list[list[Span]] = []
        self.calls = 0
        self.gate = gate
        self.fail: Callable[[Sequence[Span]], Exception | None] = lambda spans: None

    async def export_spans(self, spans: Sequence[Span]) -> None:
        self.calls += 1
        if self.gate is not None:
            await self.gate.wait()
        error = self.fail(spans)
        if error is not None:
            raise error
        self.batches.append(list(spans))

    @property
    def spans(self) -> list[Span]:
        return [span for batch in self.batches for span in batch]


async def wait_until(predicate: Callable[[], bool], timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met before the deadline")
        await asyncio.sleep(0.01)


def _spans(names: Sequence[str]) -> None:
    for name in names:
        with tracer_api.start_as_current_span(name):
            pass


# -- the pure batching decision --------------------------------------------------------------


def test_policy_cuts_full_batches_old_batches_and_on_flush() -> None:
    policy = ExportPolicy(batch_size=4, flush_interval_s=0.1)
    assert policy.decide(0, 0.0, flushing=False) == Wait(None)
    assert policy.decide(0, 0.0, flushing=True) == Wait(None)
    assert policy.decide(2, 0.03, flushing=False) == Wait(pytest.approx(0.07))  # type: ignore[arg-type]
    assert policy.decide(2, 0.1, flushing=False) == Cut(2)
    assert policy.decide(2, 0.0, flushing=True) == Cut(2)
    assert policy.decide(4, 0.0, flushing=False) == Cut(4)
    assert policy.decide(9, 0.0, flushing=False) == Cut(4)
    assert policy.decide(9, 5.0, flushing=True) == Cut(4)


def test_policy_wakes_only_on_transitions() -> None:
    policy = ExportPolicy(batch_size=3, flush_interval_s=0.1)
    assert [policy.wakes(n) for n in range(1, 6)] == [True, False, True, False, False]
    with pytest.raises(ValueError):
        ExportPolicy(batch_size=0)


# -- attribution and sequence ids ------------------------------------------------------------


async def test_concurrent_attempts_and_a_thread_get_their_own_gap_free_sequences() -> None:
    sink = FakeSink()
    async with AttemptTracer(sink, batch_size=3, flush_interval_s=0.05, instrument_genai=False) as tracer:

        async def async_agent(rollout_id: str, attempt_id: str, count: int) -> list[Span]:
            async with tracer.attempt(rollout_id, attempt_id) as attempt_trace:
                for index in range(count):
                    with tracer_api.start_as_current_span(f"{attempt_id}-{index}"):
                        await asyncio.sleep(0)  # interleave with the other attempts' spans
            return attempt_trace.spans

        async def thread_agent(count: int) -> list[Span]:
            async with tracer.attempt("ro-3", "at-3", first_sequence_id=5) as attempt_trace:
                await asyncio.to_thread(_spans, [f"at-3-{index}" for index in range(count)])
            return attempt_trace.spans

        first, second, third = await asyncio.wait_for(
            asyncio.gather(async_agent("ro-1", "at-1", 20), async_agent("ro-2", "at-2", 13), thread_agent(11)),
            TIMEOUT,
        )
        stats = tracer.stats()
    for spans, rollout_id, attempt_id, count, first_id in [
        (first, "ro-1", "at-1", 20, 1),
        (second, "ro-2", "at-2", 13, 1),
        (third, "ro-3", "at-3", 11, 5),
    ]:
        assert [s.sequence_id for s in spans] == list(range(first_id, first_id + count))
        assert [s.name for s in spans] == [f"{attempt_id}-{index}" for index in range(count)]
        for span in spans:
            assert (span.rollout_id, span.attempt_id) == (rollout_id, attempt_id)
            assert span.attributes[ROLLOUT_ID_KEY] == rollout_id
            assert span.attributes[ATTEMPT_ID_KEY] == attempt_id
            assert span.attributes[SEQUENCE_ID_KEY] == span.sequence_id
    assert sorted((s.attempt_id, s.sequence_id) for s in sink.spans) == sorted(
        (s.attempt_id, s.sequence_id) for s in first + second + third
    )
    assert stats.exported == 44 and stats.pending == 0 and stats.overflow == stats.late == stats.unfinished == 0


async def test_nested_spans_keep_parent_ids_and_are_numbered_in_end_order() -> None:
    sink = FakeSink()
    async with AttemptTracer(sink, instrument_genai=False) as tracer:
        async with tracer.attempt("ro-1", "at-1") as attempt_trace:
            with tracer_api.start_as_current_span("outer") as outer:
                with tracer_api.start_as_current_span("middle") as middle:
                    with tracer_api.start_as_current_span("inner"):
                        pass
                with tracer_api.start_as_current_span("sibling"):
                    pass
    by_name = {s.name: s for s in attempt_trace.spans}
    assert [s.name for s in attempt_trace.spans] == ["inner", "middle", "sibling", "outer"]
    assert [s.sequence_id for s in attempt_trace.spans] == [1, 2, 3, 4]
    outer_id = f"{outer.get_span_context().span_id:016x}"
    middle_id = f"{middle.get_span_context().span_id:016x}"
    assert by_name["outer"].parent_id is None
    assert by_name["middle"].parent_id == outer_id and by_name["sibling"].parent_id == outer_id
    assert by_name["inner"].parent_id == middle_id
    assert len({s.trace_id for s in attempt_trace.spans}) == 1


async def test_spans_carry_the_policy_version_of_their_attempt() -> None:
    sink = FakeSink()
    async with AttemptTracer(sink, instrument_genai=False) as tracer:
        async with tracer.attempt("ro-1", "at-1", policy_version=6) as versioned:
            with tracer_api.start_as_current_span("step"):
                pass
        async with tracer.attempt("ro-2", "at-2") as unversioned:
            with tracer_api.start_as_current_span("step"):
                pass
    assert [s.attributes.get(POLICY_VERSION) for s in versioned.spans] == [6]
    assert [s.attributes.get(POLICY_VERSION) for s in unversioned.spans] == [None]


async def test_traced_spans_make_the_bytes_the_validated_models_make() -> None:
    """The tracer builds its models without validation and the records are written by hand:
    the records are byte for byte those of validated models written by fastavro (the old path)."""
    sink = FakeSink()
    linked = trace.SpanContext(0x1234, 0x5678, is_remote=True, trace_state=trace.TraceState([("k", "v")]))
    async with AttemptTracer(sink, instrument_genai=False) as tracer:
        async with tracer.attempt("ro-000000000001", "at-00000001", policy_version=6):
            with tracer_api.start_as_current_span("agent", attributes={"ids": [1, 2, 3], "names": ["a", "é"]}):
                with tracer_api.start_as_current_span(
                    "llm", kind=trace.SpanKind.CLIENT, links=[trace.Link(linked, {"why": "retry"})]
                ) as call:
                    call.set_attributes({"prompt": "x" * 2048, "t": 0.5, "on": True, "big": 2**63 - 1})
                    call.add_event("token", {"i": 1, "xs": (0.5, 1.5)})
                    call.set_status(trace.Status(trace.StatusCode.ERROR, "boom"))
                with tracer_api.start_as_current_span(SEQUENCE_ID_KEY, attributes={SEQUENCE_ID_KEY: 99}):
                    pass  # a span that names its own sequence id: the tracer's number wins, in place
    spans = sink.spans
    assert [s.name for s in spans] == ["llm", SEQUENCE_ID_KEY, "agent"]
    validated = [Span.model_validate(span.model_dump()) for span in spans]
    assert validated == spans
    codec = Codec.default()
    batch = SpanBatch(rollout_id="ro-000000000001", attempt_id="at-00000001", spans=validated)
    assert span_records(spans, codec) == [("ro-000000000001", codec.encode(batch))]
    assert spans[1].attributes[SEQUENCE_ID_KEY] == spans[1].sequence_id == 2


async def test_spans_outside_an_attempt_are_counted_not_exported() -> None:
    sink = FakeSink()
    async with AttemptTracer(sink, instrument_genai=False) as tracer:
        before = tracer.stats().untracked
        _spans(["before"])
        async with tracer.attempt("ro-1", "at-1") as attempt_trace:
            _spans(["inside"])
            # A plain thread does not copy the context: its spans belong to no attempt.
            thread = threading.Thread(target=_spans, args=(["plain-thread"],))
            thread.start()
            await asyncio.to_thread(thread.join)
        _spans(["after"])
        assert tracer.stats().untracked - before == 3
    assert [s.name for s in sink.spans] == ["inside"] == [s.name for s in attempt_trace.spans]


# -- flush -----------------------------------------------------------------------------------


async def test_leaving_the_attempt_flushes_everything_it_made() -> None:
    sink = FakeSink()
    # Neither a full batch nor the interval would ever cut these: only the flush does.
    async with AttemptTracer(sink, batch_size=10_000, flush_interval_s=3600, instrument_genai=False) as tracer:
        async with tracer.attempt("ro-1", "at-1") as attempt_trace:
            _spans([f"s{i}" for i in range(7)])
            await asyncio.to_thread(_spans, ["t0", "t1"])
            assert sink.spans == []
        assert [s.sequence_id for s in sink.spans] == list(range(1, 10))
        assert attempt_trace.spans == sink.spans and attempt_trace.dropped == 0
        async with tracer.attempt("ro-2", "at-2") as empty:
            pass
        assert empty.spans == [] and sink.calls == 1


async def test_spans_that_outlive_their_attempt_are_counted_as_dropped() -> None:
    sink = FakeSink()
    async with AttemptTracer(sink, instrument_genai=False) as tracer:
        leaked: list[asyncio.Task[None]] = []
        gate = asyncio.Event()

        async def late_span() -> None:
            await gate.wait()
            _spans(["late"])

        async with tracer.attempt("ro-1", "at-1") as attempt_trace:
            unfinished = tracer_api.start_span("unfinished")
            leaked.append(asyncio.create_task(late_span()))  # copies the attempt's context
            _spans(["kept"])
        unfinished.end()
        gate.set()
        await asyncio.wait_for(leaked[0], TIMEOUT)
        stats = tracer.stats()
    assert [s.name for s in sink.spans] == ["kept"]
    assert stats.unfinished == 1 and stats.late == 1 and attempt_trace.dropped == 2


async def test_close_exports_what_open_attempts_left() -> None:
    sink = FakeSink()
    tracer = AttemptTracer(sink, flush_interval_s=3600, instrument_genai=False)
    await tracer.start()
    opened = tracer.attempt("ro-1", "at-1")
    await opened.__aenter__()
    _spans(["a", "b"])
    await tracer.close()
    assert [s.name for s in sink.spans] == ["a", "b"]
    await opened.__aexit__(None, None, None)
    with pytest.raises(RuntimeError):
        async with tracer.attempt("ro-2", "at-2"):
            pass


# -- back-pressure ---------------------------------------------------------------------------


async def test_a_full_buffer_blocks_a_thread_until_there_is_room() -> None:
    sink = FakeSink(gate=asyncio.Event())
    async with AttemptTracer(
        sink, max_buffered_spans=2, batch_size=1, flush_interval_s=0, instrument_genai=False
    ) as tracer:
        async with tracer.attempt("ro-1", "at-1") as attempt_trace:
            agent = asyncio.create_task(asyncio.to_thread(_spans, [f"s{i}" for i in range(5)]))
            await wait_until(lambda: tracer.stats().blocked >= 1)
            assert not agent.done() and tracer.stats().pending == 2
            assert sink.gate is not None
            sink.gate.set()
            await asyncio.wait_for(agent, TIMEOUT)
        stats = tracer.stats()
    assert [s.sequence_id for s in attempt_trace.spans] == [1, 2, 3, 4, 5]
    assert stats.overflow == 0 and attempt_trace.dropped == 0


async def test_a_thread_that_waits_too_long_drops_its_span_and_ids_stay_gap_free() -> None:
    gate = asyncio.Event()
    sink = FakeSink(gate=gate)
    async with AttemptTracer(
        sink, max_buffered_spans=2, batch_size=1, flush_interval_s=0, block_timeout_s=0.05, instrument_genai=False
    ) as tracer:
        async with tracer.attempt("ro-1", "at-1") as attempt_trace:
            await asyncio.wait_for(asyncio.to_thread(_spans, ["a", "b", "c", "d"]), TIMEOUT)
            gate.set()
            await asyncio.to_thread(_spans, ["e"])
        stats = tracer.stats()
    assert [(s.name, s.sequence_id) for s in attempt_trace.spans] == [("a", 1), ("b", 2), ("e", 3)]
    assert stats.overflow == 2 and attempt_trace.dropped == 2


async def test_the_loop_never_blocks_and_new_attempts_wait_for_room() -> None:
    gate = asyncio.Event()
    sink = FakeSink(gate=gate)
    async with AttemptTracer(
        sink, max_buffered_spans=2, batch_size=1, flush_interval_s=0, instrument_genai=False
    ) as tracer:
        entered = asyncio.Event()

        async def next_attempt() -> None:
            async with tracer.attempt("ro-2", "at-2"):
                entered.set()

        async with tracer.attempt("ro-1", "at-1") as attempt_trace:
            # On the loop thread: accepted up to twice the bound, without waiting; then dropped.
            _spans([f"s{i}" for i in range(5)])
            assert tracer.stats().pending == 4 and tracer.stats().overflow == 1
            waiting = asyncio.create_task(next_attempt())
            await wait_until(lambda: sink.calls >= 1)  # the exporter is stuck on the gate
            for _ in range(10):
                await asyncio.sleep(0)  # yield: let the new attempt run as far as it can
            assert not entered.is_set()
            gate.set()
            await asyncio.wait_for(entered.wait(), TIMEOUT)
        await asyncio.wait_for(waiting, TIMEOUT)
    assert [s.sequence_id for s in attempt_trace.spans] == [1, 2, 3, 4] and attempt_trace.dropped == 1


# -- export failures -------------------------------------------------------------------------


async def test_a_record_error_isolates_the_bad_span() -> None:
    sink = FakeSink()
    sink.fail = lambda spans: ValueError("too large") if any(s.name == "bad" for s in spans) else None
    async with AttemptTracer(sink, flush_interval_s=3600, instrument_genai=False) as tracer:
        async with tracer.attempt("ro-1", "at-1") as attempt_trace:
            _spans(["a", "b", "bad", "c", "d"])
        stats = tracer.stats()
    assert [s.name for s in attempt_trace.spans] == ["a", "b", "c", "d"]
    assert stats.export_failed == 1 and attempt_trace.dropped == 1 and attempt_trace.next_sequence_id == 6


async def test_a_transient_error_is_retried() -> None:
    sink = FakeSink()
    failures = [ConnectionError("broker away")]
    sink.fail = lambda spans: failures.pop() if failures else None
    async with AttemptTracer(sink, flush_interval_s=3600, instrument_genai=False) as tracer:
        async with tracer.attempt("ro-1", "at-1") as attempt_trace:
            _spans(["a", "b"])
        assert tracer.stats().export_failed == 0
    assert [s.name for s in attempt_trace.spans] == ["a", "b"] and sink.calls == 2


async def test_an_attempt_cannot_be_traced_twice_at_once() -> None:
    async with AttemptTracer(FakeSink(), instrument_genai=False) as tracer:
        async with tracer.attempt("ro-1", "at-1"):
            with pytest.raises(ValueError, match="already"):
                async with tracer.attempt("ro-1", "at-1"):
                    pass
        with pytest.raises(ValueError):
            async with tracer.attempt("ro-1", "at-1", first_sequence_id=0):
                pass
