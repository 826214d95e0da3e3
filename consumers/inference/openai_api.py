"""The OpenAI-compatible API as vLLM serves it: request shapes and their checks, OpenAI-style
errors, and the answer (or server-sent event) built from a generation."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from transformers import PreTrainedTokenizerFast

from agl_stream.http_serving import MalformedBodyError, parse_json
from agl_stream.logs import get_logger
from agl_stream.policy import Generation, StepToken
from agl_stream.wire.semconv import POLICY_VERSION_HEADER
from consumers.inference.engine import Job, Policy, Sampling

log = get_logger("agl.inference")

MAX_LOGPROBS = 20  # vLLM's default max_logprobs
VERSION_HEADER = POLICY_VERSION_HEADER


# -- requests ----------------------------------------------------------------------------------


class ApiError(Exception):
    """An error answered to the client in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError", 500: "InternalServerError"}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = _ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # like vLLM: unknown fields are ignored


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingRequest(_Body):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=64)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    return_token_ids: bool = False

    def stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops):
            raise ApiError(400, "stop strings must not be empty", param="stop")
        return tuple(stops)


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    max_completion_tokens: int | None = Field(None, ge=1)
    add_generation_prompt: bool = True


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[list[int]] | list[str]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None


def parse(model: type[BaseModel], body: Any) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ApiError(400, f"{where}: {first['msg']}" if where else first["msg"], param=where or None) from None


async def json_body(request: Request) -> Any:
    try:
        return parse_json(await request.body())
    except MalformedBodyError as error:
        raise ApiError(400, str(error)) from None


def _message_text(message: ChatMessage, index: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    texts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise ApiError(400, f"only text content parts are supported, got {part.type!r}", param=f"messages.{index}")
        texts.append(part.text)
    return "".join(texts)


# -- request handling -------------------------------------------------------------------------


@dataclass
class Prepared:
    """A validated request: the prompts (one per choice) and how to sample them."""

    prompts: list[list[int]]  # distinct prompts
    n: int
    sampling: Sampling
    seed: int | None
    policy: Policy

    def job(self, on_step: Callable[[list[StepToken]], None] | None = None) -> Job:
        rows = [p for p in self.prompts for _ in range(self.n)]
        seeds = [None if self.seed is None else self.seed + i for i in range(len(rows))]
        return Job(rows, seeds, self.sampling, on_step)


def chat_prompt(policy: Policy, request: ChatRequest) -> list[int]:
    messages = [{"role": m.role, "content": _message_text(m, i)} for i, m in enumerate(request.messages)]
    try:
        text = policy.tokenizer.apply_chat_template(
            messages, add_generation_prompt=request.add_generation_prompt, tokenize=False
        )
    except Exception as error:  # a template that rejects the conversation is the request's fault
        raise ApiError(400, f"the chat template rejected the messages: {error}", param="messages") from None
    assert isinstance(text, str)
    return list(policy.tokenizer.encode(text, add_special_tokens=False))


def completion_prompts(policy: Policy, request: CompletionRequest) -> list[list[int]]:
    prompt = request.prompt
    if isinstance(prompt, str):
        return [list(policy.tokenizer.encode(prompt, add_special_tokens=False))]
    if not prompt:
        raise ApiError(400, "the prompt is empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return [
        list(policy.tokenizer.encode(p, add_special_tokens=False)) if isinstance(p, str) else list(p)  # type: ignore[arg-type]
        for p in prompt
    ]


def _token_text(tokenizer: PreTrainedTokenizerFast, token_id: int) -> str:
    return str(tokenizer.decode([token_id]))


def _finite(logprob: float) -> float:
    return max(logprob, -9999.0)  # vLLM's floor: JSON has no -Infinity


def _chat_logprob(tokenizer: PreTrainedTokenizerFast, token_id: int, logprob: float) -> dict[str, Any]:
    token = _token_text(tokenizer, token_id)
    return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode("utf-8"))}


def chat_logprobs(
    tokenizer: PreTrainedTokenizerFast,
    ids: Sequence[int],
    logprobs: Sequence[float],
    tops: Sequence[list[tuple[int, float]]],
    k: int,
) -> dict[str, Any]:
    content = []
    for token_id, logprob, top in zip(ids, logprobs, tops, strict=True):
        entry = _chat_logprob(tokenizer, token_id, logprob)
        entry["top_logprobs"] = [_chat_logprob(tokenizer, t, v) for t, v in top[:k]]
        content.append(entry)
    return {"content": content}


def completion_logprobs(
    tokenizer: PreTrainedTokenizerFast,
    ids: Sequence[int],
    logprobs: Sequence[float],
    tops: Sequence[list[tuple[int, float]]],
    k: int,
    offset: int,
) -> dict[str, Any]:
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    special = set(tokenizer.all_special_ids)
    for token_id, logprob, top in zip(ids, logprobs, tops, strict=True):
        token = _token_text(tokenizer, token_id)
        tokens.append(token)
        token_logprobs.append(_finite(logprob))
        # vLLM's completions list the sampled token among the top ones even when it is not.
        ranked = {_token_text(tokenizer, t): _finite(v) for t, v in top[:k]}
        ranked.setdefault(token, _finite(logprob))
        top_logprobs.append(ranked)
        text_offset.append(offset)
        if token_id not in special:
            offset += len(token)
    return {
        "text_offset": text_offset,
        "token_logprobs": token_logprobs,
        "tokens": tokens,
        "top_logprobs": top_logprobs,
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
    }


def chat_response(
    request: ChatRequest, prepared: Prepared, policy: Policy, results: list[Generation], name: str
) -> dict[str, Any]:
    choices = []
    for index, gen in enumerate(results):
        logprobs = None
        if request.logprobs:
            k = request.top_logprobs or 0
            logprobs = chat_logprobs(policy.tokenizer, gen.response_token_ids, gen.logprobs, gen.top_logprobs, k)
        choices.append(
            {
                "index": index,
                "message": {
                    "role": "assistant",
                    "content": gen.text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "tool_calls": [],
                    "reasoning_content": None,
                },
                "logprobs": logprobs,
                "finish_reason": gen.finish_reason,
                "stop_reason": gen.stop_reason,
                "token_ids": gen.response_token_ids if request.return_token_ids else None,
            }
        )
    prompt = prepared.prompts[0]
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": name,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage(len(prompt), sum(len(g.response_token_ids) for g in results)),
        "prompt_logprobs": None,
        "prompt_token_ids": prompt if request.return_token_ids else None,
        "kv_transfer_params": None,
    }


def completion_response(
    request: CompletionRequest, prepared: Prepared, policy: Policy, results: list[Generation], name: str
) -> dict[str, Any]:
    choices = []
    for index, gen in enumerate(results):
        logprobs = None
        if request.logprobs is not None:
            logprobs = completion_logprobs(
                policy.tokenizer, gen.response_token_ids, gen.logprobs, gen.top_logprobs, request.logprobs, 0
            )
        choices.append(
            {
                "index": index,
                "text": gen.text,
                "logprobs": logprobs,
                "finish_reason": gen.finish_reason,
                "stop_reason": gen.stop_reason,
                "prompt_logprobs": None,
                "prompt_token_ids": gen.prompt_token_ids if request.return_token_ids else None,
                "token_ids": gen.response_token_ids if request.return_token_ids else None,
            }
        )
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": name,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
        # Like vLLM: each distinct prompt counts once, whatever n is.
        "usage": usage(sum(len(p) for p in prepared.prompts), sum(len(g.response_token_ids) for g in results)),
        "kv_transfer_params": None,
    }


def held_back(text: str, stop: Sequence[str]) -> int:
    """How many trailing characters of ``text`` could still begin a stop string."""
    longest = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest


@dataclass
class ChoiceStream:
    emitted: int = 0  # characters of text sent so far
    started: bool = False  # the first chunk (prompt_token_ids for completions) went out


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"
