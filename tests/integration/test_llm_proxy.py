"""The LLM proxy against the real stack, a fake vLLM backend and the real openai client.

The backend answers in vLLM's shapes (>= 0.10.2: token ids with ``return_token_ids``, logprobs)
with ids unique per call, so each span can be matched to the exact call it records. The proxy
runs in this process on a free port and writes through its own store client: this test's
client's read fence does not cover its spans, so reads poll with a deadline (``spans_of``).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
import pytest
from aiohttp import web
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionMessageToolCallParam

from agl_stream import AglStore, connect
from agl_stream.config import Settings
from agl_stream.local.processes import role_environment
from agl_stream.models import ProxyLLM, Span
from agl_stream.ports import free_port
from agl_stream.wire import span_records
from agl_stream.wire.codec import Codec
from agl_stream.wire.semconv import POLICY_VERSION, POLICY_VERSION_HEADER
from producers.llm_proxy import LLMProxy, ProxyOptions, model_list_of, serving
from tests.integration.helpers import read_to_end

pytestmark = pytest.mark.integration

T = TypeVar("T")
MODELS = ("policy", "broken", "rejecting", "flaky", "slow")


# -- a fake vLLM ------------------------------------------------------------------------------


@dataclass
class FakeVLLM:
    """What the fake backend saw and answered, per call number."""

    url: str = ""
    requests: list[dict[str, Any]] = field(default_factory=list)
    counter: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when a client of the "slow" model went away mid-stream (vLLM then aborts the request)."""

    @staticmethod
    def prompt_ids(n: int) -> list[int]:
        return [1000 + n, 11, 12, 13]

    @staticmethod
    def response_ids(n: int) -> list[int]:
        return [2000 + n, 21]

    @staticmethod
    def logprobs(n: int) -> list[dict[str, Any]]:
        return [
            {"token": "hel", "logprob": -0.25 - n / 1000, "bytes": [104, 101, 108], "top_logprobs": []},
            {"token": "lo", "logprob": -0.5, "bytes": [108, 111], "top_logprobs": []},
        ]


def _error(status: int, message: str) -> web.Response:
    # vLLM >= 0.11 shape; the proxy also understands the older flat one (unit tests).
    body = {"error": {"message": message, "type": "BadRequestError", "param": None, "code": status}}
    return web.json_response(body, status=status)


def _sse(events: list[dict[str, Any]]) -> bytes:
    return b"".join(b"data: " + json.dumps(event).encode() + b"\n\n" for event in events) + b"data: [DONE]\n\n"


async def _chat(fake: FakeVLLM, request: web.Request) -> web.StreamResponse:
    body = await request.json()
    fake.requests.append(body)
    model = body["model"]
    if model == "broken":
        return _error(500, "CUDA out of memory")
    if model == "rejecting":
        return _error(400, "This model's maximum context length is 8 tokens")
    n = next(fake.counter)
    logprobs = fake.logprobs(n)
    if not body.get("stream"):
        return web.json_response(
            {
                "id": f"chatcmpl-{n}",
                "object": "chat.completion",
                "created": 1_767_225_600,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {
                            "role": "assistant",
                            "content": "hello",
                            "reasoning_content": None,
                            "tool_calls": [],
                        },
                        "logprobs": {"content": logprobs} if body.get("logprobs") else None,
                        "finish_reason": "stop",
                        "stop_reason": None,
                        "token_ids": fake.response_ids(n),
                    }
                ],
                "usage": {"prompt_tokens": 4, "total_tokens": 6, "completion_tokens": 2},
                "prompt_logprobs": None,
                "prompt_token_ids": fake.prompt_ids(n),
                "kv_transfer_params": None,
            },
            # As agl-stream's inference backend names the policy that answered (vLLM does not).
            headers={POLICY_VERSION_HEADER: str(40 + n)},
        )
    head = {"id": f"chatcmpl-{n}", "object": "chat.completion.chunk", "created": 1_767_225_600, "model": model}
    first, second = fake.response_ids(n)
    events = [
        {
            **head,
            "prompt_token_ids": fake.prompt_ids(n),
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}],
        },
        {
            **head,
            "choices": [
                {"index": 0, "delta": {"content": "hel"}, "logprobs": {"content": logprobs[:1]}, "token_ids": [first]}
            ],
        },
    ]
    if model == "slow":
        return await _slow_stream(fake, request, events)
    if model == "flaky":
        events.append({"error": {"message": "engine died mid-stream", "type": "InternalServerError", "code": 500}})
    else:
        events.append(
            {
                **head,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"content": "lo"},
                        "logprobs": {"content": logprobs[1:]},
                        "finish_reason": "stop",
                        "token_ids": [second],
                    }
                ],
            }
        )
    return web.Response(body=_sse(events), content_type="text/event-stream")


async def _slow_stream(fake: FakeVLLM, request: web.Request, events: list[dict[str, Any]]) -> web.StreamResponse:
    """The first tokens, then keep-alive comments until the client leaves (at most 30 s)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for event in events:
        await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
    try:
        for _ in range(300):
            await asyncio.sleep(0.1)  # a generating engine: time passes between tokens
            await response.write(b": still generating\n\n")
    except (ConnectionError, RuntimeError):
        fake.disconnected.set()
    return response


async def _completions(fake: FakeVLLM, request: web.Request) -> web.StreamResponse:
    body = await request.json()
    fake.requests.append(body)
    n = next(fake.counter)
    first, second = fake.response_ids(n)
    legacy: dict[str, Any] = {
        "tokens": ["hel", "lo"],
        "token_logprobs": [-0.25 - n / 1000, -0.5],
        "top_logprobs": [None, None],
    }
    if not body.get("stream"):
        return web.json_response(
            {
                "id": f"cmpl-{n}",
                "object": "text_completion",
                "created": 1_767_225_600,
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "text": "hello",
                        "logprobs": {**legacy, "text_offset": [0, 3]} if body.get("logprobs") is not None else None,
                        "finish_reason": "length",
                        "stop_reason": None,
                        "prompt_logprobs": None,
                        "prompt_token_ids": fake.prompt_ids(n),
                        "token_ids": [first, second],
                    }
                ],
                "usage": {"prompt_tokens": 4, "total_tokens": 6, "completion_tokens": 2},
            }
        )
    head = {"id": f"cmpl-{n}", "object": "text_completion", "created": 1_767_225_600, "model": body["model"]}
    events = [
        {
            **head,
            "choices": [
                {
                    "index": 0,
                    "text": "hel",
                    "logprobs": {
                        "tokens": ["hel"],
                        "token_logprobs": legacy["token_logprobs"][:1],
                        "top_logprobs": [None],
                    },
                    "finish_reason": None,
                    "prompt_token_ids": fake.prompt_ids(n),
                    "token_ids": [first],
                }
            ],
        },
        {
            **head,
            "choices": [
                {
                    "index": 0,
                    "text": "lo",
                    "logprobs": {"tokens": ["lo"], "token_logprobs": [-0.5], "top_logprobs": [None]},
                    "finish_reason": "length",
                    "token_ids": [second],
                }
            ],
        },
    ]
    return web.Response(body=_sse(events), content_type="text/event-stream")


@pytest.fixture
async def backend() -> AsyncIterator[FakeVLLM]:
    fake = FakeVLLM()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", functools.partial(_chat, fake))
    app.router.add_post("/v1/completions", functools.partial(_completions, fake))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    fake.url = f"http://127.0.0.1:{port}/v1"
    try:
        yield fake
    finally:
        await runner.cleanup()


# -- the proxy and the store ------------------------------------------------------------------


@pytest.fixture
async def store(stack_settings: Settings) -> AsyncIterator[AglStore]:
    async with connect(**stack_settings.model_dump(exclude_none=True)) as client:
        yield client


@pytest.fixture
async def proxy(stack_settings: Settings, backend: FakeVLLM) -> AsyncIterator[LLMProxy]:
    model_list = model_list_of([f"{model}={backend.url}" for model in MODELS])
    async with serving(stack_settings, model_list, ProxyOptions(port=0, sequence_block=16)) as running:
        yield running


def client_for(proxy: LLMProxy, rollout_id: str, attempt_id: str) -> openai.AsyncOpenAI:
    """The openai client an agent gets from a ProxyLLM resource (the runner's strip_proxy)."""
    assert proxy.url is not None
    resource = ProxyLLM(endpoint=f"{proxy.url}/v1", model="policy")
    return openai.AsyncOpenAI(base_url=resource.get_base_url(rollout_id, attempt_id), api_key="none", max_retries=0)


async def wait_until(
    probe: Callable[[], Awaitable[T]], done: Callable[[T], bool], *, what: str, timeout: float = 60.0
) -> T:
    """Poll ``probe`` until ``done`` holds: the proxy's writes are not under this client's fence."""
    deadline = time.monotonic() + timeout
    while True:
        value = await probe()
        if done(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout}s; last seen: {value!r}")
        await asyncio.sleep(0.05)


async def spans_of(store: AglStore, rollout_id: str, attempt_id: str, count: int) -> list[Span]:
    return await wait_until(
        lambda: store.query_spans(rollout_id, attempt_id),
        lambda spans: len(spans) >= count,
        what=f"{count} spans of {rollout_id}/{attempt_id} in ClickHouse",
    )


async def spans_in_kafka(settings: Settings, rollout_id: str) -> list[Span]:
    """The rollout's spans on agl.spans, up to the topic's end offsets as of this call."""
    codec = Codec.default()
    records = await read_to_end(settings, settings.topic("spans"))
    return [span for r in records if r.key == rollout_id.encode() for span in span_records.spans_of(codec, r.value)]


# -- tests ------------------------------------------------------------------------------------


async def test_every_call_is_one_span_with_the_backend_token_ids(
    store: AglStore, proxy: LLMProxy, backend: FakeVLLM, stack_settings: Settings
) -> None:
    started = await store.start_rollout({"proxy": "calls"})
    rid, aid = started.rollout_id, started.attempt.attempt_id
    client = client_for(proxy, rid, aid)
    call: ChatCompletionMessageToolCallParam = {
        "id": "call-1",
        "type": "function",
        "function": {"name": "greet", "arguments": "{}"},
    }
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "say hello"},
        {"role": "assistant", "content": None, "tool_calls": [call]},  # LiteLLM alone would drop the None
        {"role": "tool", "tool_call_id": "call-1", "content": "greeted"},
    ]
    reservations = proxy.blocks.reservations if proxy.blocks else 0

    chat = await client.chat.completions.create(model="policy", messages=messages, temperature=0.7)
    # The ordering rule: the span is in Kafka before the agent has its answer.
    assert [s.attributes["gen_ai.response.id"] for s in await spans_in_kafka(stack_settings, rid)] == [chat.id]
    assert chat.choices[0].message.content == "hello"
    assert chat.model_extra and chat.model_extra["prompt_token_ids"] == FakeVLLM.prompt_ids(1)  # passed through

    streamed = await client.chat.completions.create(model="policy", messages=messages, stream=True)
    pieces = [chunk.choices[0].delta.content or "" async for chunk in streamed if chunk.choices]
    assert "".join(pieces) == "hello"

    caller = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"  # the agent's span, W3C trace context
    text = await client.completions.create(
        model="policy", prompt="say hello", max_tokens=2, extra_headers={"traceparent": caller}
    )
    assert text.choices[0].text == "hello"

    text_stream = await client.completions.create(model="policy", prompt=[5, 6, 7], max_tokens=2, stream=True)
    assert "".join([chunk.choices[0].text async for chunk in text_stream if chunk.choices]) == "hello"

    # The backend was asked for token ids and logprobs every time, the agent's settings kept.
    assert all(r["return_token_ids"] is True for r in backend.requests)
    assert [r.get("logprobs") for r in backend.requests] == [True, True, 0, 0]
    assert backend.requests[0]["temperature"] == 0.7 and backend.requests[3]["prompt"] == [5, 6, 7]
    assert backend.requests[0]["messages"] == messages  # exactly what the agent sent

    spans = await spans_of(store, rid, aid, 4)
    assert len(spans) == 4
    first = spans[0].sequence_id
    assert [s.sequence_id for s in spans] == [first, first + 1, first + 2, first + 3]
    assert proxy.blocks is not None and proxy.blocks.reservations == reservations + 1  # one round trip
    assert [s.name for s in spans] == ["openai.chat.completion"] * 2 + ["openai.completion"] * 2
    assert [s.attributes["gen_ai.response.id"] for s in spans] == ["chatcmpl-1", "chatcmpl-2", "cmpl-3", "cmpl-4"]
    for n, span in enumerate(spans, start=1):
        assert span.kind == "CLIENT" and span.status.status_code == "OK"
        assert span.attributes["prompt_token_ids"] == FakeVLLM.prompt_ids(n)
        assert span.attributes["response_token_ids"] == FakeVLLM.response_ids(n)
        content = json.loads(str(span.attributes["logprobs.content"]))
        assert [item["token"] for item in content] == ["hel", "lo"]
        assert [item["logprob"] for item in content] == [-0.25 - n / 1000, -0.5]
        assert span.attributes["gen_ai.request.model"] == "policy"
        assert span.attributes["gen_ai.response.model"] == "policy"
        assert span.attributes["gen_ai.usage.input_tokens"] == 4
        assert span.attributes["gen_ai.usage.output_tokens"] == 2
        assert span.attributes["agentlightning.rollout_id"] == rid
        assert span.start_time is not None and span.end_time is not None and span.start_time <= span.end_time
        assert len(span.trace_id) == 32 and len(span.span_id) == 16
    # A call with a traceparent is a child of the caller's span; the others start traces of their own.
    assert (spans[2].trace_id, spans[2].parent_id) == ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331")
    assert [s.parent_id for s in spans] == [None, None, "b7ad6b7169203331", None]
    # Messages as the GenAI conventions shape them: typed parts, tool calls with parsed arguments.
    assert json.loads(str(spans[0].attributes["gen_ai.input.messages"])) == [
        {"role": "user", "parts": [{"type": "text", "content": "say hello"}]},
        {"role": "assistant", "parts": [{"type": "tool_call", "id": "call-1", "name": "greet", "arguments": {}}]},
        {"role": "tool", "parts": [{"type": "tool_call_response", "id": "call-1", "response": "greeted"}]},
    ]
    assert json.loads(str(spans[1].attributes["gen_ai.output.messages"])) == [
        {"role": "assistant", "parts": [{"type": "text", "content": "hello"}], "finish_reason": "stop"}
    ]
    assert json.loads(str(spans[2].attributes["gen_ai.input.messages"])) == [
        {"role": "user", "parts": [{"type": "text", "content": "say hello"}]}
    ]
    assert all(s.attributes["gen_ai.provider.name"] == "openai" for s in spans)
    assert spans[0].attributes["gen_ai.request.temperature"] == 0.7
    assert [s.attributes["llm.is_streaming"] for s in spans] == [False, True, False, True]
    assert [s.attributes.get(POLICY_VERSION) for s in spans] == [41, None, None, None]
    # The spans are heartbeats of the attempt, as the runner's are.
    attempt = await wait_until(
        lambda: store.get_latest_attempt(rid),
        lambda latest: latest is not None and latest.status == "running",
        what="the attempt running after its proxy spans",
    )
    assert attempt is not None


async def test_backend_errors_reach_the_agent_in_openai_shape_and_as_error_spans(
    store: AglStore, proxy: LLMProxy
) -> None:
    started = await store.start_rollout({"proxy": "errors"})
    rid, aid = started.rollout_id, started.attempt.attempt_id
    client = client_for(proxy, rid, aid)
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]

    with pytest.raises(openai.InternalServerError) as server_error:
        await client.chat.completions.create(model="broken", messages=messages)
    assert server_error.value.status_code == 500
    assert server_error.value.body == {
        "message": "CUDA out of memory",
        "type": "api_error",
        "param": None,
        "code": 500,
    }
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        await client.chat.completions.create(model="rejecting", messages=messages, stream=True)
    with pytest.raises(openai.NotFoundError, match="not served by this proxy"):
        await client.chat.completions.create(model="gpt-unknown", messages=messages)
    stream = await client.chat.completions.create(model="flaky", messages=messages, stream=True)
    with pytest.raises(openai.APIError, match="engine died mid-stream"):
        async for _ in stream:
            pass

    spans = await spans_of(store, rid, aid, 4)
    assert [s.status.status_code for s in spans] == ["ERROR"] * 4
    assert [s.status.description for s in spans] == [
        "CUDA out of memory",
        "This model's maximum context length is 8 tokens",
        "the model 'gpt-unknown' is not served by this proxy; it serves broken, flaky, policy, rejecting, slow",
        "engine died mid-stream",
    ]
    assert [s.attributes["http.response.status_code"] for s in spans] == [500, 400, 404, 500]
    # What the flaky stream produced before it failed is kept.
    assert spans[3].attributes["response_token_ids"] == [FakeVLLM.response_ids(1)[0]]


async def test_a_client_leaving_mid_stream_stops_the_backend_and_is_recorded(
    store: AglStore, proxy: LLMProxy, backend: FakeVLLM
) -> None:
    started = await store.start_rollout({"proxy": "disconnect"})
    rid, aid = started.rollout_id, started.attempt.attempt_id
    client = client_for(proxy, rid, aid)
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "write a long story"}]
    stream = await client.chat.completions.create(model="slow", messages=messages, stream=True)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    await stream.close()
    await asyncio.wait_for(backend.disconnected.wait(), timeout=30)  # the proxy let go of the backend

    [span] = await spans_of(store, rid, aid, 1)
    assert span.status.status_code == "ERROR"
    assert span.status.description == "the client closed the stream before it ended"
    assert span.attributes["prompt_token_ids"] == FakeVLLM.prompt_ids(1)
    assert span.attributes["response_token_ids"] == FakeVLLM.response_ids(1)[:1]


async def test_unknown_attempts_and_plain_v1_calls_are_answered_not_recorded(proxy: LLMProxy) -> None:
    before = proxy.stats.unknown_attempts
    client = client_for(proxy, "ro-00000000dead", "at-0000dead")
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
    for _ in range(2):
        answer = await client.chat.completions.create(model="policy", messages=messages)
        assert answer.choices[0].message.content == "hello"
    assert proxy.stats.unknown_attempts == before + 2

    assert proxy.url is not None
    plain = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="none", max_retries=0)
    before = proxy.stats.unattributed
    answer = await plain.chat.completions.create(model="policy", messages=messages)
    assert answer.choices[0].message.content == "hello"
    assert proxy.stats.unattributed == before + 1
    assert [m.id async for m in plain.models.list()] == ["broken", "flaky", "policy", "rejecting", "slow"]
    async with httpx.AsyncClient() as http:
        health = (await http.get(f"{proxy.url}/health")).json()
    assert health["status"] == "ok" and health["stats"]["unknown_attempts"] == proxy.stats.unknown_attempts


def start_proxy_process(
    settings: Settings, backend_url: str, port: int, *, workers: int, log_path: Path
) -> subprocess.Popen[bytes]:
    """The proxy in processes of its own, as `agl-stream llm-proxy --workers N` runs it."""
    code = (
        "from agl_stream.config import load_settings\n"
        "from producers.llm_proxy import ProxyOptions, main, model_list_of\n"
        f"options = ProxyOptions(port={port}, workers={workers})\n"
        f"main(load_settings(), model_list_of(['policy={backend_url}']), options)\n"
    )
    env = role_environment(settings)
    with log_path.open("wb") as log_file:
        return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=log_file, stderr=subprocess.STDOUT)


async def test_workers_share_one_port_and_take_disjoint_sequence_ids(
    store: AglStore, backend: FakeVLLM, stack_settings: Settings, tmp_path: Path
) -> None:
    port = free_port()
    log_path = tmp_path / "llm-proxy.log"
    process = start_proxy_process(stack_settings, backend.url, port, workers=2, log_path=log_path)
    url = f"http://127.0.0.1:{port}"
    try:
        started = await store.start_rollout({"proxy": "workers"})
        rid, aid = started.rollout_id, started.attempt.attempt_id

        async def health() -> int | None:
            assert process.poll() is None, log_path.read_text()[-3000:]
            try:
                async with httpx.AsyncClient() as http:
                    return (await http.get(f"{url}/health")).status_code
            except httpx.TransportError:
                return None

        await wait_until(health, lambda status: status == 200, what="the proxy's workers up", timeout=120)
        ids = set()
        for _ in range(12):  # a new connection per call, so the kernel spreads them over the workers
            async with openai.AsyncOpenAI(
                base_url=f"{url}/rollout/{rid}/attempt/{aid}/v1", api_key="none", max_retries=0
            ) as client:
                answer = await client.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": "hi"}]
                )
                ids.add(answer.id)
        spans = await spans_of(store, rid, aid, 12)
        assert {s.attributes["gen_ai.response.id"] for s in spans} == ids and len(ids) == 12
        assert len({s.sequence_id for s in spans}) == 12
    finally:
        process.terminate()
        assert process.wait(timeout=60) == 0, log_path.read_text()[-3000:]
