"""A deterministic span history shaped like real agent traffic: for replay tests and benchmarks.

Each rollout is one attempt of an agent: a root ``agent.run`` span, ``calls`` LLM-call spans
shaped like the proxy's (prompt and response token ids, response id, logprobs), and a reward
span. Its rollout events are what the store client writes for ``start_rollout`` (enqueued with
its attempt), the spans' heartbeat (with their count) and the attempt's success, so the pure
fold rebuilds the same states the rollout processor would. Everything is a function of the
rollout's index: the same call writes the same history (ids, times and bytes).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from agl_stream.config import Settings
from agl_stream.kafka.io import make_producer
from agl_stream.models import (
    Attempt,
    AttemptHeartbeat,
    AttemptUpdated,
    Rollout,
    RolloutEnqueued,
    RolloutEvent,
)
from agl_stream.wire.codec import Codec
from agl_stream.wire.span_records import SPAN, span_dict_records

BASE_TIME = 1_767_225_600.0  # 2026-01-01T00:00:00Z
_TEXT = "plan the next step, call a tool, then answer with digits only. " * 40


def rollout_id_of(index: int) -> str:
    return f"ro-{index:012x}"


def attempt_id_of(index: int) -> str:
    return f"at-{index:012x}"


@dataclass(frozen=True)
class AttemptHistory:
    rollout_id: str
    events: list[RolloutEvent]
    spans: list[dict[str, Any]]  # the codec's dict form of agl.Span
    reward: float


def attempt_history(
    index: int,
    *,
    calls: int = 8,
    prompt_tokens: int = 64,
    response_tokens: int = 16,
    groups: int = 0,
    reward: float | None = None,
    vocab: int = 64,
) -> AttemptHistory:
    """The ``index``-th rollout's events and spans. ``groups`` > 0 puts rollouts into that many
    GRPO groups (``metadata["group_id"]``); the reward defaults to a seeded number in [0, 1);
    token ids are drawn from ``range(vocab)`` (a real tokenizer's ~150k make multi-byte varints)."""
    rng = random.Random(index)
    rollout_id, attempt_id = rollout_id_of(index), attempt_id_of(index)
    t0 = BASE_TIME + index * 0.05
    value = round(rng.random(), 6) if reward is None else reward
    trace_id = f"{index:032x}"
    root_id = f"{index:08x}{0:08x}"

    def span(
        seq: int, name: str, start: float, end: float, parent: str | None, attrs: dict[str, Any]
    ) -> dict[str, Any]:
        span_id = root_id if parent is None else f"{index:08x}{seq:08x}"
        return {
            "rollout_id": rollout_id,
            "attempt_id": attempt_id,
            "sequence_id": seq,
            "trace_id": trace_id,
            "span_id": span_id,
            "parent_id": parent,
            "name": name,
            "kind": "CLIENT" if name.startswith("openai.") else "INTERNAL",
            "status": {"status_code": "OK", "description": None},
            "attributes": attrs,
            "events": [],
            "links": [],
            "start_time": start,
            "end_time": end,
            "context": {"trace_id": trace_id, "span_id": span_id, "is_remote": False, "trace_state": {}},
            "parent": None,
            "resource": {
                "attributes": {
                    "service.name": "agl-replay-history",
                    "agentlightning.rollout_id": rollout_id,
                    "agentlightning.attempt_id": attempt_id,
                },
                "schema_url": "",
            },
            "scope_name": "agl-stream.history",
            "scope_version": "1",
        }

    spans: list[dict[str, Any]] = []
    for call in range(calls):
        seq = call + 1  # sequence ids are taken as spans end: children before their parent
        start = t0 + 0.001 + call * 0.004
        prompt = [rng.randrange(vocab) for _ in range(prompt_tokens)]
        response = [rng.randrange(vocab) for _ in range(response_tokens)]
        logprobs = [{"token": str(t), "logprob": -round(rng.random() * 4, 4)} for t in response]
        offset = rng.randrange(len(_TEXT) - 600)
        spans.append(
            span(
                seq,
                "openai.chat.completion",
                start,
                start + 0.003,
                root_id,
                {
                    "gen_ai.system": "openai",
                    "gen_ai.request.model": "agl-tiny",
                    "gen_ai.response.id": f"chatcmpl-{index}-{call}",
                    "gen_ai.prompt.0.role": "user",
                    "gen_ai.prompt.0.content": _TEXT[offset : offset + 600],
                    "gen_ai.usage.input_tokens": prompt_tokens,
                    "gen_ai.usage.output_tokens": response_tokens,
                    "prompt_token_ids": prompt,
                    "response_token_ids": response,
                    "logprobs.content": json.dumps(logprobs, separators=(",", ":")),
                },
            )
        )
    end = t0 + 0.002 + calls * 0.004
    spans.append(
        span(
            calls + 1,
            "agentlightning.annotation",
            end,
            end,
            root_id,
            {"agentlightning.reward.0.name": "primary", "agentlightning.reward.0.value": value},
        )
    )
    spans.append(span(calls + 2, "agent.run", t0, end + 0.001, None, {"agent.name": "solver"}))

    metadata = {"group_id": f"grp-{index % groups:06d}"} if groups > 0 else None
    rollout = Rollout(
        rollout_id=rollout_id, input={"task": index}, start_time=t0, mode="train", status="queuing", metadata=metadata
    )
    attempt = Attempt(rollout_id=rollout_id, attempt_id=attempt_id, sequence_id=1, start_time=t0)

    def event(n: int, time: float, payload: Any) -> RolloutEvent:
        return RolloutEvent(
            event_id=f"{index:08x}-0000-4000-8000-{n:012x}", rollout_id=rollout_id, time=time, writer="history",
            payload=payload,
        )  # fmt: skip

    events = [
        event(1, t0, RolloutEnqueued(rollout=rollout, attempt=attempt)),
        event(2, end, AttemptHeartbeat(attempt_id=attempt_id, span_count=len(spans), max_sequence_id=len(spans))),
        event(3, end + 0.002, AttemptUpdated.of(attempt_id, status="succeeded")),
    ]
    return AttemptHistory(rollout_id, events, spans, value)


def span_values(history: AttemptHistory, codec: Codec, batch: int | None) -> list[bytes]:
    """The history's agl.spans values: one agl.Span each (``batch`` None), or agl.SpanBatch
    records of up to ``batch`` spans, as a writer flushing every ``batch`` spans sends them."""
    if batch is None:
        return [codec.encode_dict(SPAN, span) for span in history.spans]
    return [
        value
        for start in range(0, len(history.spans), batch)
        for _, value in span_dict_records(history.spans[start : start + batch], codec)
    ]


async def write_history(settings: Settings, histories: list[AttemptHistory], *, batch: int | None = None) -> None:
    """Write the histories' events to ``agl.rollouts`` and spans to ``agl.spans`` (acknowledged);
    ``batch``: spans as agl.SpanBatch records of up to that many spans (see :func:`span_values`)."""
    codec = Codec.default()
    producer = make_producer(settings)
    await producer.start()
    try:
        futures = []
        for history in histories:
            key = history.rollout_id.encode()
            for ev in history.events:
                futures.append(await producer.send(settings.topic("rollouts"), codec.encode(ev), key=key))
            for value in span_values(history, codec, batch):
                futures.append(await producer.send(settings.topic("spans"), value, key=key))
            if len(futures) >= 5000:
                for future in futures:
                    await future
                futures = []
        for future in futures:
            await future
    finally:
        await producer.stop()
