"""Check the policy backends on GPUs: correctness against the CPU, then tokens/s trained.

A random Qwen2 built from config (default hidden 512, 8 layers, vocab 32000: ~60M parameters)
trains on synthetic batches (default 64 triplets in groups of 8, ~256 prompt + ~128 response
tokens, lengths jittered) with VERL's GRPO advantages and PPO-clip loss, through one backend:

- ``--backend torch``: :class:`TorchPolicyBackend` on one GPU, one process;
- ``--backend verl``: :class:`VerlFSDPBackend` (VERL's FSDP2 engine), run under ``torchrun`` with one
  process per GPU (``scripts/gpu_check.sh`` does that); rank 0 drives, the other ranks ``follow()``.

Checks, per backend:

1. the GPU's fp32 log-probs of the batch's responses match the CPU torch backend's (max abs difference);
2. one step moves log-probs with the advantage (rows with a positive advantage gain more
   log-probability than rows with a negative one);
3. tokens/s over ``--steps`` timed steps after ``--warmup`` (torch: fp32 and bf16 autocast; verl:
   fp32 and VERL's bf16 mixed precision; a verl step includes its old-log-prob forward pass), with
   the peak GPU memory of rank 0;
4. (verl) ``save`` writes an HF folder whose weights give the engine's log-probs;
5. (verl) ``load`` on every rank resumes it (version, extra state, log-probs).

Needs torch, transformers and verl (the project's ``train`` extra). Without a CUDA device it exits
with status 2 and says so, unless ``--dry-run`` (the whole script on the CPU with a tiny model and
batch: what can be checked without a GPU; ``scripts/gpu_check.sh --dry-run`` runs verl on 2 CPU
ranks). ``--json PATH`` merges the figures into PATH under the backend's name. A few minutes at the
defaults, most of it imports and model builds.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from verl import DataProto

from agl_stream.models.training import Triplet, TripletBatch, TripletRecord
from agl_stream.policy import build_model, build_tokenizer, load_checkpoint, save_checkpoint
from agl_stream.training import TorchPolicyBackend, batch_to_dataproto

DRY_RUN_SIZES = {
    "hidden": 64,
    "intermediate": 128,
    "layers": 2,
    "heads": 4,
    "kv_heads": 2,
    "vocab": 512,
    "rows": 16,
    "prompt": 24,
    "response": 12,
    "micro": 8,
    "steps": 2,
    "warmup": 1,
    "lr": 1e-3,
}


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


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--backend", choices=("torch", "verl"), default="torch")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke test of the script)")
    parser.add_argument("--dry-run", action="store_true", help="on the CPU with a tiny model and batch")
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
    parser.add_argument("--micro", type=int, default=16, help="rows per forward/backward pass (torch backend)")
    parser.add_argument("--max-tokens", type=int, default=16384, help="tokens per micro-batch and GPU (verl)")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.dry_run:
        args.device = "cpu"
        for key, value in DRY_RUN_SIZES.items():
            setattr(args, key, value)
    return args


def model_config(args: argparse.Namespace) -> dict[str, int]:
    return {
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "max_position_embeddings": max(1024, 2 * (args.prompt + args.response)),
    }


def advantage_check(
    log_probs: Callable[[DataProto], torch.Tensor], step: Callable[[DataProto], object], data: DataProto
) -> tuple[float, float]:
    """Mean change of the rows' log-probability after one step, for positive and negative advantages."""
    before = log_probs(data).sum(dim=1)
    step(data)
    delta = log_probs(data).sum(dim=1) - before
    rewards = data.batch["token_level_rewards"].sum(dim=1)
    uid = list(data.non_tensor_batch["uid"])
    group_mean = {g: float(rewards[[u == g for u in uid]].mean()) for g in set(uid)}
    advantage = rewards - torch.tensor([group_mean[g] for g in uid])
    return float(delta[advantage > 0].mean()), float(delta[advantage < 0].mean())


def peak_memory_gib(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None


def reset_peak_memory(device: torch.device) -> None:
    gc.collect()  # the previous backend's engine, before its memory is counted again
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def check_torch(args: argparse.Namespace, device: torch.device) -> tuple[dict[str, Any], list[str]]:
    tokenizer = build_tokenizer()  # only saved with checkpoints; the synthetic ids use --vocab
    base = build_model(seed=0, **model_config(args))
    parameters = sum(p.numel() for p in base.parameters())
    data = batch_to_dataproto(synthetic_batch(args, seed=1), pad_token_id=tokenizer.pad_token_id)
    tokens = int(data.batch["attention_mask"].sum())
    print(f"torch backend: {parameters / 1e6:.1f}M parameters; batch: {len(data)} rows, {tokens} tokens")
    results: dict[str, Any] = {"parameters": parameters, "rows": len(data), "tokens": tokens}
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
    up, down = advantage_check(dev.log_probs, dev.step, data)
    results["logprob_delta_positive_advantage"], results["logprob_delta_negative_advantage"] = up, down
    print(f"check 2: mean log-prob change, positive advantage {up:+.4f}, negative {down:+.4f}")
    if not up > down:
        failures.append("a step did not favour the rows with a positive advantage")
    del dev

    # 3. Throughput, fp32 then bf16 autocast.
    for precision in ("fp32", "bf16") if device.type == "cuda" else ("fp32",):
        reset_peak_memory(device)
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
            "peak_memory_gib": peak_memory_gib(device),
        }
        results[precision] = run
        print(
            f"check 3 ({precision}): {run['tokens_per_s_p50']} tokens/s trained, step {run['step_ms_p50']} ms, "
            f"peak memory {run['peak_memory_gib']} GiB"
        )
        del backend
    return results, failures


def check_verl(args: argparse.Namespace, device: torch.device) -> tuple[dict[str, Any], list[str]]:
    """Every rank runs this; rank 0 checks and times while the others follow its calls."""
    from agl_stream.training.verl_backend import VerlFSDPBackend

    rank = int(os.environ.get("RANK", "0"))
    tokenizer = build_tokenizer()
    config = model_config(args)
    # One folder per run, the same on every rank of this node (torchrun gives them one run id).
    run_id = os.environ.get("TORCHELASTIC_RUN_ID") or uuid.uuid4().hex
    scratch = Path(tempfile.gettempdir()) / f"agl-gpu-check-{run_id}"
    results: dict[str, Any] = {}
    failures: list[str] = []
    saved_log_probs: list[torch.Tensor] = []
    try:
        # Each rank writes the same seeded weights to its own folder.
        policy = scratch / f"policy-rank{rank}"
        save_checkpoint(build_model(seed=0, **config), tokenizer, policy)
        data = batch_to_dataproto(synthetic_batch(args, seed=1), pad_token_id=tokenizer.pad_token_id)
        tokens = int(data.batch["attention_mask"].sum())
        kind = "cuda" if device.type == "cuda" else "cpu"
        common: dict[str, Any] = {"lr": args.lr, "max_token_len_per_gpu": args.max_tokens, "device": kind}

        def run(mixed_precision: bool, body: Callable[[VerlFSDPBackend], None], resume: bool = False) -> None:
            reset_peak_memory(device)
            if resume:
                backend = VerlFSDPBackend.load(scratch / "saved", **common)
            else:
                backend = VerlFSDPBackend(policy, mixed_precision=mixed_precision, **common)
            if backend.rank != 0:
                backend.follow()
                return
            try:
                body(backend)
            finally:
                backend.close()

        def correctness(backend: VerlFSDPBackend) -> None:
            parameters = sum(p.numel() for p in build_model(seed=0, **config).parameters())
            print(
                f"verl backend ({backend.options.strategy}, {backend.world_size} ranks, {kind}): "
                f"{parameters / 1e6:.1f}M parameters; batch: {len(data)} rows, {tokens} tokens"
            )
            results.update({"parameters": parameters, "rows": len(data), "tokens": tokens})
            results["world_size"] = backend.world_size
            reference = TorchPolicyBackend(load_checkpoint(policy)[0], tokenizer, lr=args.lr, micro_batch_size=8)
            rows = data[: max(backend.world_size, min(8, len(data)))]
            mask = rows.batch["attention_mask"][:, -rows.batch["responses"].shape[1] :].bool()
            difference = float((reference.log_probs(rows) - backend.log_probs(rows))[mask].abs().max())
            results["logprob_max_abs_diff_vs_cpu"] = difference
            print(f"check 1: fp32 log-probs vs the CPU torch backend, max abs difference {difference:.2e}")
            if difference > 5e-3:
                failures.append(f"verl log-probs differ from the CPU's by {difference:.2e}")
            up, down = advantage_check(backend.log_probs, backend.step, data)
            results["logprob_delta_positive_advantage"], results["logprob_delta_negative_advantage"] = up, down
            print(f"check 2: mean log-prob change, positive advantage {up:+.4f}, negative {down:+.4f}")
            if not up > down:
                failures.append("a verl step did not favour the rows with a positive advantage")
            # 4. The saved folder is the policy (and check 5 resumes it on every rank).
            target = scratch / "saved"
            backend.save(target, extra_state={"check": "gpu"})
            saved = TorchPolicyBackend(load_checkpoint(target)[0], tokenizer, lr=args.lr, micro_batch_size=8)
            saved_log_probs.append(backend.log_probs(rows))
            drift = float((saved.log_probs(rows) - saved_log_probs[0])[mask].abs().max())
            results["saved_logprob_max_abs_diff"] = drift
            print(f"check 4: saved HF folder vs the engine, max abs log-prob difference {drift:.2e}")
            if drift > 5e-3 or not (target / "verl_state.json").is_file():
                failures.append(f"the saved policy is not the engine's (difference {drift:.2e})")

        def throughput(precision: str) -> Callable[[VerlFSDPBackend], None]:
            def body(backend: VerlFSDPBackend) -> None:
                for _ in range(args.warmup):
                    backend.step(data)
                seconds = [backend.step(data)["seconds"] for _ in range(args.steps)]
                median = statistics.median(seconds)
                figures = {
                    "step_ms_p50": round(median * 1000, 1),
                    "tokens_per_s_p50": round(tokens / median),
                    "peak_memory_gib_rank0": peak_memory_gib(device),
                }
                results[precision] = figures
                print(
                    f"check 3 ({precision}): {figures['tokens_per_s_p50']} tokens/s trained over all ranks, "
                    f"step {figures['step_ms_p50']} ms, peak memory (rank 0) {figures['peak_memory_gib_rank0']} GiB"
                )

            return body

        def resumed(backend: VerlFSDPBackend) -> None:
            rows = data[: len(saved_log_probs[0])]
            difference = float((backend.log_probs(rows) - saved_log_probs[0]).abs().max())
            results["resumed_logprob_max_abs_diff"] = difference
            print(
                f"check 5: load() on {backend.world_size} ranks: version {backend.policy_version}, "
                f"extra state {backend.extra_state}, max abs log-prob difference {difference:.2e}"
            )
            if backend.policy_version != 1 or backend.extra_state != {"check": "gpu"} or difference > 1e-5:
                failures.append("load() did not resume what save() wrote")

        run(False, correctness)
        run(False, resumed, resume=True)
        run(False, throughput("fp32"))
        if device.type == "cuda":
            run(True, throughput("bf16"))
    finally:
        shutil.rmtree(policy if rank else scratch, ignore_errors=True)
    return results, failures


def main() -> int:
    args = parse_args()
    device = torch.device(args.device)
    rank = int(os.environ.get("RANK", "0"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            f"gpu_check: torch {torch.__version__} sees no CUDA device (built for CUDA {torch.version.cuda}); "
            "nothing checked. Run it on a machine with a GPU, or pass --dry-run for a smoke test on the CPU.",
            file=sys.stderr,
        )
        return 2
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if rank == 0:
        print(f"gpu_check ({args.backend}): torch {torch.__version__} on {name}" + (" (dry run)" * args.dry_run))

    results, failures = check_torch(args, device) if args.backend == "torch" else check_verl(args, device)
    if rank != 0:
        return 0
    results.update({"device": name, "dry_run": args.dry_run, "failures": failures})
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        merged = json.loads(args.json.read_text()) if args.json.is_file() else {}
        merged[args.backend] = results
        args.json.write_text(json.dumps(merged, indent=2) + "\n")
    if failures:
        print(f"gpu_check ({args.backend}): FAILED: " + "; ".join(failures))
        return 1
    print(f"gpu_check ({args.backend}): OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
