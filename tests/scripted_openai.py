"""A deterministic OpenAI-compatible chat server for tests: the test decides every answer.

Where the tiny policy cannot produce what an end-to-end test needs (tool calls, critiques,
edited prompts), the test starts this server and points the agent's ``LLM`` resource (or an
algorithm's critique/edit client) at its ``base_url``. Runner processes reach it over HTTP like
any hosted endpoint, so the run goes through the real pipeline; only the model is scripted.

Concurrency model: the server runs its own event loop in a daemon thread; ``requests`` is
appended from that thread and read by the test after the run (list appends are atomic).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from aiohttp import web

Reply = Callable[[dict[str, Any]], str | dict[str, Any]]
"""The request body -> the assistant's content (a string) or a whole message (``tool_calls``)."""

TokenIds = Callable[[dict[str, Any], dict[str, Any]], tuple[list[int], list[int]]]
"""The request body and the answer's message -> (prompt token ids, response token ids)."""


class ScriptedOpenAI:
    """Answers ``POST /v1/chat/completions`` with ``reply(body)``; records every request body.

    With ``token_ids``, answers also carry token ids the way vLLM returns them
    (``prompt_token_ids`` at the top, ``token_ids`` in the choice), so that calls through the
    LLM proxy become triplets a trainer can train on (ids valid for its policy's vocabulary).
    """

    def __init__(self, reply: Reply, token_ids: TokenIds | None = None) -> None:
        self.reply = reply
        self.token_ids = token_ids
        self.requests: list[dict[str, Any]] = []
        self.base_url = ""
        self._ids = itertools.count()

    def completion(self, body: dict[str, Any]) -> dict[str, Any]:
        self.requests.append(body)
        answer = self.reply(body)
        message = {"role": "assistant", **({"content": answer} if isinstance(answer, str) else answer)}
        prompt_tokens = sum(len(str(m.get("content") or "").split()) for m in body.get("messages", []))
        completion_tokens = len(str(message.get("content") or "").split()) + 1
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "finish_reason": "tool_calls" if message.get("tool_calls") else "stop",
        }
        extra: dict[str, Any] = {}
        if self.token_ids is not None:
            prompt_ids, response_ids = self.token_ids(body, message)
            choice["token_ids"] = response_ids
            extra["prompt_token_ids"] = prompt_ids
            prompt_tokens, completion_tokens = len(prompt_ids), len(response_ids)
        return {
            "id": f"chatcmpl-{next(self._ids)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "scripted"),
            "choices": [choice],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
            **extra,
        }


def tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """One OpenAI tool call, as a ``tool_calls`` entry of an assistant message."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


@contextmanager
def scripted_openai(reply: Reply, token_ids: TokenIds | None = None) -> Iterator[ScriptedOpenAI]:
    """Serve ``reply`` on 127.0.0.1 (a free port) for the ``with`` block; ``.base_url`` ends in ``/v1``."""
    server = ScriptedOpenAI(reply, token_ids)
    loop = asyncio.new_event_loop()
    started = threading.Event()
    runner_box: list[web.AppRunner] = []

    async def chat(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": {"message": "the body is not JSON"}}, status=400)
        return web.json_response(server.completion(body))

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "scripted", "object": "model"}]})

    async def start() -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_get("/v1/models", models)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        server.base_url = f"http://127.0.0.1:{port}/v1"
        runner_box.append(runner)
        started.set()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(start())
        loop.run_forever()

    thread = threading.Thread(target=serve, name="scripted-openai", daemon=True)
    thread.start()
    if not started.wait(timeout=30):
        raise RuntimeError("the scripted OpenAI server did not start within 30 s")
    try:
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(runner_box[0].cleanup(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()
