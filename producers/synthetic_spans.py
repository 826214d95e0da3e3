"""Synthetic spans shaped like an agent's LLM calls: for the smoke demo, tests and benchmarks."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

from aiokafka import TopicPartition

from agl_stream.config import Settings
from agl_stream.kafka.io import make_producer
from agl_stream.wire.codec import Codec
from agl_stream.wire.span_records import SPAN, span_dict_records

_WORDS = ("plan", "search", "tool", "answer", "digit", "reward", "think", "call", "agent", "step")
# Prompt text is cut from one long deterministic string: generating text per span would cost
# more than everything the benchmarks measure.
_TEXT = " ".join(random.Random(7).choice(_WORDS) for _ in range(20_000))


def rollout_id_of(i: int) -> str:
    return f"ro-{i:012x}"


def synthetic_span(index: int, *, rollouts: int = 100, text_bytes: int = 1200, seed: int = 0) -> dict[str, Any]:
    """The ``index``-th span of a deterministic stream spread over ``rollouts`` rollouts.

    As the codec's fast path takes it (a dict in the agl.Span Avro shape). About 1.5 KB encoded
    with the default ``text_bytes``, within the 1-5 KB of real LLM-call spans.
    """
    rng = random.Random(seed * 1_000_003 + index)
    rollout = index % rollouts
    sequence = index // rollouts + 1
    start = 1_767_225_600.0 + index * 0.01
    begin = rng.randrange(0, len(_TEXT) - text_bytes) if text_bytes < len(_TEXT) else 0
    prompt = _TEXT[begin : begin + text_bytes]
    span_id = f"{rng.getrandbits(64):016x}"
    return {
        "rollout_id": rollout_id_of(rollout),
        "attempt_id": f"at-{rollout:08x}",
        "sequence_id": sequence,
        "trace_id": f"{rollout:032x}",
        "span_id": span_id,
        "parent_id": None,
        "name": "openai.chat.completion" if index % 3 else "agentlightning.annotation",
        "kind": "CLIENT",
        "status": {"status_code": "OK", "description": None},
        "attributes": {
            "gen_ai.system": "openai",
            "gen_ai.request.model": "tiny-policy",
            "gen_ai.response.id": f"chatcmpl-{index}",
            "gen_ai.usage.input_tokens": rng.randint(20, 400),
            "gen_ai.usage.output_tokens": rng.randint(1, 64),
            "gen_ai.request.temperature": 1.0,
            "gen_ai.prompt.0.content": prompt,
            "agentlightning.reward.0.name": "primary",
            "agentlightning.reward.0.value": rng.random(),
            "stream": False,
            "prompt_token_ids": [rng.randint(0, 63) for _ in range(16)],
        },
        "events": [],
        "links": [],
        "start_time": start,
        "end_time": start + rng.uniform(0.001, 0.5),
        "context": {"trace_id": f"{rollout:032x}", "span_id": span_id, "is_remote": False, "trace_state": {}},
        "parent": None,
        "resource": {
            "attributes": {
                "service.name": "agl-demo-agent",
                "agentlightning.rollout_id": rollout_id_of(rollout),
                "agentlightning.attempt_id": f"at-{rollout:08x}",
                "agentlightning.span_sequence_id": sequence,
            },
            "schema_url": "",
        },
        "scope_name": "agl-stream.synthetic",
        "scope_version": "1",
    }


def synthetic_records(
    start_index: int, count: int, *, rollouts: int = 100, per_record: int = 1, text_bytes: int = 1200
) -> Iterator[tuple[bytes, bytes]]:
    """(key, value) of the agl.spans records of spans ``start_index`` onwards: single agl.Span
    records (``per_record`` 1), else agl.SpanBatch records of up to ``per_record`` spans of one
    attempt, as a writer that flushes every ``per_record`` spans of each of ``rollouts``
    attempts sends them."""
    codec = Codec.default()
    end = start_index + count
    if per_record == 1:
        for i in range(start_index, end):
            span = synthetic_span(i, rollouts=rollouts, text_bytes=text_bytes)
            yield span["rollout_id"].encode(), codec.encode_dict(SPAN, span)
        return
    step = per_record * rollouts  # the next `per_record` spans of every rollout
    for chunk in range(start_index, end, step):
        indices = range(chunk, min(chunk + step, end))
        spans = [synthetic_span(i, rollouts=rollouts, text_bytes=text_bytes) for i in indices]
        for key, value in span_dict_records(spans, codec):
            yield key.encode(), value


async def produce_spans(
    settings: Settings,
    count: int,
    *,
    rollouts: int = 100,
    start_index: int = 0,
    per_record: int = 1,
    on_progress: Callable[[int], None] | None = None,
) -> dict[TopicPartition, int]:
    """Produce ``count`` synthetic spans keyed by rollout id, ``per_record`` at most in a record
    (see :func:`synthetic_records`); return the end offset written per partition.
    ``on_progress`` gets the number of records acknowledged."""
    topic = settings.topic("spans")
    producer = make_producer(settings)
    await producer.start()
    ends: dict[TopicPartition, int] = {}
    try:
        futures = []
        for key, value in synthetic_records(start_index, count, rollouts=rollouts, per_record=per_record):
            futures.append(await producer.send(topic, value, key=key))
            if len(futures) >= 2000:
                _collect(await _gather(futures), ends, on_progress)
                futures = []
        _collect(await _gather(futures), ends, on_progress)
    finally:
        await producer.stop()
    return ends


async def _gather(futures: list[Any]) -> list[Any]:
    return [await f for f in futures]


def _collect(metadata: list[Any], ends: dict[TopicPartition, int], on_progress: Callable[[int], None] | None) -> None:
    for md in metadata:
        tp = TopicPartition(md.topic, md.partition)
        ends[tp] = max(ends.get(tp, 0), md.offset + 1)
    if on_progress is not None and metadata:
        on_progress(len(metadata))
