"""AttemptTracer against the real stack: spans reach agl.spans and ClickHouse, numbered, with GenAI spans."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import openai
import pytest
from aiohttp import web
from opentelemetry import trace

from agl_stream import AglStore, connect
from agl_stream.agent.tracing import ATTEMPT_ID_KEY, ROLLOUT_ID_KEY, SEQUENCE_ID_KEY, AttemptTracer
from agl_stream.config import Settings

pytestmark = pytest.mark.integration

TIMEOUT = 120.0  # generous: two cores, maybe shared with a benchmark
tracer_api = trace.get_tracer("tests.tracing.kafka")


@pytest.fixture
async def store(stack_settings: Settings) -> AsyncIterator[AglStore]:
    async with connect(**stack_settings.model_dump(exclude_none=True)) as client:
        yield client


async def _eventually(probe: Callable[[], Awaitable[bool]], timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not await probe():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met before the deadline")
        await asyncio.sleep(0.05)


async def test_nested_spans_of_an_attempt_reach_the_store_numbered(store: AglStore) -> None:
    started = await store.start_rollout({"q": "trace me"})
    rid, aid = started.rollout_id, started.attempt.attempt_id

    def sync_step() -> None:
        with tracer_api.start_as_current_span("thread-step") as span:
            span.set_attribute("reward", 0.5)

    async with AttemptTracer(store, batch_size=4, flush_interval_s=0.05, instrument_genai=False) as tracer:
        async with tracer.attempt(rid, aid) as attempt_trace:
            with tracer_api.start_as_current_span("agent"):
                for index in range(5):
                    with tracer_api.start_as_current_span("llm") as llm:
                        llm.set_attribute("index", index)
                        with tracer_api.start_as_current_span("tool"):
                            pass
                await asyncio.to_thread(sync_step)
        assert tracer.stats().exported == 12 and attempt_trace.dropped == 0

    spans = await store.query_spans(rid, aid)
    assert [s.sequence_id for s in spans] == list(range(1, 13))
    assert [s.model_dump() for s in spans] == [s.model_dump() for s in attempt_trace.spans]
    by_id = {s.span_id: s for s in spans}
    agent = next(s for s in spans if s.name == "agent")
    assert agent.sequence_id == 12 and agent.parent_id is None  # the outermost span ends last
    for span in spans:
        assert span.attributes[ROLLOUT_ID_KEY] == rid and span.attributes[ATTEMPT_ID_KEY] == aid
        assert span.attributes[SEQUENCE_ID_KEY] == span.sequence_id
        if span.name == "tool":
            assert by_id[span.parent_id].name == "llm"  # type: ignore[index]
        elif span.name != "agent":
            assert span.parent_id == agent.span_id
    assert next(s for s in spans if s.name == "thread-step").attributes["reward"] == 0.5

    async def running() -> bool:
        latest = await store.get_latest_attempt(rid)
        return latest is not None and latest.attempt_id == aid and latest.status == "running"

    # The heartbeats are written without waiting for the fold: the state follows shortly.
    await _eventually(running)


_COMPLETION: dict[str, Any] = {
    "id": "chatcmpl-agl-fake-1",
    "object": "chat.completion",
    "created": 1_700_000_000,
    "model": "fake-model",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "4"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8},
}


TRACEPARENTS: list[str | None] = []  # what the fake server was sent, per call


@pytest.fixture
async def fake_openai() -> AsyncIterator[str]:
    """A minimal OpenAI-compatible server on a free local port; yields its base URL."""
    TRACEPARENTS.clear()

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        TRACEPARENTS.append(request.headers.get("traceparent"))
        return web.json_response({**_COMPLETION, "model": body["model"]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        await runner.cleanup()


async def test_openai_calls_make_gen_ai_spans(store: AglStore, fake_openai: str) -> None:
    started = await store.start_rollout({"q": "2+2"})
    rid, aid = started.rollout_id, started.attempt.attempt_id
    client = openai.AsyncOpenAI(base_url=fake_openai, api_key="not-a-key", max_retries=0)
    try:
        async with AttemptTracer(store, instrument_genai=True) as tracer:
            assert tracer.genai_instrumented
            async with tracer.attempt(rid, aid) as attempt_trace:
                with tracer_api.start_as_current_span("agent"):
                    reply = await client.chat.completions.create(
                        model="fake-model-7", messages=[{"role": "user", "content": "2+2?"}]
                    )
            assert reply.choices[0].message.content == "4"
    finally:
        await client.close()

    spans = await store.query_spans(rid, aid)
    assert [s.sequence_id for s in spans] == [1, 2] == [s.sequence_id for s in attempt_trace.spans]
    llm, agent = spans
    assert agent.name == "agent" and llm.parent_id == agent.span_id
    # The request carried the client span's context, so a proxy's span of it is the client span's child.
    # (version 00, then the trace flags: sampled, plus the SDK's random-trace-id flag if it sets it)
    [sent] = TRACEPARENTS
    assert sent is not None and sent.startswith(f"00-{llm.trace_id}-{llm.span_id}-")
    assert int(sent.rsplit("-", 1)[1], 16) & 0x01  # sampled
    assert llm.attributes["gen_ai.request.model"] == "fake-model-7"
    assert llm.attributes["gen_ai.response.model"] == "fake-model-7"
    assert llm.attributes["gen_ai.response.id"] == "chatcmpl-agl-fake-1"
    assert llm.attributes["gen_ai.usage.input_tokens"] == 7 and llm.attributes["gen_ai.usage.output_tokens"] == 1
    assert llm.attributes[SEQUENCE_ID_KEY] == 1 and llm.attributes[ATTEMPT_ID_KEY] == aid
