"""Check the whole RL loop on a GPU: VERL + vLLM, trajectory aggregation, the hand-off gate.

Runs ``benchmarks/aggregation.py`` once, in ``trajectory`` mode, on the keypad example (three
model calls per rollout, the keypad's feedback between them) with every role a process of its
own: the trainer with ``--backend verl`` (VERL's FSDP engine, one process on one GPU) and the
inference role with ``--engine vllm`` (vLLM's server behind the hand-off gate, restarted on
every published version). Prints the reward per policy version and checks:

1. the trainer published ``--versions`` versions and vLLM served each (gate switches);
2. no attempt failed and the gate refused or cut no call across the switches (0 failed calls),
   with the longest pause and the longest hold of one call;
3. trajectory aggregation merged the turns (fewer than 2 samples per rollout; transition makes 3).

The model: ``--model-path`` (an HF instruct folder on local disk, e.g. Qwen2.5-0.5B-Instruct: the
GPU machine may have no network), else the tiny policy the CPU demo trains, written as an HF
folder (random weights, character tokens: its reward rises within a few versions). Without CUDA
or vLLM it exits with status 2 and says so; ``--dry-run`` runs the same loop on the CPU with
VERL's engine on the CPU and ``agl-stream inference`` standing in for vLLM. ``--json PATH``
merges the figures into PATH under "loop". A check failed: status 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
MODEL_NAME = "agl-gpu-loop"
VLLM_ARGS = ("--enforce-eager", "--gpu-memory-utilization=0.3", "--max-model-len=2048")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, agl-stream inference standing in for vLLM")
    parser.add_argument("--model-path", type=Path, default=None, help="HF causal LM folder (default: the tiny policy)")
    parser.add_argument("--versions", type=int, default=4)
    parser.add_argument("--minutes", type=float, default=40.0, help="most minutes for the run")
    parser.add_argument("--lr", type=float, default=None, help="default: 0.05 for the tiny policy, 1e-6 for a model")
    parser.add_argument("--vllm-arg", action="append", default=[], help="one more argument for vLLM's server")
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args()


def tiny_policy_folder(folder: Path) -> Path:
    """The tiny policy of the CPU demo (seed 0) as an HF folder vLLM can serve."""
    from agl_stream.policy import build_model, build_tokenizer, save_checkpoint

    save_checkpoint(build_model(seed=0), build_tokenizer(), folder)
    return folder


def run_loop(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    out = scratch / "aggregation.json"
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / "aggregation.py"),
        "--modes",
        "trajectory",
        "--backend",
        "verl",
        "--versions",
        str(args.versions),
        "--minutes",
        str(args.minutes),
        "--lr",
        str(args.lr if args.lr is not None else (0.05 if args.model_path is None else 1e-6)),
        "--model-name",
        MODEL_NAME,
        "--out",
        str(out),
    ]
    if not args.dry_run:
        model = args.model_path or tiny_policy_folder(scratch / "v0")
        command += ["--engine", "vllm", "--model-path", str(model)]
        command += [f"--vllm-arg={arg}" for arg in (*VLLM_ARGS, *args.vllm_arg)]
    elif args.model_path is not None:
        command += ["--model-path", str(args.model_path)]
    print("gpu_check (loop): " + " ".join(command[1:]), flush=True)
    subprocess.run(command, cwd=ROOT, check=True)
    return dict(json.loads(out.read_text())["trajectory"])


def checks(result: dict[str, Any], versions: int, dry_run: bool) -> list[str]:
    failures = []
    if result["versions"] < versions:
        failures.append(f"{result['versions']} of {versions} policy versions published")
    if result["failed_attempts"]:
        failures.append(f"{result['failed_attempts']} of {result['attempts']} attempts failed")
    gate = result["gate"]
    if not dry_run:
        if not gate:
            failures.append("the inference role's /health shows no hand-off counters")
        else:
            if gate["switches"] < versions:
                failures.append(f"vLLM switched {gate['switches']} times for {versions} versions")
            if gate["refused"] or gate["cut"]:
                failures.append(f"the gate refused {gate['refused']} and cut {gate['cut']} calls")
    if not result["samples_per_rollout"] < 2.0:
        failures.append(f"{result['samples_per_rollout']} samples per rollout: the turns were not merged")
    return failures


def main() -> int:
    args = parse_args()
    if not args.dry_run:
        if not torch.cuda.is_available():
            print("gpu_check_loop: torch sees no CUDA device; nothing checked (--dry-run: on the CPU)", file=sys.stderr)
            return 2
        if importlib.util.find_spec("vllm") is None:
            print("gpu_check_loop: vllm is not installed here (pip install vllm); nothing checked", file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory(prefix="agl-loop-check-") as folder:
        try:
            result = run_loop(args, Path(folder))
        except subprocess.CalledProcessError as error:
            print(f"gpu_check (loop): FAILED: the loop exited with status {error.returncode}")
            return 1
    print("reward per policy version (the rollouts each version ran):")
    for row in result["reward"]:
        print(f"  v{row['version']:<3} {row['rollouts']:4d} rollouts  mean reward {row['mean']:.3f}")
    gate = result["gate"]
    if gate:
        print(
            f"hand-off: {gate['switches']} switches, longest pause {gate['longest_pause_s']:.1f} s, longest held call "
            f"{gate['longest_hold_s']:.1f} s, {gate['held']} held, {gate['retried']} retried"
        )
    print(
        f"{result['samples_per_rollout']} samples per rollout, {result['tokens_per_sample']} tokens per sample, "
        f"{result['failed_attempts']} failed attempts of {result['attempts']}"
    )
    failures = checks(result, args.versions, args.dry_run)
    result["failures"] = failures
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        merged = json.loads(args.json.read_text()) if args.json.is_file() else {}
        merged["loop"] = result
        args.json.write_text(json.dumps(merged, indent=2) + "\n")
    if failures:
        print("gpu_check (loop): FAILED: " + "; ".join(failures))
        return 1
    print("gpu_check (loop): OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
