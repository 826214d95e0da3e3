"""Check that every policy version the trainer publishes reaches a vLLM server (the loop closed on a GPU).

What it does, with the vLLM manager of ``agl-stream inference --engine vllm``
(``consumers/vllm_server.py``) run in this process, without Kafka (versions are offered to it as
the resources follower would):

1. writes a small random Qwen2 (hidden 256, 2 layers, the tiny policy's tokenizer) as policy v0 and
   starts vLLM's OpenAI server on it; waits for ``/health``;
2. for each of ``--versions`` versions: samples a group of chat answers from the server (with
   ``return_token_ids``), trains one GRPO step on them with the torch backend on the GPU, saves the
   HF folder, offers it to the manager (a managed restart), and times until it is served;
3. checks that ``/v1/models`` names the new folder as its root and that the server's greedy
   answer's logprobs are the new weights' (closer to the new version's, recomputed by the trainer,
   than to the previous version's).

Needs CUDA and vLLM in the same environment (``pip install vllm``); without either it exits with
status 2 and says so. ``--dry-run`` runs the same script on the CPU with ``agl-stream inference
--no-follow`` standing in for vLLM (what can be checked without a GPU). ``--json PATH`` merges
the figures into PATH under "vllm". ``--vllm-arg=...`` (repeatable) goes to vLLM's server.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from agl_stream.models import ModelCheckpoint, Triplet, TripletBatch, TripletRecord
from agl_stream.policy import build_model, build_tokenizer, load_checkpoint, save_checkpoint
from agl_stream.ports import free_ports
from agl_stream.training import TorchPolicyBackend, batch_to_dataproto
from consumers.vllm_server import VllmManager, VllmOptions, default_command

MODEL_NAME = "agl-gpu-check"
SIZES = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}
GROUP = 8


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, agl-stream inference standing in for vLLM")
    parser.add_argument("--versions", type=int, default=2)
    parser.add_argument("--ready-timeout", type=float, default=900.0)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--vllm-arg", action="append", default=[], help="one more argument for vLLM's server")
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args()


def record(i: int, body: dict[str, Any], reward: float) -> TripletRecord:
    return TripletRecord(
        rollout_id=f"ro-{i:012d}",
        attempt_id=f"at-{i:08d}",
        group_id="g-0",
        policy_version=0,
        triplets=[
            Triplet(
                prompt_token_ids=body["prompt_token_ids"],
                response_token_ids=body["choices"][0]["token_ids"],
                reward=reward,
            )
        ],
        final_reward=reward,
        finish_time=0.0,
    )


async def served_logprobs(http: httpx.AsyncClient, prompt: list[int]) -> tuple[list[int], list[float]]:
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": 1,
        "return_token_ids": True,
    }
    answer = (await http.post("/v1/completions", json=body)).json()["choices"][0]
    return list(answer["token_ids"]), [float(x) for x in answer["logprobs"]["token_logprobs"]]


def trainer_logprobs(backend: TorchPolicyBackend, prompt: list[int], response: list[int]) -> list[float]:
    batch = TripletBatch(
        batch_id="tb-check",
        records=[
            TripletRecord(
                rollout_id="ro-000000000000",
                attempt_id="at-00000000",
                group_id="g",
                triplets=[Triplet(prompt_token_ids=prompt, response_token_ids=response)],
                final_reward=0.0,
                finish_time=0.0,
            )
        ],
        created_time=0.0,
    )
    data = batch_to_dataproto(batch, pad_token_id=int(backend.tokenizer.pad_token_id or 0))
    return [float(x) for x in backend.log_probs(data)[0, : len(response)]]


def mean_abs(a: list[float], b: list[float]) -> float:
    n = min(len(a), len(b))
    return sum(abs(x - y) for x, y in zip(a[:n], b[:n], strict=True)) / max(n, 1)


async def check(args: argparse.Namespace, scratch: Path) -> tuple[dict[str, Any], list[str]]:
    device = "cpu" if args.dry_run else "cuda"
    tokenizer = build_tokenizer()
    save_checkpoint(build_model(seed=0, **SIZES), tokenizer, scratch / "v0")
    if args.dry_run:
        command: tuple[str, ...] = (sys.executable, "-m", "agl_stream", "inference", "--no-follow")
        extra: tuple[str, ...] = ()
    else:
        command = tuple(default_command())
        extra = ("--enforce-eager", "--gpu-memory-utilization=0.3", "--max-model-len=1024", *args.vllm_arg)
    (port,) = free_ports(1)
    options = VllmOptions(
        model_name=MODEL_NAME,
        model=scratch / "v0",
        port=port,
        follow=False,
        command=command,
        extra_args=extra,
        ready_timeout_s=args.ready_timeout,
    )
    manager = VllmManager(None, options)
    run = asyncio.create_task(manager.run())
    results: dict[str, Any] = {"device": device, "versions": []}
    failures: list[str] = []
    try:
        started = time.monotonic()
        await asyncio.wait_for(manager.wait_for_version(0, args.ready_timeout), args.ready_timeout + 5)
        results["first_start_s"] = round(time.monotonic() - started, 1)
        print(f"check 1: the server answers /health on v0 after {results['first_start_s']} s")
        model, _ = load_checkpoint(scratch / "v0")
        backend = TorchPolicyBackend(model, tokenizer, lr=args.lr, device=device)
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "count to 5"}], add_generation_prompt=True, tokenize=False
        )
        probe = list(tokenizer.encode(str(text), add_special_tokens=False))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=120) as http:
            for version in range(1, args.versions + 1):
                answers = []
                for i in range(GROUP):
                    body = {
                        "model": MODEL_NAME,
                        "messages": [{"role": "user", "content": f"write a number {i}"}],
                        "max_tokens": 16,
                        "seed": 100 * version + i,
                        "return_token_ids": True,
                    }
                    answers.append((await http.post("/v1/chat/completions", json=body)).json())
                # Rewards by position: a spread within the group, so the step surely changes the weights.
                records = [record(i, a, float(i % 2)) for i, a in enumerate(answers)]
                response, _ = await served_logprobs(http, probe)
                before = trainer_logprobs(backend, probe, response)
                data = batch_to_dataproto(
                    TripletBatch(batch_id=f"tb-{version}", records=records, created_time=0.0),
                    pad_token_id=int(tokenizer.pad_token_id or 0),
                )
                metrics = backend.step(data)
                folder = scratch / f"v{version}"
                backend.save(folder, optimizer=False)
                offered = time.monotonic()
                manager.offer(ModelCheckpoint(uri=str(folder), model=MODEL_NAME, policy_version=version))
                await manager.wait_for_version(version, args.ready_timeout)
                restart_s = round(time.monotonic() - offered, 1)
                root = (await http.get("/v1/models")).json()["data"][0]["root"]
                response, served = await served_logprobs(http, probe)
                after = trainer_logprobs(backend, probe, response)
                to_new, to_old = mean_abs(served, after), mean_abs(served, before)
                figures = {
                    "version": version,
                    "restart_s": restart_s,
                    "updates": metrics["updates"],
                    "served_root": root,
                    "logprob_diff_to_new": round(to_new, 5),
                    "logprob_diff_to_previous": round(to_old, 5),
                }
                results["versions"].append(figures)
                print(
                    f"check 2 (v{version}): served after a restart of {restart_s} s from {root}; "
                    f"mean |logprob| difference to v{version} {to_new:.4f}, to v{version - 1} {to_old:.4f}"
                )
                if root != str(folder):
                    failures.append(f"v{version}: /v1/models names {root}, not {folder}")
                if not to_new < to_old:
                    failures.append(f"v{version}: the served logprobs are not the new weights'")
        results["restarts"] = manager.restarts
    finally:
        manager.stop()
        await asyncio.wait_for(run, 120)
    return results, failures


def main() -> int:
    args = parse_args()
    if not args.dry_run:
        if not torch.cuda.is_available():
            print("gpu_check_vllm: torch sees no CUDA device; nothing checked (--dry-run: on the CPU)", file=sys.stderr)
            return 2
        if importlib.util.find_spec("vllm") is None:
            print("gpu_check_vllm: vllm is not installed here (pip install vllm); nothing checked", file=sys.stderr)
            return 2
    print("gpu_check (vllm): " + ("dry run on the CPU, agl-stream inference standing in" if args.dry_run else "vLLM"))
    scratch = Path(tempfile.mkdtemp(prefix="agl-vllm-check-"))
    try:
        results, failures = asyncio.run(check(args, scratch))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    results["failures"] = failures
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        merged = json.loads(args.json.read_text()) if args.json.is_file() else {}
        merged["vllm"] = results
        args.json.write_text(json.dumps(merged, indent=2) + "\n")
    if failures:
        print("gpu_check (vllm): FAILED: " + "; ".join(failures))
        return 1
    print("gpu_check (vllm): OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
