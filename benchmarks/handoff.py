"""Policy version switches under load: failed calls, the longest pause, and what the gate costs.

The vLLM inference role's manager (``consumers/vllm_server.py``) runs in this process, its child
a stand-in for vLLM (this script with ``--role backend``: vLLM's flags, ``/health``, a canned chat
answer after ``--latency-ms`` of "generation", and ``--load-s`` of "model loading" before it
listens, which is what a restart costs). Clients call the role's port without pause while the
manager switches versions ``--switches`` times (each a stop and a start of the child behind the
hand-off gate). No broker, no LLM proxy: the hand-off is the gate's, and the proxy only sees
slower calls.

Reported: calls, failed calls (the goal: 0), the longest pause (from the gate's pause to its
resume: drain + stop + the new server's load), the longest time one call was held, the pause
minus the stand-in's load time (what the hand-off itself costs), call latency p50/p99 outside
switches, and the gate's latency overhead (one call at a time, straight to the child and through
the gate).

Run: `python benchmarks/handoff.py --switches 5 --clients 16 --load-s 2`. JSON results go to
benchmarks/results/handoff.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

# The stand-in (--role backend) imports nothing more: its start is part of every pause measured.

MODEL = "bench-policy"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "What is 17 * 23?"}], "max_tokens": 16}


def serve_backend(argv: list[str]) -> None:
    """The stand-in for vLLM (run as ``--role backend``): loads for --load-s, then answers."""
    from aiohttp import web

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--served-model-name", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--load-s", type=float, default=0.0)
    parser.add_argument("--latency-ms", type=float, default=0.0)
    args, _ = parser.parse_known_args(argv)
    time.sleep(args.load_s)  # "loading the model": the port opens only after it
    answer = json.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "model": args.served_model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "391"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 8, "total_tokens": 9, "completion_tokens": 1},
        }
    ).encode()

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(args.latency_ms / 1000)  # "generating"
        return web.Response(body=answer, content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values) or [0.0]

    def at(q: float) -> float:
        return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)

    return {"p50_ms": at(0.5), "p99_ms": at(0.99), "max_ms": round(1000 * ordered[-1], 2), "n": len(values)}


async def _one_at_a_time(url: str, calls: int) -> list[float]:
    import httpx

    latencies = []
    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        for _ in range(calls):
            began = time.monotonic()
            (await http.post(f"{url}/v1/chat/completions", json=BODY)).raise_for_status()
            latencies.append(time.monotonic() - began)
    return latencies


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    from agl_stream.models import ModelCheckpoint
    from agl_stream.ports import free_ports
    from consumers.switch_gate import HandoffOptions
    from consumers.vllm_server import VllmManager, VllmOptions

    root = Path(tempfile.mkdtemp(prefix="agl-handoff-"))
    folders = []
    for version in range(args.switches + 1):
        folder = root / f"v{version}"
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        folders.append(folder)
    (port,) = free_ports(1)
    command = (sys.executable, __file__, "--role", "backend", "--load-s", str(args.load_s))
    options = VllmOptions(
        model_name=MODEL,
        model=folders[0],
        port=port,
        follow=False,
        command=(*command, "--latency-ms", str(args.latency_ms)),
        ready_timeout_s=300,
        poll_s=0.05,
        handoff=HandoffOptions(hold_timeout_s=300, drain_timeout_s=60),
    )
    manager = VllmManager(None, options)
    running = asyncio.create_task(manager.run())
    url = f"http://127.0.0.1:{port}"
    ok, failed = 0, []
    steady: list[float] = []
    during: list[float] = []
    stop = asyncio.Event()
    switching = asyncio.Event()

    async def client() -> None:
        nonlocal ok
        async with httpx.AsyncClient(trust_env=False, timeout=600) as http:
            while not stop.is_set():
                began, in_switch = time.monotonic(), switching.is_set()
                try:
                    answer = await http.post(f"{url}/v1/chat/completions", json=BODY)
                    answer.raise_for_status()
                    ok += 1
                except httpx.HTTPError as error:
                    failed.append(f"{type(error).__name__}: {error}")
                took = time.monotonic() - began
                (during if in_switch or switching.is_set() else steady).append(took)

    try:
        await manager.wait_for_version(0, timeout=300)
        direct = await _one_at_a_time(f"http://127.0.0.1:{manager.server.options.port}", args.overhead_calls)
        gated = await _one_at_a_time(url, args.overhead_calls)
        clients = [asyncio.create_task(client()) for _ in range(args.clients)]
        switch_s = []
        for version in range(1, args.switches + 1):
            await asyncio.sleep(args.between_s)  # steady load between switches
            switching.set()
            began = time.monotonic()
            manager.offer(ModelCheckpoint(uri=str(folders[version]), model=MODEL, policy_version=version))
            await manager.wait_for_version(version, timeout=300)
            switch_s.append(time.monotonic() - began)
            switching.clear()
        await asyncio.sleep(args.between_s)
        stop.set()
        await asyncio.gather(*clients)
        stats = manager.gate.stats
    finally:
        manager.stop()
        await asyncio.wait_for(running, 60)
    return {
        "switches": args.switches,
        "clients": args.clients,
        "stand_in_load_s": args.load_s,
        "calls": ok + len(failed),
        "failed_calls": len(failed),
        "failures": failed[:5],
        "longest_pause_s": round(stats.longest_pause_s, 3),
        "longest_pause_minus_load_s": round(stats.longest_pause_s - args.load_s, 3),
        "longest_held_call_s": round(stats.longest_hold_s, 3),
        "switch_s": [round(s, 3) for s in switch_s],
        "latency_steady": _percentiles(steady),
        "latency_during_switches": _percentiles(during),
        "gate_overhead_p50_ms": round(_percentiles(gated)["p50_ms"] - _percentiles(direct)["p50_ms"], 2),
        "one_at_a_time_direct": _percentiles(direct),
        "one_at_a_time_through_gate": _percentiles(gated),
        "gate": asdict(stats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role", choices=["bench", "backend"], default="bench")
    parser.add_argument("--switches", type=int, default=5)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--load-s", type=float, default=2.0, help="the stand-in's model load time")
    parser.add_argument("--latency-ms", type=float, default=50.0, help="the stand-in's time per call")
    parser.add_argument("--between-s", type=float, default=3.0, help="steady load between switches")
    parser.add_argument("--overhead-calls", type=int, default=300)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "handoff.json")
    args, rest = parser.parse_known_args()
    if args.role == "backend":
        serve_backend([*rest, "--load-s", str(args.load_s), "--latency-ms", str(args.latency_ms)])
        return
    result = asyncio.run(bench(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
