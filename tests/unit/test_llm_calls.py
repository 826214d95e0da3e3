"""LLM calls as spans (agl_stream.domain.llm_calls) and the proxy's I/O-free helpers (producers.llm_proxy).

Backend payloads are vLLM's shapes (>= 0.10.2, ``return_token_ids``) in tests/fixtures/vllm_proxy.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from agl_stream.domain.llm_calls import (
    CHAT,
    COMPLETION,
    CallError,
    LLMCall,
    TraceParent,
    backend_error,
    backend_request,
    build_span,
    error_of_status,
    merge_chunks,
    parse_sse,
    policy_version_of_header,
    slim,
    trace_parent,
)
from agl_stream.domain.llm_calls.backend import logprobs_content, token_ids
from agl_stream.domain.llm_calls.messages import input_messages, messages_json, output_messages
from agl_stream.domain.llm_calls.spans import new_span_id, new_trace_id, span_attributes
from agl_stream.models import Span
from agl_stream.wire.codec import Codec
from agl_stream.wire.semconv import POLICY_VERSION
from producers.llm_proxy import CALL_HEADER, CaptureTransport, SequenceBlocks, backend_url, model_list_of

FIXTURES = Path(__file__).parent.parent / "fixtures" / "vllm_proxy"
PROMPT_IDS = [151644, 872, 198, 17, 10, 17, 28, 30, 151645, 198, 151644, 77091]


def fixture(name: str) -> Any:
    return json.loads((FIXTURES / name).read_text())


def sse(chunks: list[dict[str, Any]]) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


# -- requests ---------------------------------------------------------------------------------


def test_the_backend_is_always_asked_for_token_ids_and_logprobs() -> None:
    body = {"model": "m", "messages": [], "temperature": 0.2, "top_k": 5}
    sent = backend_request(CHAT, body)
    assert sent == {**body, "return_token_ids": True, "logprobs": True}
    assert "return_token_ids" not in body  # the agent's body is not changed
    assert backend_request(COMPLETION, {"model": "m", "prompt": "x"})["logprobs"] == 0  # the sampled token only


def test_the_agents_own_logprobs_setting_wins() -> None:
    assert backend_request(CHAT, {"logprobs": True, "top_logprobs": 3}) == {
        "logprobs": True,
        "top_logprobs": 3,
        "return_token_ids": True,
    }
    assert backend_request(CHAT, {"logprobs": False})["logprobs"] is False
    assert backend_request(COMPLETION, {"logprobs": 2})["logprobs"] == 2
    assert "logprobs" not in backend_request(CHAT, {}, logprobs=False)


# -- extraction -------------------------------------------------------------------------------


def test_chat_token_ids_and_logprobs() -> None:
    response = fixture("chat.json")
    assert token_ids(CHAT, response) == (PROMPT_IDS, [19, 151645])
    content = logprobs_content(CHAT, response)
    assert content is not None and [c["token"] for c in content] == ["4", "<|im_end|>"]
    assert content[0]["top_logprobs"] == [{"token": "4", "logprob": -0.0123, "bytes": [52]}]


def test_text_completion_token_ids_and_legacy_logprobs_become_the_chat_shape() -> None:
    response = fixture("completion.json")
    assert token_ids(COMPLETION, response) == ([17, 10, 17, 28], [220, 19])
    assert logprobs_content(COMPLETION, response) == [
        {
            "token": " ",
            "logprob": -0.25,
            "bytes": None,
            "top_logprobs": [
                {"token": " ", "logprob": -0.25, "bytes": None},
                {"token": "4", "logprob": -1.6, "bytes": None},
            ],
        },
        {
            "token": "4",
            "logprob": -0.0123,
            "bytes": None,
            "top_logprobs": [
                {"token": "4", "logprob": -0.0123, "bytes": None},
                {"token": "5", "logprob": -4.9, "bytes": None},
            ],
        },
    ]


def test_missing_or_malformed_token_ids_are_none_never_wrong() -> None:
    assert token_ids(CHAT, {"choices": []}) == (None, None)
    assert token_ids(CHAT, {"prompt_token_ids": [1, True], "choices": [{"index": 0, "token_ids": "12"}]}) == (
        None,
        None,
    )
    assert logprobs_content(CHAT, {"choices": [{"index": 0, "logprobs": None}]}) is None


def test_the_first_choice_is_the_one_with_index_zero() -> None:
    response = {"choices": [{"index": 1, "token_ids": [9]}, {"index": 0, "token_ids": [8]}], "prompt_token_ids": [1]}
    assert token_ids(CHAT, response) == ([1], [8])


# -- streams ----------------------------------------------------------------------------------


def test_sse_framing() -> None:
    text = (
        ": keep-alive comment\r\n"
        'data: {"a": 1}\r\n\r\n'
        "event: message\n"
        'data: {"b":\n'
        "data: 2}\n\n"
        "data: not json\n\n"
        "data: [1, 2]\n\n"
        'data:{"c": 3}\n\n'
        "data: [DONE]\n\n"
        'data: {"after": "done"}\n\n'
    )
    assert parse_sse(text.encode()) == [{"a": 1}, {"b": 2}, {"c": 3}]
    assert parse_sse('data: {"unterminated": true}') == [{"unterminated": True}]
    assert parse_sse(b"") == []


def test_a_merged_chat_stream_gives_what_the_unstreamed_call_gives() -> None:
    merged = merge_chunks(CHAT, parse_sse(sse(fixture("chat_stream.json"))))
    assert merged["id"] == "chatcmpl-1b2c3d4e5f60718293a4b5c6d7e8f901"
    assert merged["model"] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert token_ids(CHAT, merged) == (PROMPT_IDS, [19, 151645])
    content = logprobs_content(CHAT, merged)
    assert content is not None and [(c["token"], c["logprob"]) for c in content] == [
        ("4", -0.0123),
        ("<|im_end|>", -0.0009),
    ]
    assert merged["choices"][0]["message"] == {"role": "assistant", "content": "4"}
    assert merged["choices"][0]["finish_reason"] == "stop"
    assert merged["usage"]["completion_tokens"] == 2


def test_a_merged_tool_call_stream_joins_arguments_and_reasoning() -> None:
    merged = merge_chunks(CHAT, fixture("chat_tools_stream.json"))
    [choice] = merged["choices"]
    assert choice["message"] == {
        "role": "assistant",
        "content": None,
        "reasoning_content": "need a tool",
        "tool_calls": [
            {"id": "chatcmpl-tool-1", "type": "function", "function": {"name": "calc", "arguments": '{"expr": "2+2"}'}}
        ],
    }
    assert choice["finish_reason"] == "tool_calls"
    assert token_ids(CHAT, merged) == (
        [151644, 8948, 198],
        [1184, 264, 5392, 151657, 5617, 4913, 9413, 17, 10, 17, 151658],
    )
    assert logprobs_content(CHAT, merged) is None


def test_a_merged_text_stream_keeps_the_first_prompt_ids_and_all_logprobs() -> None:
    merged = merge_chunks(COMPLETION, fixture("completion_stream.json"))
    assert token_ids(COMPLETION, merged) == ([17, 10, 17, 28], [220, 19])
    assert merged["choices"][0]["text"] == " 4"
    content = logprobs_content(COMPLETION, merged)
    assert content is not None and [(c["token"], c["logprob"]) for c in content] == [(" ", -0.25), ("4", -0.0123)]
    assert merged["usage"] == {"prompt_tokens": 4, "total_tokens": 6, "completion_tokens": 2}


def test_merging_several_choices_and_an_error_chunk() -> None:
    chunks: list[dict[str, Any]] = [
        {"id": "c", "choices": [{"index": 1, "delta": {"content": "b"}, "token_ids": [2]}]},
        {"id": "c", "choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": [1]}]},
        {"error": {"message": "engine died", "code": 500}},
    ]
    merged = merge_chunks(CHAT, chunks)
    assert [c["message"]["content"] for c in merged["choices"]] == ["a", "b"]
    assert token_ids(CHAT, merged) == (None, [1])
    assert merged["error"] == {"message": "engine died", "code": 500}


# -- spans ------------------------------------------------------------------------------------


def chat_call(**changes: Any) -> LLMCall:
    request = {
        "model": "policy",
        "messages": [{"role": "user", "content": "2+2="}],
        "temperature": 0.7,
        "max_tokens": 16,
        "top_k": 20,
        "tools": [{"type": "function", "function": {"name": "calc"}}],
    }
    call = LLMCall(CHAT, request, start_time=100.0, end_time=100.5, response=fixture("chat.json"))
    call.backend = "http://10.0.0.1:8000/v1"
    for name, value in changes.items():
        setattr(call, name, value)
    return call


def test_a_chat_call_span_carries_what_training_and_sql_read() -> None:
    span = build_span(chat_call(), rollout_id="ro-1", attempt_id="at-1", sequence_id=7)
    assert span.name == "openai.chat.completion" and span.kind == "CLIENT"
    assert (span.rollout_id, span.attempt_id, span.sequence_id) == ("ro-1", "at-1", 7)
    assert (span.start_time, span.end_time) == (100.0, 100.5)
    assert span.status.status_code == "OK"
    assert span.scope_name == "agl_stream.llm_proxy"
    attributes = dict(span.attributes)
    content = json.loads(str(attributes.pop("logprobs.content")))
    assert content == fixture("chat.json")["choices"][0]["logprobs"]["content"]
    # Messages as OpenTelemetry's GenAI conventions write them: typed parts, finish reasons.
    assert json.loads(str(attributes.pop("gen_ai.input.messages"))) == [
        {"role": "user", "parts": [{"type": "text", "content": "2+2="}]}
    ]
    assert json.loads(str(attributes.pop("gen_ai.output.messages"))) == [
        {"role": "assistant", "parts": [{"type": "text", "content": "4"}], "finish_reason": "stop"}
    ]
    assert json.loads(str(attributes.pop("gen_ai.tool.definitions"))) == [
        {"type": "function", "function": {"name": "calc"}}
    ]
    assert attributes == {
        "gen_ai.provider.name": "openai",
        "gen_ai.system": "openai",
        "gen_ai.operation.name": "chat",
        "llm.is_streaming": False,
        "gen_ai.request.model": "policy",
        "gen_ai.request.temperature": 0.7,
        "gen_ai.request.max_tokens": 16,
        "gen_ai.request.top_k": 20,
        "gen_ai.openai.api_base": "http://10.0.0.1:8000/v1",
        "gen_ai.response.model": "Qwen/Qwen2.5-0.5B-Instruct",
        "gen_ai.response.id": "chatcmpl-8d2f4c1e9b7a4e56a1c3d5e7f9b1a2c4",
        "gen_ai.response.finish_reasons": ["stop"],
        "gen_ai.usage.input_tokens": 12,
        "gen_ai.usage.output_tokens": 2,
        "prompt_token_ids": PROMPT_IDS,
        "response_token_ids": [19, 151645],
        "agentlightning.rollout_id": "ro-1",
        "agentlightning.attempt_id": "at-1",
        "agentlightning.span_sequence_id": 7,
    }
    # It is a valid wire record, and stays one through Avro.
    codec = Codec.default()
    assert codec.decode(codec.encode(span), Span) == span


def test_a_text_completion_span() -> None:
    request = {"model": "policy", "prompt": [17, 10, 17, 28], "max_tokens": 2}
    call = LLMCall(COMPLETION, request, 1.0, 2.0, response=fixture("completion.json"), stream=True)
    attributes = span_attributes(call)
    assert attributes["gen_ai.operation.name"] == "text_completion"
    assert attributes["llm.is_streaming"] is True
    assert json.loads(str(attributes["gen_ai.input.messages"])) == [
        {"role": "user", "parts": [{"type": "prompt", "value": [17, 10, 17, 28]}]}
    ]
    assert json.loads(str(attributes["gen_ai.output.messages"])) == [
        {"role": "assistant", "parts": [{"type": "text", "content": " 4"}], "finish_reason": "length"}
    ]
    assert attributes["prompt_token_ids"] == [17, 10, 17, 28]
    assert build_span(call, rollout_id="r", attempt_id="a", sequence_id=1).name == "openai.completion"


def test_usage_falls_back_to_the_token_id_counts() -> None:
    response = {"id": "x", "prompt_token_ids": [1, 2, 3], "choices": [{"index": 0, "token_ids": [4], "message": {}}]}
    attributes = span_attributes(LLMCall(CHAT, {"model": "m", "messages": []}, 0.0, 1.0, response=response))
    assert (attributes["gen_ai.usage.input_tokens"], attributes["gen_ai.usage.output_tokens"]) == (3, 1)
    assert "logprobs.content" not in attributes


def test_an_error_span() -> None:
    error = CallError(500, "CUDA out of memory", "api_error", 500)
    call = LLMCall(CHAT, {"model": "m", "messages": []}, 0.0, 1.0, error=error)
    parent = TraceParent("a" * 32, "c" * 16)
    span = build_span(call, rollout_id="r", attempt_id="a", sequence_id=3, parent=parent, span_id="b" * 16)
    assert span.status.status_code == "ERROR" and span.status.description == "CUDA out of memory"
    assert span.attributes["error.type"] == "api_error"
    assert span.attributes["http.response.status_code"] == 500
    assert (span.trace_id, span.span_id, span.parent_id) == ("a" * 32, "b" * 16, "c" * 16)
    assert "prompt_token_ids" not in span.attributes


def test_non_numbers_and_non_finite_request_values_are_not_attributes() -> None:
    request = {"model": "m", "messages": [], "temperature": float("nan"), "top_p": True, "seed": 2**64, "n": "3"}
    attributes = span_attributes(LLMCall(CHAT, request, 0.0, 1.0))
    assert not [key for key in attributes if key.startswith("gen_ai.request.") and key != "gen_ai.request.model"]


def test_ids_are_random_hex_of_the_otel_widths() -> None:
    trace_ids = {new_trace_id() for _ in range(100)}
    assert len(trace_ids) == 100 and all(len(t) == 32 and int(t, 16) for t in trace_ids)
    assert all(len(s) == 16 and int(s, 16) for s in (new_span_id() for _ in range(100)))


def test_slim_drops_the_text_but_keeps_the_token_ids() -> None:
    span = build_span(chat_call(), rollout_id="r", attempt_id="a", sequence_id=1)
    small = slim(span)
    assert "gen_ai.input.messages" not in small.attributes and "gen_ai.output.messages" not in small.attributes
    assert small.attributes["prompt_token_ids"] == PROMPT_IDS and small.attributes["agl.truncated"] is True
    assert "gen_ai.input.messages" in span.attributes  # a copy


# -- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (404, "not_found_error"),
        (422, "invalid_request_error"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (502, "api_error"),
        (503, "api_error"),
    ],
)
def test_error_types_follow_openai(status: int, kind: str) -> None:
    error = error_of_status(status, "boom", code="c", param="p")
    assert error.body() == {"error": {"message": "boom", "type": kind, "param": "p", "code": "c"}}


def test_backend_errors_keep_the_backends_words() -> None:
    openai_shape = b'{"error": {"message": "too long", "type": "BadRequestError", "param": "messages", "code": 400}}'
    assert backend_error(400, openai_shape, "fallback") == CallError(
        400, "too long", "invalid_request_error", 400, "messages"
    )
    vllm_flat = {"object": "error", "message": "no such model", "type": "NotFoundError", "param": None, "code": 404}
    assert backend_error(404, vllm_flat, "fallback") == CallError(404, "no such model", "not_found_error", 404)
    snake = {"error": {"message": "slow down", "type": "rate_limit_exceeded"}}
    assert backend_error(429, snake, "fallback").type == "rate_limit_exceeded"
    assert backend_error(422, '{"detail": [{"loc": ["body"], "msg": "bad"}]}', "x").message == (
        '[{"loc": ["body"], "msg": "bad"}]'
    )
    assert backend_error(502, b"Bad Gateway", "fallback").message == "Bad Gateway"
    assert backend_error(500, b"", "the client's text").message == "the client's text"
    assert backend_error(500, {"error": "plain"}, "x").message == "plain"


# -- the proxy's helpers ----------------------------------------------------------------------


def test_backends_from_model_url_pairs() -> None:
    model_list = model_list_of(["policy=http://a:8000", "policy=http://b:8000/v1/", "judge=https://c/v1"])
    assert [(m["model_name"], m["litellm_params"]["api_base"]) for m in model_list] == [
        ("policy", "http://a:8000/v1"),
        ("policy", "http://b:8000/v1"),
        ("judge", "https://c/v1"),
    ]
    assert {m["litellm_params"]["model"] for m in model_list} == {"openai/policy", "openai/judge"}
    with pytest.raises(ValueError, match="MODEL=URL"):
        model_list_of(["http://a:8000"])
    with pytest.raises(ValueError, match="http://"):
        backend_url("a:8000")


class FakeReservations:
    def __init__(self, unknown: set[str] | None = None) -> None:
        self.next = 1
        self.calls: list[tuple[str, str, int]] = []
        self.unknown = unknown or set()
        self.fail = False
        self.gate = asyncio.Event()
        self.gate.set()

    async def reserve(self, rollout_id: str, attempt_id: str, count: int) -> int:
        self.calls.append((rollout_id, attempt_id, count))
        await self.gate.wait()
        if self.fail:
            raise TimeoutError("no answer from the rollout processor")
        if attempt_id in self.unknown:
            raise ValueError(f"unknown attempt {attempt_id}")
        first, self.next = self.next, self.next + count
        return first


async def test_sequence_ids_come_from_one_block_until_it_runs_out() -> None:
    store = FakeReservations()
    blocks = SequenceBlocks(store.reserve, block=3)
    ids = [await blocks.next_id("r", "a") for _ in range(7)]
    assert ids == [1, 2, 3, 4, 5, 6, 7]
    assert store.calls == [("r", "a", 3)] * 3
    assert await blocks.next_id("r", "b") == 10  # another attempt, its own block


async def test_concurrent_first_calls_reserve_once() -> None:
    store = FakeReservations()
    store.gate.clear()
    blocks = SequenceBlocks(store.reserve, block=10)
    waiting = [asyncio.create_task(blocks.next_id("r", "a")) for _ in range(5)]
    await asyncio.sleep(0)
    store.gate.set()
    ids = [i for i in await asyncio.gather(*waiting) if i is not None]  # None: an unknown attempt
    assert sorted(ids) == [1, 2, 3, 4, 5]
    assert len(store.calls) == 1 and blocks.reservations == 1


async def test_unknown_attempts_are_remembered_and_store_errors_are_not() -> None:
    store = FakeReservations(unknown={"gone"})
    blocks = SequenceBlocks(store.reserve, block=4)
    assert await blocks.next_id("r", "gone") is None
    assert await blocks.next_id("r", "gone") is None
    assert len(store.calls) == 1
    store.fail = True
    with pytest.raises(TimeoutError):
        await blocks.next_id("r", "a")
    store.fail = False
    assert await blocks.next_id("r", "a") == 1


async def test_the_least_recently_used_attempts_are_forgotten() -> None:
    store = FakeReservations()
    blocks = SequenceBlocks(store.reserve, block=100, capacity=2)
    await blocks.next_id("r", "a")
    await blocks.next_id("r", "b")
    await blocks.next_id("r", "a")  # a is now the most recent
    await blocks.next_id("r", "c")  # evicts b
    assert len(blocks) == 2
    assert await blocks.next_id("r", "a") == 3
    assert await blocks.next_id("r", "b") == 301  # a fresh block; b's old one is left unused


async def test_the_capture_transport_copies_only_marked_responses() -> None:
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, stream=httpx.ByteStream(b"data: {}\n\n" * 3))

    transport = CaptureTransport(httpx.MockTransport(answer))
    async with httpx.AsyncClient(transport=transport) as client:
        with transport.capturing() as (call_id, capture):
            for _ in range(2):  # a retry replaces what the first try captured
                async with client.stream(
                    "POST", "http://backend/v1/chat/completions", headers={CALL_HEADER: call_id}
                ) as r:
                    assert await r.aread() == b"data: {}\n\n" * 3
            assert capture.status == 200 and capture.url == "http://backend/v1/chat/completions"
            assert bytes(capture.body) == b"data: {}\n\n" * 3
            assert seen[-1].headers["Accept-Encoding"] == "identity"
        assert transport.captures == {}
        await client.post("http://backend/v1/chat/completions", headers={CALL_HEADER: "not-registered"})
        assert seen[-1].headers["Accept-Encoding"] != "identity"


def test_the_policy_version_a_backend_names_is_on_the_span() -> None:
    assert [policy_version_of_header(v) for v in ("7", " 12 ", None, "v3", "")] == [7, 12, None, None, None]
    call = LLMCall(CHAT, {"model": "m", "messages": []}, 1.0, 2.0, response={"id": "x"}, policy_version=7)
    assert span_attributes(call)[POLICY_VERSION] == 7
    unversioned = LLMCall(CHAT, {"model": "m", "messages": []}, 1.0, 2.0, response={"id": "x"})
    assert POLICY_VERSION not in span_attributes(unversioned)


def test_a_calls_traceparent_makes_its_span_a_child_of_the_callers() -> None:
    header = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert trace_parent({"traceparent": header}) == TraceParent("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331")
    # None, malformed or all-zero contexts are no parent: the call's span starts a trace of its own.
    for headers in ({}, {"traceparent": "garbage"}, {"traceparent": "00-" + "0" * 32 + "-b7ad6b7169203331-01"}):
        assert trace_parent(headers) is None
        span = build_span(chat_call(), rollout_id="r", attempt_id="a", sequence_id=1, parent=trace_parent(headers))
        assert span.parent_id is None and len(span.trace_id) == 32


def test_tool_turns_reasoning_and_multimodal_parts_in_the_genai_message_shape() -> None:
    request = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": "u"}},
                ],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "look", "arguments": '{"x": 1}'}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "a cat"},
        ]
    }
    assert json.loads(messages_json(input_messages(CHAT, request))) == [
        {"role": "system", "parts": [{"type": "text", "content": "be brief"}]},
        {
            "role": "user",
            "parts": [
                {"type": "text", "content": "what is this?"},
                {"type": "image_url", "value": {"type": "image_url", "image_url": {"url": "u"}}},
            ],
        },
        {"role": "assistant", "parts": [{"type": "tool_call", "id": "c1", "name": "look", "arguments": {"x": 1}}]},
        {"role": "tool", "parts": [{"type": "tool_call_response", "id": "c1", "response": "a cat"}]},
    ]
    response = {
        "choices": [
            {
                "finish_reason": "tool_calls",
                "message": {
                    "role": "assistant",
                    "reasoning_content": "I should look",
                    "content": "",
                    "tool_calls": [{"id": "c2", "function": {"name": "look", "arguments": "not json"}}],
                },
            }
        ]
    }
    [answer] = json.loads(messages_json(output_messages(CHAT, response)))
    assert answer == {
        "role": "assistant",
        "finish_reason": "tool_calls",
        "parts": [
            {"type": "reasoning", "content": "I should look"},
            {"type": "text", "content": ""},
            {"type": "tool_call", "id": "c2", "name": "look", "arguments": "not json"},
        ],
    }
