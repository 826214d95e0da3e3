"""Any Hugging Face causal LM folder, not only the built-in tiny policy, through the real roles:
``agl-stream inference --model`` serves it, ``agl-stream trainer --model`` trains it and
publishes HF folders, the inference server reloads them; and ``--engine vllm`` restarts its
server on each published version (with ``agl-stream inference --no-follow`` standing in for
vLLM, which needs a GPU). The model is a random two-layer Llama built offline (tests/hf_model.py).
"""

from __future__ import annotations

import asyncio
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam

from agl_stream.config import Settings
from agl_stream.kafka import admin
from agl_stream.kafka.io import Outbox, make_producer
from agl_stream.models import ModelCheckpoint, Triplet, TripletBatch, TripletRecord
from agl_stream.policy import load_checkpoint
from agl_stream.ports import free_ports
from consumers.inference import VERSION_HEADER
from tests.hf_model import CHAT_TEMPLATE, build_hf_model_folder
from tests.integration.helpers import start_role, stop_role
from tests.integration.test_inference_server import publish

pytestmark = pytest.mark.integration

MODEL = "tiny-llama"
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "what is two plus two"}]


async def wait_until_served(process: subprocess.Popen[bytes], url: str, log: Path, timeout: float = 120) -> None:
    """Until ``url`` answers 200 (another process starting up); fails when the process exits."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(trust_env=False) as http:
        while True:
            try:
                if (await http.get(url, timeout=2)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert process.poll() is None, f"the role exited: {tail(log)}"
            assert time.monotonic() < deadline, f"{url} never answered"
            await asyncio.sleep(0.1)


def tail(log: Path) -> str:
    return log.read_text()[-3000:] if log.exists() else "(no log)"


async def json_of(url: str) -> Any:
    async with httpx.AsyncClient(trust_env=False) as http:
        return (await http.get(url, timeout=60)).json()


async def eventually(check: Any, timeout: float = 60.0) -> Any:
    """The first truthy ``await check()`` (state another process changes)."""
    deadline = time.monotonic() + timeout
    while not (value := await check()):
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.1)
    return value


async def chat(port: int, seed: int) -> tuple[dict[str, Any], str | None]:
    async with AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none") as client:
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=MESSAGES, max_tokens=6, seed=seed, extra_body={"return_token_ids": True}
        )
        return raw.http_response.json(), raw.headers.get(VERSION_HEADER)


async def test_an_hf_model_is_served_trained_and_the_new_version_reloaded(settings: Settings, tmp_path: Path) -> None:
    await admin.apply(settings)
    folder = build_hf_model_folder(tmp_path / "llama")
    (port,) = free_ports(1)
    args = ("--port", str(port), "--model", str(folder), "--model-name", MODEL)
    inference = start_role(settings, "inference", *args, log_name="inference")
    root = tmp_path / "checkpoints"
    trainer: subprocess.Popen[bytes] | None = None
    try:
        await wait_until_served(inference, f"http://127.0.0.1:{port}/health", settings.data_dir / "inference.log")
        # The model's own chat template and tokens: the answers make the training batch, as rollouts would.
        answers = [await chat(port, seed) for seed in range(4)]
        assert {version for _, version in answers} == {"0"}
        prompt = answers[0][0]["prompt_token_ids"]
        assert prompt[:3] == [0, 3, 6]  # "<s> user :": the folder's template, not ChatML
        records = [
            TripletRecord(
                rollout_id=f"ro-{i:012d}",
                attempt_id=f"at-{i:08d}",
                group_id="g-0",
                policy_version=0,
                triplets=[
                    Triplet(
                        prompt_token_ids=body["prompt_token_ids"],
                        response_token_ids=body["choices"][0]["token_ids"],
                        reward=float(i % 2),
                    )
                ],
                final_reward=float(i % 2),
                finish_time=1.0,
            )
            for i, (body, _) in enumerate(answers)
        ]
        batch = TripletBatch(
            batch_id="tb-hf", records=records, created_time=1.0, min_policy_version=0, max_policy_version=0
        )
        producer = make_producer(settings)
        await producer.start()
        try:
            await Outbox(settings, producer, "test").send(settings.topic("triplet-batches"), batch, key="p0")
        finally:
            await producer.stop()

        trainer = start_role(
            settings,
            "trainer",
            *("--checkpoints", str(root), "--model", str(folder), "--model-name", MODEL),
            *("--max-batches", "1", "--lr", "0.05"),
            log_name="trainer",
        )
        code = await asyncio.to_thread(trainer.wait, 180)
        assert code == 0, tail(settings.data_dir / "trainer.log")

        # Each version is an HF folder with the tokenizer and its chat template.
        base, _ = load_checkpoint(folder)
        trained, tokenizer = load_checkpoint(root / "v1")
        assert tokenizer.chat_template == CHAT_TEMPLATE and type(trained).__name__ == "LlamaForCausalLM"
        changed = [
            name for name, p in trained.named_parameters() if not p.detach().equal(dict(base.named_parameters())[name])
        ]
        assert changed

        async def reloaded() -> bool:
            health = await json_of(f"http://127.0.0.1:{port}/health")
            return bool(health["policy_version"] == 1 and health["source"] == str((root / "v1").resolve()))

        await eventually(reloaded)
        _, version = await chat(port, 0)
        assert version == "1"
    finally:
        if trainer is not None:
            stop_role(trainer)
        stop_role(inference)


async def test_the_vllm_engine_restarts_its_server_on_each_published_version(
    settings: Settings, tmp_path: Path
) -> None:
    """``--engine vllm`` with a stand-in that takes vLLM's flags: ``agl-stream inference --no-follow``."""
    await admin.apply(settings)
    folder = build_hf_model_folder(tmp_path / "llama")
    newer = build_hf_model_folder(tmp_path / "v1", seed=1)
    (port,) = free_ports(1)
    stand_in = shlex.join([sys.executable, "-m", "agl_stream", "inference", "--no-follow", "--torch-threads", "1"])
    manager = start_role(
        settings,
        "inference",
        *("--engine", "vllm", "--vllm-command", stand_in, "--ready-timeout", "300"),
        *("--port", str(port), "--model", str(folder), "--model-name", MODEL),
        log_name="vllm",
    )
    models = f"http://127.0.0.1:{port}/v1/models"
    try:
        await wait_until_served(manager, f"http://127.0.0.1:{port}/health", settings.data_dir / "vllm.log")
        assert (await json_of(models))["data"][0]["root"] == str(folder)
        body, _ = await chat(port, 0)
        assert body["choices"][0]["message"]["role"] == "assistant"

        await publish(settings, ModelCheckpoint(uri=str(newer), model=MODEL, policy_version=1))

        async def restarted_on_v1() -> bool:
            try:
                return bool((await json_of(models))["data"][0]["root"] == str(newer))
            except httpx.HTTPError:
                return False  # held at the role's gate while the new server starts (json_of waits up to 60 s)

        # A stand-in's start (torch's import, the model's load) beside busy tests took ~100 s.
        await eventually(restarted_on_v1, timeout=300)
        body, _ = await chat(port, 0)
        assert body["model"] == MODEL and body["choices"][0]["message"]["role"] == "assistant"
    finally:
        stop_role(manager)
    # The manager stops its server with it: nothing answers on the port any more.
    async with httpx.AsyncClient(trust_env=False) as http:
        with pytest.raises(httpx.ConnectError):
            await http.get(f"http://127.0.0.1:{port}/health")
