"""A policy version switch under a steady stream of agent calls drops none (the vLLM role's hand-off gate).

Real processes and HTTP: the vLLM inference role (``agl-stream inference --engine vllm``, with
``agl-stream inference --no-follow`` on a tiny HF model folder standing in for vLLM, which needs
a GPU), the LLM proxy in this process, the local stack for attempts and spans, and a checkpoint
published to agl.resources as the trainer does. Agents call through the proxy without pause while
the role stops its child and starts it on the new version; every call must succeed, the calls
after the switch must be served by the new version, and every span must name its version.
"""

from __future__ import annotations

import asyncio
import shlex
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from agl_stream import connect
from agl_stream.config import Settings
from agl_stream.models import ModelCheckpoint, ProxyLLM, Span
from agl_stream.ports import free_ports
from agl_stream.wire.semconv import POLICY_VERSION
from producers.llm_proxy import ProxyOptions, model_list_of, serving
from tests.hf_model import build_hf_model_folder
from tests.integration.helpers import start_role, stop_role
from tests.integration.test_hf_models import tail
from tests.integration.test_inference_server import publish

pytestmark = pytest.mark.integration

AGENTS = 4
CALLS_AFTER_SWITCH = 12  # per agent, once the new version serves
START_S = 300.0  # a torch import and a model load beside busy tests


@dataclass
class Calls:
    ok: int = 0
    failed: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)


async def gate_health(http: httpx.AsyncClient, port: int) -> dict[str, Any]:
    try:
        answer = await http.get(f"http://127.0.0.1:{port}/health", timeout=5)
    except httpx.HTTPError:
        return {}
    return dict(answer.json()) if answer.status_code == 200 else {}


async def until(check: Any, what: str, timeout: float, role: Any, log: Path) -> None:
    """Until ``await check()`` holds (another process's state); fails when the role exits."""
    deadline = time.monotonic() + timeout
    while not await check():
        assert role.poll() is None, f"the inference role exited: {tail(log)}"
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s; {tail(log)}"
        await asyncio.sleep(0.1)


async def test_a_version_switch_under_a_steady_stream_of_calls_fails_none(
    stack_settings: Settings, tmp_path: Path
) -> None:
    settings = stack_settings
    model = f"handoff-{uuid.uuid4().hex[:8]}"  # the shared stack's agl.resources: a model of its own
    first = build_hf_model_folder(tmp_path / "v0")
    newer = build_hf_model_folder(tmp_path / "v1", seed=1)
    (port,) = free_ports(1)
    stand_in = shlex.join([sys.executable, "-m", "agl_stream", "inference", "--no-follow", "--torch-threads", "1"])
    log_name = f"vllm-{model}"
    log = Path(settings.data_dir) / f"{log_name}.log"
    role = start_role(
        settings,
        "inference",
        *("--engine", "vllm", "--vllm-command", stand_in, "--ready-timeout", str(START_S)),
        *("--port", str(port), "--model", str(first), "--model-name", model),
        *("--drain-timeout", "120", "--hold-timeout", str(START_S)),
        log_name=log_name,
    )
    calls = Calls()
    switched = asyncio.Event()
    try:
        async with (
            httpx.AsyncClient(trust_env=False) as http,
            connect(**settings.model_dump(exclude_none=True)) as store,
            serving(settings, model_list_of([f"{model}=http://127.0.0.1:{port}/v1"]), ProxyOptions(port=0)) as proxy,
        ):

            async def serves(version: int) -> bool:
                health = await gate_health(http, port)
                return health.get("status") == "ok" and health.get("policy_version") == version

            await until(lambda: serves(0), "the first server", START_S, role, log)
            started = await store.start_rollout({"handoff": model})
            rollout_id, attempt_id = started.rollout_id, started.attempt.attempt_id
            assert proxy.url is not None
            base_url = ProxyLLM(endpoint=f"{proxy.url}/v1", model=model).get_base_url(rollout_id, attempt_id)

            async def agent(n: int) -> None:
                after = 0
                async with openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=900) as llm:
                    while after < CALLS_AFTER_SWITCH:
                        began = time.monotonic()
                        stream = n % 2 == 1
                        try:
                            if stream:
                                chunks = await llm.chat.completions.create(
                                    model=model,
                                    messages=[{"role": "user", "content": "what is two plus two"}],
                                    max_tokens=4,
                                    stream=True,
                                )
                                async for chunk in chunks:
                                    assert not getattr(chunk, "error", None), chunk
                            else:
                                await llm.chat.completions.create(
                                    model=model,
                                    messages=[{"role": "user", "content": "what is two plus two"}],
                                    max_tokens=4,
                                )
                            calls.ok += 1
                        except Exception as error:
                            calls.failed.append(f"{type(error).__name__}: {error}")
                        calls.latencies.append(time.monotonic() - began)
                        if switched.is_set():
                            after += 1

            agents = [asyncio.create_task(agent(n)) for n in range(AGENTS)]
            await until(lambda: asyncio.sleep(0, calls.ok >= 2 * AGENTS), "calls before the switch", START_S, role, log)
            before = calls.ok
            await publish(settings, ModelCheckpoint(uri=str(newer), model=model, policy_version=1))
            await until(lambda: serves(1), "the switch to version 1", START_S, role, log)
            switched_at = time.time()
            switched.set()
            await asyncio.wait_for(asyncio.gather(*agents), START_S)
            health = await gate_health(http, port)

            assert calls.failed == [], calls.failed[:5]
            assert before > 0 and calls.ok == len(calls.latencies)
            handoff = health["handoff"]
            assert handoff["switches"] == 1 and handoff["refused"] == 0 and handoff["cut"] == 0
            print(
                f"\nhand-off under load: {calls.ok} calls, 0 failed; longest pause {handoff['longest_pause_s']:.2f} s,"
                f" longest held call {handoff['longest_hold_s']:.2f} s, longest call {max(calls.latencies):.2f} s,"
                f" held {handoff['held']}, resent {handoff['retried']}"
            )

            # Every call's span names the version that served it; the calls after the switch, the new one.
            spans: list[Span] = []
            deadline = time.monotonic() + 120
            while len(spans) < calls.ok:
                assert time.monotonic() < deadline, f"{len(spans)} of {calls.ok} spans"
                spans = await store.query_spans(rollout_id, attempt_id)
                await asyncio.sleep(0.2)
            versions = [span.attributes.get(POLICY_VERSION) for span in spans]
            assert set(versions) == {0, 1}, versions
            late = [span for span in spans if span.start_time is not None and span.start_time > switched_at]
            assert len(late) >= AGENTS * (CALLS_AFTER_SWITCH - 1)
            assert {span.attributes.get(POLICY_VERSION) for span in late} == {1}
    finally:
        stop_role(role)
