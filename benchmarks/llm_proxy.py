"""The LLM proxy's latency overhead: the same calls straight to a backend and through the proxy.

A fake vLLM backend (its own process; a canned chat answer in vLLM's shape: 64 prompt and 16
response token ids, logprobs) answers at once, so what is measured is the proxy: the HTTP hop,
LiteLLM, building the span and waiting for the broker's acknowledgement before answering. The
proxy runs in its own process on the local stack (broker, rollout processor, gateway); this
script is the agent, one call at a time over a keep-alive connection.

Reported, in ms: direct p50/p99; through the proxy on an attempt's URL (recorded) for the
first call of an attempt (pays the sequence-id reservation, one processor round trip) and for
later calls; through the proxy's plain /v1 (unrecorded: LiteLLM and the hop without the span);
streamed chat (time to [DONE]) direct and recorded. ``overhead_p50_ms`` is recorded p50 minus
direct p50 (the goal: <= 5 ms).

Run: `python benchmarks/llm_proxy.py --calls 1000` (starts a broker on free ports in a temporary
folder unless AGL_KAFKA_BOOTSTRAP is set; stops everything it started). JSON results go to
benchmarks/results/llm_proxy.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
from _measure import cpu_seconds  # type: ignore[import-not-found]

from agl_stream import connect
from agl_stream.config import Settings
from agl_stream.local import stack
from agl_stream.local.processes import role_environment
from agl_stream.ports import free_ports

MODEL = "bench-policy"
MESSAGES = [
    {"role": "system", "content": "You are a careful assistant. " * 4},
    {"role": "user", "content": "What is 17 * 23? Think step by step."},
]


def _chat_answer() -> bytes:
    logprobs = [{"token": f"t{i}", "logprob": -0.01 * i, "bytes": [116], "top_logprobs": []} for i in range(16)]
    return json.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": 1_767_225_600,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "17 * 23 = 391. " * 3, "tool_calls": []},
                    "logprobs": {"content": logprobs},
                    "finish_reason": "stop",
                    "stop_reason": None,
                    "token_ids": list(range(5000, 5016)),
                }
            ],
            "usage": {"prompt_tokens": 64, "total_tokens": 80, "completion_tokens": 16},
            "prompt_logprobs": None,
            "prompt_token_ids": list(range(1000, 1064)),
        }
    ).encode()


def _chat_stream() -> bytes:
    head = {"id": "chatcmpl-bench-s", "object": "chat.completion.chunk", "created": 1_767_225_600, "model": MODEL}
    events: list[dict[str, Any]] = [
        {
            **head,
            "prompt_token_ids": list(range(1000, 1064)),
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}],
        }
    ]
    for i in range(16):
        choice = {
            "index": 0,
            "delta": {"content": f"w{i} "},
            "logprobs": {"content": [{"token": f"w{i}", "logprob": -0.01 * i, "bytes": [119], "top_logprobs": []}]},
            "finish_reason": "stop" if i == 15 else None,
            "token_ids": [5000 + i],
        }
        events.append({**head, "choices": [choice]})
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def serve_backend(port: int) -> None:
    """The fake vLLM: canned answers, no work (run as ``--role backend``)."""
    from aiohttp import web

    answer, stream = _chat_answer(), _chat_stream()

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("stream"):
            return web.Response(body=stream, content_type="text/event-stream")
        return web.Response(body=answer, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def serve_proxy(backend: str, port: int) -> None:
    """The proxy as ``agl-stream llm-proxy`` runs it (run as ``--role proxy``; settings from AGL_*)."""
    from agl_stream.config import load_settings
    from agl_stream.logs import configure_logging
    from producers.llm_proxy import ProxyOptions, main, model_list_of

    configure_logging("WARNING")
    main(load_settings(), model_list_of([f"{MODEL}={backend}"]), ProxyOptions(port=port))


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)

    return {"p50_ms": at(0.5), "p99_ms": at(0.99), "n": len(ordered)}


async def _wait_http(url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as client:
        while True:
            try:
                await client.get(url)
                return
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{url} did not answer within {timeout}s") from None
                await asyncio.sleep(0.1)  # a child process starting up: nothing to wait on but its port


async def measure(
    settings: Settings, backend_url: str, proxy_url: str, proxy_pid: int, calls: int, attempts: int
) -> dict[str, Any]:
    await _wait_http(backend_url)
    await _wait_http(f"{proxy_url}/health")
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 16}
    stream_body = {**body, "stream": True}
    async with connect(**settings.model_dump(exclude_none=True)) as store:
        started = [await store.start_rollout({"bench": i}) for i in range(attempts)]
    urls = [f"{proxy_url}/rollout/{r.rollout_id}/attempt/{r.attempt.attempt_id}/v1" for r in started]
    limits = httpx.Limits(max_keepalive_connections=4)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:

        async def timed(url: str, payload: dict[str, Any]) -> float:
            begin = time.perf_counter()
            if payload.get("stream"):
                async with client.stream("POST", f"{url}/chat/completions", json=payload) as response:
                    assert response.status_code == 200, await response.aread()
                    async for _ in response.aiter_bytes():
                        pass
            else:
                response = await client.post(f"{url}/chat/completions", json=payload)
                assert response.status_code == 200, response.text
            return time.perf_counter() - begin

        samples: dict[str, list[float]] = {
            name: [] for name in ("direct", "first_call", "recorded", "unrecorded", "stream_direct", "stream_recorded")
        }
        for _ in range(20):  # warm up connections, LiteLLM's client cache, the producer
            await timed(backend_url, body)
            await timed(f"{proxy_url}/v1", body)
        for url in urls:
            samples["first_call"].append(await timed(url, body))
        rounds: list[tuple[str, Callable[[int], Awaitable[float]]]] = [
            ("direct", lambda i: timed(backend_url, body)),
            ("recorded", lambda i: timed(urls[i % len(urls)], body)),
            ("unrecorded", lambda i: timed(f"{proxy_url}/v1", body)),
        ]
        for i in range(calls):  # interleaved, so drift and noise hit every path alike
            for name, call in rounds:
                samples[name].append(await call(i))
        for i in range(max(1, calls // 4)):
            samples["stream_direct"].append(await timed(backend_url, stream_body))
            samples["stream_recorded"].append(await timed(urls[i % len(urls)], stream_body))
        # CPU the proxy spends per call: unlike latency, it barely depends on what else runs here.
        cpu: dict[str, float] = {}
        for name, base in (("unrecorded", f"{proxy_url}/v1"), ("recorded", None)):
            before = cpu_seconds(proxy_pid)
            for i in range(calls):
                await timed(base or urls[i % len(urls)], body)
            cpu[name] = round(1000 * (cpu_seconds(proxy_pid) - before) / calls, 2)
        health = (await client.get(f"{proxy_url}/health")).json()
    results: dict[str, Any] = {name: _percentiles(values) for name, values in samples.items()}
    results["overhead_p50_ms"] = round(results["recorded"]["p50_ms"] - results["direct"]["p50_ms"], 2)
    results["overhead_p99_ms"] = round(results["recorded"]["p99_ms"] - results["direct"]["p99_ms"], 2)
    results["unrecorded_overhead_p50_ms"] = round(results["unrecorded"]["p50_ms"] - results["direct"]["p50_ms"], 2)
    results["stream_overhead_p50_ms"] = round(
        results["stream_recorded"]["p50_ms"] - results["stream_direct"]["p50_ms"], 2
    )
    results["proxy_cpu_ms_per_call"] = cpu
    results["load_average_1m"] = round(os.getloadavg()[0], 2)  # this box is shared: read the figures with it
    results["proxy_stats"] = health["stats"]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=1000, help="calls per path (direct, recorded, unrecorded)")
    parser.add_argument("--attempts", type=int, default=20, help="attempts the recorded calls are spread over")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/llm_proxy.json"))
    parser.add_argument("--role", choices=["bench", "backend", "proxy"], default="bench", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "backend":
        serve_backend(args.port)
        return
    if args.role == "proxy":
        serve_proxy(args.backend, args.port)
        return
    with tempfile.TemporaryDirectory(prefix="agl-bench-proxy-") as tmp:
        settings = Settings(
            data_dir=Path(tmp), gateway_port=0, topic_prefix=f"b{uuid.uuid4().hex[:6]}", log_level="WARNING"
        )
        if settings.uses_local_broker:
            port, controller = free_ports(2)
            settings = settings.model_copy(update={"kafka_port": port, "kafka_controller_port": controller})
        stack.up(settings)
        children: list[subprocess.Popen[bytes]] = []
        try:
            settings = stack.local_stack_settings(settings)
            backend_port, proxy_port = free_ports(2)
            backend_url = f"http://127.0.0.1:{backend_port}/v1"
            me = [sys.executable, os.path.abspath(__file__)]
            children.append(subprocess.Popen([*me, "--role", "backend", "--port", str(backend_port)]))
            proxy_args = ["--role", "proxy", "--port", str(proxy_port), "--backend", backend_url]
            env = role_environment(settings)
            children.append(subprocess.Popen([*me, *proxy_args], env=env))
            results = asyncio.run(
                measure(
                    settings,
                    backend_url,
                    f"http://127.0.0.1:{proxy_port}",
                    children[1].pid,
                    args.calls,
                    args.attempts,
                )
            )
        finally:
            for child in children:
                child.terminate()
            for child in children:
                child.wait(timeout=30)
            stack.down(settings)
    print(json.dumps(results, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
