"""The inference server over real HTTP (uvicorn on a free port), called with the openai client.

Answers are compared structurally (keys and JSON types) with the vLLM-shaped payloads in
tests/fixtures/vllm/, hand-written from vLLM's OpenAI server models (vLLM >= 0.10.2, where
``return_token_ids`` arrived). The checkpoint tests follow a real agl.resources topic.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam

from agl_stream.config import Settings
from agl_stream.ids import new_resources_id
from agl_stream.kafka import admin
from agl_stream.kafka.io import Outbox, make_producer
from agl_stream.models import ModelCheckpoint, ResourcesUpdate
from agl_stream.policy import build_model, build_tokenizer, generate, save_checkpoint
from agl_stream.topics import load_topic_specs
from consumers.inference import VERSION_HEADER, Engine, InferenceOptions, InferenceServer, Job, Policy, Sampling

FIXTURES = Path(__file__).parents[1] / "fixtures" / "vllm"
MODEL = "agl-tiny"
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is 2+2?"}]


def recorded(name: str) -> Any:
    return json.loads((FIXTURES / name).read_text())


# Objects whose keys are data (token -> logprob), not field names: compared as maps.
MAPS = {"$.choices[*].logprobs.top_logprobs[*]"}


def assert_shape(ours: Any, theirs: Any, path: str = "$", *, exact: bool = True) -> None:
    """``ours`` has ``theirs``' structure: the same keys (all of them, or at least them when not
    ``exact``) with the same JSON types; a null on their side allows anything."""
    if theirs is None:
        return
    if isinstance(theirs, dict) and re.sub(r"\[\d+\]", "[*]", path) in MAPS:
        assert isinstance(ours, dict) and ours, f"{path}: expected a non-empty map, got {ours!r}"
        for key, value in ours.items():
            assert isinstance(key, str)
            assert_shape(value, next(iter(theirs.values())), f"{path}[{key!r}]", exact=exact)
    elif isinstance(theirs, dict):
        assert isinstance(ours, dict), f"{path}: expected an object, got {ours!r}"
        missing = set(theirs) - set(ours)
        assert not missing, f"{path}: missing keys {sorted(missing)}"
        if exact:
            extra = set(ours) - set(theirs)
            assert not extra, f"{path}: keys vLLM does not send {sorted(extra)}"
        for key, value in theirs.items():
            assert_shape(ours[key], value, f"{path}.{key}", exact=exact)
    elif isinstance(theirs, list):
        assert isinstance(ours, list), f"{path}: expected an array, got {ours!r}"
        if theirs:
            for i, item in enumerate(ours):
                assert_shape(item, theirs[0], f"{path}[{i}]", exact=exact)
    elif isinstance(theirs, bool):
        assert isinstance(ours, bool), f"{path}: expected a boolean, got {ours!r}"
    elif isinstance(theirs, (int, float)):
        assert isinstance(ours, (int, float)) and not isinstance(ours, bool), f"{path}: expected a number, got {ours!r}"
        if isinstance(theirs, int):
            assert isinstance(ours, int), f"{path}: expected an integer, got {ours!r}"
    else:
        assert isinstance(ours, type(theirs)), f"{path}: expected {type(theirs).__name__}, got {ours!r}"


@asynccontextmanager
async def serving(settings: Settings | None = None, **options: Any) -> AsyncIterator[InferenceServer]:
    server = InferenceServer(settings, InferenceOptions(port=0, follow=settings is not None, **options))
    task = asyncio.create_task(server.run())
    ready = asyncio.create_task(server.wait_ready())
    try:
        await asyncio.wait({task, ready}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()  # start-up failed: raise its error
        assert ready.done(), "the inference server did not start"
        yield server
    finally:
        ready.cancel()
        server.stop()
        await asyncio.wait_for(task, 30)


def client_of(server: InferenceServer) -> AsyncOpenAI:
    assert server.url is not None
    return AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


@pytest.fixture
async def server() -> AsyncIterator[InferenceServer]:
    async with serving() as running:
        yield running


@pytest.fixture
async def client(server: InferenceServer) -> AsyncIterator[AsyncOpenAI]:
    async with client_of(server) as opened:
        yield opened


def chat_prompt(text: str) -> list[int]:
    tokenizer = build_tokenizer()
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer.encode(rendered, add_special_tokens=False))


# -- chat completions --------------------------------------------------------------------------


async def test_chat_completion_is_vllm_shaped_with_token_ids_and_logprobs(
    server: InferenceServer, client: AsyncOpenAI
) -> None:
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=12,
        seed=11,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_token_ids": True},
    )
    body = raw.http_response.json()
    assert_shape(body, recorded("chat_completion.json"))
    assert raw.headers[VERSION_HEADER] == "0"
    assert body["id"].startswith("chatcmpl-") and body["model"] == MODEL

    tokenizer = server.policy.tokenizer
    prompt_ids = chat_prompt("What is 2+2?")
    assert body["prompt_token_ids"] == prompt_ids
    [choice] = body["choices"]
    ids = choice["token_ids"]
    assert 1 <= len(ids) <= 12
    assert choice["message"]["content"] == tokenizer.decode(ids, skip_special_tokens=True)
    entries = choice["logprobs"]["content"]
    assert [e["token"] for e in entries] == [tokenizer.decode([t]) for t in ids]
    assert all(e["logprob"] <= 0 and len(e["top_logprobs"]) == 2 for e in entries)
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(ids),
        "total_tokens": len(prompt_ids) + len(ids),
        "prompt_tokens_details": None,
    }
    # The same sampling in-process: the server's seed is choice 0's seed.
    [local] = generate(server.policy.model, tokenizer, [prompt_ids], 12, 1.0, 1.0, seed=11)
    assert ids == local.response_token_ids
    assert [e["logprob"] for e in entries] == pytest.approx(local.logprobs, abs=1e-6)
    assert choice["finish_reason"] == local.finish_reason

    parsed = raw.parse()  # the openai client reads it as a ChatCompletion
    assert parsed.choices[0].message.content == choice["message"]["content"]


async def test_chat_without_return_token_ids_has_null_ids_and_is_seeded(client: AsyncOpenAI) -> None:
    async def ask(seed: int) -> Any:
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=MESSAGES,
            max_completion_tokens=10,
            n=3,
            seed=seed,
        )
        return raw.http_response.json()

    first, again, other = await ask(5), await ask(5), await ask(6)
    assert first["prompt_token_ids"] is None and all(c["token_ids"] is None for c in first["choices"])
    assert all(c["logprobs"] is None for c in first["choices"])
    assert [c["index"] for c in first["choices"]] == [0, 1, 2]
    texts = [c["message"]["content"] for c in first["choices"]]
    assert texts == [c["message"]["content"] for c in again["choices"]]
    assert texts != [c["message"]["content"] for c in other["choices"]]


async def test_chat_streaming_sends_vllm_chunks_and_matches_the_full_answer(
    server: InferenceServer, client: AsyncOpenAI
) -> None:
    assert server.url is not None
    request = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 10,
        "seed": 3,
        "logprobs": True,
        "return_token_ids": True,
    }
    full = (await httpx.AsyncClient().post(f"{server.url}/v1/chat/completions", json=request)).json()
    payloads: list[str] = []
    async with (
        httpx.AsyncClient() as http,
        http.stream(
            "POST",
            f"{server.url}/v1/chat/completions",
            json={**request, "stream": True, "stream_options": {"include_usage": True}},
        ) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers[VERSION_HEADER] == "0"
        text = (await response.aread()).decode()
    events = text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: ")
        payloads.append(event.removeprefix("data: "))
    chunks = [json.loads(p) for p in payloads]
    theirs = recorded("chat_completion_stream.json")
    assert_shape(chunks[0], theirs[0], exact=False)
    for chunk in chunks[1:-1]:
        assert_shape(chunk, theirs[1], exact=False)
    assert_shape(chunks[-1], theirs[-1], exact=False)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")

    assert chunks[0]["prompt_token_ids"] == full["prompt_token_ids"]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = chunks[1:-1]
    assert "".join(c["choices"][0]["delta"]["content"] for c in content) == full["choices"][0]["message"]["content"]
    assert [t for c in content for t in c["choices"][0]["token_ids"]] == full["choices"][0]["token_ids"]
    streamed_logprobs = [e for c in content for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed_logprobs == full["choices"][0]["logprobs"]["content"]
    assert [c["choices"][0]["finish_reason"] for c in content][-1] == full["choices"][0]["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]

    # And through the openai client's own SSE reader.
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=10,
        seed=3,
        stream=True,
    )
    pieces = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
    assert "".join(pieces) == full["choices"][0]["message"]["content"]


# -- completions -------------------------------------------------------------------------------


async def test_completion_is_vllm_shaped_for_text_and_token_prompts(
    server: InferenceServer, client: AsyncOpenAI
) -> None:
    tokenizer = server.policy.tokenizer
    raw = await client.completions.with_raw_response.create(
        model=MODEL, prompt="2+2=", max_tokens=6, n=2, seed=1, logprobs=2, extra_body={"return_token_ids": True}
    )
    body = raw.http_response.json()
    assert_shape(body, recorded("completion.json"))
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    prompt_ids = tokenizer.encode("2+2=", add_special_tokens=False)
    assert len(body["choices"]) == 2
    for choice in body["choices"]:
        assert choice["prompt_token_ids"] == prompt_ids
        assert choice["text"] == tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
        logprobs = choice["logprobs"]
        assert logprobs["tokens"] == [tokenizer.decode([t]) for t in choice["token_ids"]]
        assert len(logprobs["token_logprobs"]) == len(choice["token_ids"])
        for token, logprob, top in zip(
            logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True
        ):
            assert top[token] == logprob and len(top) in (2, 3)
        assert logprobs["text_offset"][0] == 0
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)  # once per distinct prompt, as in vLLM
    assert body["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in body["choices"])

    # Token-id prompts, several at once: choices are prompt-major, each with its own prompt ids.
    prompts = [prompt_ids, [5, 6, 7]]
    raw = await client.completions.with_raw_response.create(
        model=MODEL, prompt=prompts, max_tokens=4, n=2, temperature=0, extra_body={"return_token_ids": True}
    )
    body = raw.http_response.json()
    assert [c["prompt_token_ids"] for c in body["choices"]] == [prompts[0], prompts[0], prompts[1], prompts[1]]
    assert body["choices"][0]["token_ids"] == body["choices"][1]["token_ids"]  # greedy


async def test_completion_streaming_with_a_stop_string(server: InferenceServer, client: AsyncOpenAI) -> None:
    tokenizer = server.policy.tokenizer
    prompt = tokenizer.encode("abc", add_special_tokens=False)
    free = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    text = free.choices[0].text
    assert len(text) >= 4
    stop = text[2:4]
    expected = await client.completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=[stop], extra_body={"return_token_ids": True}
    )
    full = expected.http_response.json()["choices"][0]
    assert full["text"] == text[: text.index(stop)] and full["finish_reason"] == "stop" and full["stop_reason"] == stop

    stream = await client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        stop=[stop],
        stream=True,
        logprobs=0,
        extra_body={"return_token_ids": True},
    )
    chunks = [chunk.model_dump() async for chunk in stream]
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["text"]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == full["token_ids"]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == prompt
    assert all(c["choices"][0]["prompt_token_ids"] is None for c in chunks[1:])
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == sorted(offsets) and offsets[0] == 0


# -- errors, models, health ----------------------------------------------------------------------


async def test_bad_requests_get_openai_style_errors(server: InferenceServer, client: AsyncOpenAI) -> None:
    assert server.url is not None
    with pytest.raises(openai.NotFoundError) as not_found:
        await client.chat.completions.create(model="gpt-4", messages=MESSAGES)
    assert not_found.value.status_code == 404 and "gpt-4" in not_found.value.message
    with pytest.raises(openai.BadRequestError) as too_long:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5000)
    assert "maximum context length" in too_long.value.message

    bad_bodies: list[tuple[str, Any]] = [
        ("/v1/chat/completions", {"model": MODEL, "messages": []}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}),
        ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
        ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 3}),  # without logprobs
        ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}),
        ("/v1/chat/completions", {"messages": MESSAGES, "temperature": -1}),
        ("/v1/chat/completions", {"messages": MESSAGES, "n": 0}),
        ("/v1/chat/completions", {"messages": MESSAGES, "stop": [""]}),
        ("/v1/completions", {"model": MODEL, "prompt": [999]}),
        ("/v1/completions", {"model": MODEL, "prompt": []}),
        ("/v1/completions", {"model": MODEL, "prompt": ""}),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}),
        ("/v1/completions", {"model": MODEL, "prompt": [1, "a"]}),
        ("/v1/completions", {"model": MODEL}),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stop_token_ids": [-1]}),
        ("/v1/completions", ["not", "an", "object"]),
    ]
    async with httpx.AsyncClient(base_url=server.url) as http:
        for path, body in bad_bodies:
            response = await http.post(path, json=body)
            assert response.status_code == 400, (body, response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, body
            assert error["type"] == "BadRequestError" and error["code"] == 400 and error["message"]
        response = await http.post(
            "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert response.status_code == 400 and response.json()["error"]["type"] == "BadRequestError"


async def test_models_and_health_report_the_policy_version(server: InferenceServer, client: AsyncOpenAI) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_dump()["policy_version"] == 0
    assert server.url is not None
    async with httpx.AsyncClient() as http:
        health = (await http.get(f"{server.url}/health")).json()
    assert health["status"] == "ok" and health["policy_version"] == 0 and health["model"] == MODEL


async def test_the_server_can_start_from_a_checkpoint_directory(tmp_path: Path) -> None:
    tokenizer = build_tokenizer()
    save_checkpoint(build_model(seed=4), tokenizer, tmp_path / "v7")
    prompt = chat_prompt("hello")
    [expected] = generate(build_model(seed=4), tokenizer, [prompt], 8, 0.0, 1.0)
    async with serving(checkpoint=tmp_path / "v7", policy_version=7) as server, client_of(server) as client:
        ids, version = await greedy(client, prompt)
        assert (ids, version) == (expected.response_token_ids, "7")
        assert server.policy.source == str(tmp_path / "v7")


# -- the batcher ---------------------------------------------------------------------------------


async def test_engine_batches_jobs_that_sample_alike_without_changing_their_results() -> None:
    policy = Policy(build_model(seed=0), build_tokenizer(), 0, "test")
    engine = Engine(policy, max_batch_rows=8)
    alike = Sampling(max_new_tokens=8, temperature=1.0, top_p=1.0)
    other = Sampling(max_new_tokens=8, temperature=0.5, top_p=1.0)
    prompts = [chat_prompt("one"), chat_prompt("a second, longer one")]
    jobs = [
        engine.submit(Job([prompts[0]], [1], alike)),
        engine.submit(Job([prompts[1]] * 2, [2, 3], alike)),
        engine.submit(Job([prompts[0]], [4], other)),
    ]
    runner = asyncio.create_task(engine.run())
    try:
        results = [await asyncio.wait_for(job.done, 30) for job in jobs]
    finally:
        runner.cancel()
    assert engine.batches == 2  # the first two together, the other sampling alone
    for job, got in zip(jobs, results, strict=True):
        alone = generate(policy.model, policy.tokenizer, job.prompts, 8, job.sampling.temperature, 1.0, job.seeds)
        assert [g.response_token_ids for g in got] == [g.response_token_ids for g in alone]


async def test_concurrent_requests_get_the_answers_they_get_alone(client: AsyncOpenAI) -> None:
    async def ask(seed: int) -> list[int]:
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=8,
            seed=seed,
            extra_body={"return_token_ids": True},
        )
        return list(raw.http_response.json()["choices"][0]["token_ids"])

    together = await asyncio.gather(*(ask(seed) for seed in range(6)))
    alone = [await ask(seed) for seed in range(6)]
    assert together == alone


# -- checkpoints from agl.resources ---------------------------------------------------------------


async def publish(settings: Settings, *checkpoints: ModelCheckpoint) -> None:
    now = time.time()
    update = ResourcesUpdate(
        resources_id=new_resources_id(),
        create_time=now,
        update_time=now,
        version=1,
        resources={f"ckpt-{i}": c for i, c in enumerate(checkpoints)},
    )
    producer = make_producer(settings)
    await producer.start()
    try:
        await Outbox(settings, producer, "test").send(settings.topic("resources"), update, key=update.resources_id)
    finally:
        await producer.stop()


async def greedy(client: AsyncOpenAI, prompt: list[int]) -> tuple[list[int], str]:
    raw = await client.completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body={"return_token_ids": True}
    )
    return list(raw.http_response.json()["choices"][0]["token_ids"]), raw.headers[VERSION_HEADER]


@pytest.mark.integration
async def test_a_published_checkpoint_is_loaded_and_served(settings: Settings, tmp_path: Path) -> None:
    await admin.apply(settings, [s for s in load_topic_specs() if s.name == "resources"])
    tokenizer = build_tokenizer()
    trained = build_model(seed=1)  # stands in for the trainer's update
    save_checkpoint(trained, tokenizer, tmp_path / "v1")
    save_checkpoint(build_model(seed=3), tokenizer, tmp_path / "v3")
    prompt = chat_prompt("hello")
    [expected] = generate(trained, tokenizer, [prompt], 8, 0.0, 1.0)

    async with serving(settings) as server, client_of(server) as client:
        before, version = await greedy(client, prompt)
        assert version == "0"
        await publish(
            settings,
            ModelCheckpoint(uri=str(tmp_path / "v1"), model=MODEL, policy_version=1),
            ModelCheckpoint(uri=str(tmp_path / "v3"), model="another-model", policy_version=9),
        )
        await server.wait_for_version(1, timeout=30)
        assert server.url is not None
        async with httpx.AsyncClient(base_url=server.url) as http:
            assert (await http.get("/health")).json()["policy_version"] == 1
            assert (await http.get("/v1/models")).json()["data"][0]["policy_version"] == 1
        after, version = await greedy(client, prompt)
        assert version == "1"
        assert after == expected.response_token_ids != before

        # A checkpoint that cannot be loaded is skipped; a later one still is.
        await publish(settings, ModelCheckpoint(uri=str(tmp_path / "missing"), model=MODEL, policy_version=2))
        await publish(
            settings,
            ModelCheckpoint(uri=f"file://{tmp_path / 'v3'}", model=MODEL, policy_version=3),
            ModelCheckpoint(uri=str(tmp_path / "v1"), model=MODEL, policy_version=1),  # older: ignored
        )
        await server.wait_for_version(3, timeout=30)
        assert server.policy.version == 3 and server._failed == {2}

    # A restarted server starts from the newest checkpoint before its first request.
    async with serving(settings) as restarted, client_of(restarted) as client:
        assert restarted.policy.version == 3
        _, version = await greedy(client, prompt)
        assert version == "3"
