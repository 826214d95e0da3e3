"""Check TorchPolicyBackend on a GPU: correctness against the CPU, then tokens/s trained.

A random Qwen2 built from config (default hidden 512, 8 layers, vocab 32000: ~60M parameters)
trains on synthetic batches (default 64 triplets in groups of 8, ~256 prompt + ~128 response
tokens, lengths jittered) with VERL's GRPO advantages and PPO-clip loss. Checks:

1. the GPU's fp32 log-probs of the batch's responses match the CPU's (max abs difference);
2. one step moves log-probs with the advantage (rows with a positive advantage gain more
   log-probability than rows with a negative one);
3. tokens/s over ``--steps`` timed steps after ``--warmup``, in fp32 and with bf16 autocast
   (fp32 master weights), with the peak GPU memory.

Needs torch, transformers and verl (the project's ``train`` extra). Without a CUDA device it
exits with status 2 and says so, unless ``--device cpu`` (a smoke test of the script itself,
with small sizes). Run: ``scripts/gpu_check.sh [--steps 10 ...]``; ``--json PATH`` writes the
figures as JSON. A few minutes at the defaults, most of it imports and model builds.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from agl_stream.models.training import Triplet, TripletBatch, TripletRecord
from agl_stream.policy import build_model, build_tokenizer
from agl_stream.training import TorchPolicyBackend, batch_to_dataproto


def synthetic_batch(args: argparse.Namespace, seed: int) -> TripletBatch:
    rng = random.Random(seed)

    def length(mean: int) -> int:
        return max(1, mean + rng.randint(-mean // 4, mean // 4))

    records = []
    for i in range(args.rows):
        prompt = [rng.randrange(4, args.vocab) for _ in range(length(args.prompt))]
        response = [rng.randrange(4, args.vocab) for _ in range(length(args.response))]
        records.append(
            TripletRecord(
                rollout_id=f"r{i}",
                attempt_id="a",
                group_id=f"g{i // args.group_size}",
                triplets=[Triplet(prompt_token_ids=prompt, response_token_ids=response)],
                final_reward=float(rng.random() < 0.5),
                policy_version=0,
                finish_time=0.0,
            )
        )
    return TripletBatch(batch_id=f"tb-gpu-check-{seed}", records=records, created_time=time.time())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test of the script)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--response", type=int, default=128)
    parser.add_argument("--micro", type=int, default=16, help="rows per forward/backward pass")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            f"gpu_check: torch {torch.__version__} sees no CUDA device (built for CUDA {torch.version.cuda}); "
            "nothing checked. Run it on a machine with a GPU, or pass --device cpu for a smoke test.",
            file=sys.stderr,
        )
        return 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"gpu_check: torch {torch.__version__} on {name}")

    tokenizer = build_tokenizer()  # only saved with checkpoints; the synthetic ids use --vocab
    config = {
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "max_position_embeddings": max(1024, 2 * (args.prompt + args.response)),
    }
    base = build_model(seed=0, **config)
    parameters = sum(p.numel() for p in base.parameters())
    data = batch_to_dataproto(synthetic_batch(args, seed=1), pad_token_id=tokenizer.pad_token_id)
    tokens = int(data.batch["attention_mask"].sum())
    print(f"model: {parameters / 1e6:.1f}M parameters; batch: {len(data)} rows, {tokens} tokens")
    results: dict[str, Any] = {"device": name, "parameters": parameters, "rows": len(data), "tokens": tokens}
    failures: list[str] = []

    # 1. Same weights, same batch: the device's fp32 log-probs are the CPU's.
    cpu = TorchPolicyBackend(copy.deepcopy(base), tokenizer, lr=args.lr, micro_batch_size=args.micro)
    dev = TorchPolicyBackend(copy.deepcopy(base), tokenizer, lr=args.lr, micro_batch_size=args.micro, device=device)
    rows = data[: min(8, len(data))]
    mask = rows.batch["attention_mask"][:, -rows.batch["responses"].shape[1] :].bool()
    difference = float((cpu.log_probs(rows) - dev.log_probs(rows))[mask].abs().max())
    results["logprob_max_abs_diff_vs_cpu"] = difference
    print(f"check 1: fp32 log-probs vs CPU, max abs difference {difference:.2e}")
    if difference > 5e-3:
        failures.append(f"log-probs differ from the CPU's by {difference:.2e}")
    del cpu

    # 2. One step moves log-probs with the advantage.
    before = dev.log_probs(data).sum(dim=1)
    dev.step(data)
    delta = dev.log_probs(data).sum(dim=1) - before
    rewards = data.batch["token_level_rewards"].sum(dim=1)
    uid = list(data.non_tensor_batch["uid"])
    group_mean = {g: float(rewards[[u == g for u in uid]].mean()) for g in set(uid)}
    advantage = rewards - torch.tensor([group_mean[g] for g in uid])
    up, down = float(delta[advantage > 0].mean()), float(delta[advantage < 0].mean())
    results["logprob_delta_positive_advantage"], results["logprob_delta_negative_advantage"] = up, down
    print(f"check 2: mean log-prob change, positive advantage {up:+.4f}, negative {down:+.4f}")
    if not up > down:
        failures.append("a step did not favour the rows with a positive advantage")
    del dev

    # 3. Throughput, fp32 then bf16 autocast.
    for precision in ("fp32", "bf16") if device.type == "cuda" else ("fp32",):
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        backend = TorchPolicyBackend(
            copy.deepcopy(base),
            tokenizer,
            lr=args.lr,
            micro_batch_size=args.micro,
            device=device,
            mixed_precision=precision == "bf16",
        )
        for _ in range(args.warmup):
            backend.step(data)
        seconds = [backend.step(data)["seconds"] for _ in range(args.steps)]
        median = statistics.median(seconds)
        run = {
            "step_ms_p50": round(median * 1000, 1),
            "tokens_per_s_p50": round(tokens / median),
            "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
            if device.type == "cuda"
            else None,
        }
        results[precision] = run
        print(
            f"check 3 ({precision}): {run['tokens_per_s_p50']} tokens/s trained, step {run['step_ms_p50']} ms, "
            f"peak memory {run['peak_memory_gib']} GiB"
        )
        del backend

    results["failures"] = failures
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    if failures:
        print("gpu_check: FAILED: " + "; ".join(failures))
        return 1
    print("gpu_check: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
