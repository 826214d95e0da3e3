"""Tokens per second trained by TorchPolicyBackend.step on this machine's CPU.

The demo-size policy (agl_stream.policy.build_model defaults, ~82k parameters) trains on
synthetic batches shaped like the demo's: ``--rows`` triplets (groups of ``--group-size``) of
~``--prompt`` prompt and ~``--response`` response tokens (lengths jittered by up to a quarter,
so padding is realistic). Each setting runs ``--warmup`` untimed steps, then ``--steps`` timed
ones; tokens are the non-pad prompt+response tokens of the batch (what the forward pass reads).
Settings: rollout logprobs in the batch (old log-probs free) or not (one extra no-grad forward
pass), micro-batch sizes, torch thread counts.

Run: `python benchmarks/trainer_step.py`; JSON to benchmarks/results/trainer_step.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any, TypedDict

import torch

from agl_stream.models.training import Triplet, TripletBatch, TripletRecord
from agl_stream.policy import build_model, build_tokenizer
from agl_stream.training import TorchPolicyBackend, batch_to_dataproto


def synthetic_batch(
    rows: int, group_size: int, prompt: int, response: int, vocab: int, *, logprobs: bool, seed: int
) -> TripletBatch:
    rng = random.Random(seed)
    # A stream of its own: with or without logprobs, the batch has the same tokens and lengths.
    logprob_rng = random.Random(seed + 1)

    def length(mean: int) -> int:
        return max(1, mean + rng.randint(-mean // 4, mean // 4))

    records = []
    for i in range(rows):
        n_prompt, n_response = length(prompt), length(response)
        records.append(
            TripletRecord(
                rollout_id=f"r{i}",
                attempt_id="a",
                group_id=f"g{i // group_size}",
                triplets=[
                    Triplet(
                        prompt_token_ids=[rng.randrange(4, vocab) for _ in range(n_prompt)],
                        response_token_ids=[rng.randrange(4, vocab) for _ in range(n_response)],
                        response_logprobs=[-logprob_rng.uniform(2.0, 6.0) for _ in range(n_response)]
                        if logprobs
                        else None,
                    )
                ],
                final_reward=float(rng.random() < 0.5),
                policy_version=0,
                finish_time=0.0,
            )
        )
    return TripletBatch(batch_id="tb-bench", records=records, created_time=time.time())


class Setting(TypedDict):
    """The keyword arguments of one ``measure`` run."""

    threads: int
    micro: int
    logprobs: bool


def measure(args: argparse.Namespace, *, threads: int, micro: int, logprobs: bool) -> dict[str, Any]:
    torch.set_num_threads(threads)
    tokenizer = build_tokenizer()
    model = build_model(seed=0)
    backend = TorchPolicyBackend(model, tokenizer, lr=1e-3, micro_batch_size=micro)
    batch = synthetic_batch(
        args.rows, args.group_size, args.prompt, args.response, len(tokenizer), logprobs=logprobs, seed=1
    )
    convert_started = time.perf_counter()
    data = batch_to_dataproto(batch, pad_token_id=tokenizer.pad_token_id)
    convert_ms = (time.perf_counter() - convert_started) * 1000
    for _ in range(args.warmup):
        backend.step(data)
    seconds, tokens = [], 0.0
    for _ in range(args.steps):
        metrics = backend.step(data)
        seconds.append(metrics["seconds"])
        tokens = metrics["tokens"]
    return {
        "threads": threads,
        "micro_batch_size": micro,
        "rollout_logprobs": logprobs,
        "tokens_per_step": tokens,
        "step_ms_p50": round(statistics.median(seconds) * 1000, 1),
        "tokens_per_s_p50": round(tokens / statistics.median(seconds)),
        "batch_to_dataproto_ms": round(convert_ms, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=40)
    parser.add_argument("--response", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "trainer_step.json")
    args = parser.parse_args()

    settings: list[Setting] = [
        {"threads": 2, "micro": 64, "logprobs": True},
        {"threads": 2, "micro": 64, "logprobs": False},
        {"threads": 2, "micro": 16, "logprobs": True},
        {"threads": 1, "micro": 64, "logprobs": True},
    ]
    results: dict[str, Any] = {
        "model_parameters": sum(p.numel() for p in build_model(seed=0).parameters()),
        "rows": args.rows,
        "group_size": args.group_size,
        "prompt_tokens_mean": args.prompt,
        "response_tokens_mean": args.response,
        "runs": [],
    }
    for setting in settings:
        run = measure(args, **setting)
        print(json.dumps(run))
        results["runs"].append(run)
    results["load_average_1m"] = round(os.getloadavg()[0], 2)  # this box is shared: read the figures with it
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
