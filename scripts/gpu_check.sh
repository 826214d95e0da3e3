#!/usr/bin/env bash
# Check the policy backends on CUDA and print tokens/s (see scripts/gpu_check.py --help):
#   torch: one process on one GPU;
#   verl:  VERL's FSDP engine under torchrun, one process per GPU ($NPROC, default: every GPU torch sees);
#   vllm:  every policy version reaches vLLM's server (scripts/gpu_check_vllm.py: trains on the GPU,
#          publishes HF folders, the vLLM manager restarts the server on each); skipped, and said so,
#          when vllm is not installed;
#   loop:  the whole RL loop, VERL + vLLM with trajectory aggregation and the hand-off gate, on the
#          keypad example (scripts/gpu_check_loop.py: reward per version, 0 failed calls, longest
#          pause); $MODEL_PATH names an HF instruct folder (default: the tiny policy); skipped, and
#          said so, when vllm is not installed.
# --backend torch|verl|vllm|loop runs only that one; --dry-run runs them all on the CPU with a tiny model
# (verl on 2 CPU ranks, or $NPROC; vllm and loop with agl-stream inference standing in for vLLM): no GPU
# needed. Other arguments go to gpu_check.py (--steps 10 --json out.json ...); --json also reaches
# gpu_check_vllm.py. Python: $PYTHON, else the repo's .venv, else python3; it needs torch,
# transformers and verl (and vllm for the vllm check).
# Exit status: 0 all OK, 1 a check failed, 2 no CUDA device (and not --dry-run); the first non-zero wins.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x "$root/.venv/bin/python" ]]; then python="$root/.venv/bin/python"; else python=python3; fi
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

backends=(torch verl vllm loop)
dry_run=0
args=()
vllm_args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --backend) backends=("$2"); shift 2 ;;
    --backend=*) backends=("${1#--backend=}"); shift ;;
    --dry-run) dry_run=1; args+=("$1"); vllm_args+=("$1"); shift ;;
    --json) args+=("$1" "$2"); vllm_args+=("$1" "$2"); shift 2 ;;
    --json=*) args+=("$1"); vllm_args+=("$1"); shift ;;
    *) args+=("$1"); shift ;;
  esac
done

status=0
for backend in "${backends[@]}"; do
  rc=0
  case "$backend" in
    torch)
      "$python" "$root/scripts/gpu_check.py" --backend torch ${args[@]+"${args[@]}"} || rc=$?
      ;;
    verl)
      nproc="${NPROC:-}"
      if [[ -z "$nproc" ]]; then
        if [[ $dry_run == 1 ]]; then
          nproc=2
        else
          nproc="$("$python" -c 'import torch; print(torch.cuda.device_count())')"
        fi
      fi
      if [[ "$nproc" -ge 1 ]]; then
        "$python" -m torch.distributed.run --standalone --nproc_per_node="$nproc" \
          "$root/scripts/gpu_check.py" --backend verl ${args[@]+"${args[@]}"} || rc=$?
      else
        # No GPU: one plain process, which says so (status 2).
        "$python" "$root/scripts/gpu_check.py" --backend verl ${args[@]+"${args[@]}"} || rc=$?
      fi
      ;;
    vllm)
      if [[ $dry_run == 1 ]] || "$python" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("vllm") is None)'; then
        "$python" "$root/scripts/gpu_check_vllm.py" ${vllm_args[@]+"${vllm_args[@]}"} || rc=$?
      else
        echo "gpu_check (vllm): vllm is not installed for $python; skipped (pip install vllm to check it)"
      fi
      ;;
    loop)
      loop_args=(${vllm_args[@]+"${vllm_args[@]}"})
      if [[ -n "${MODEL_PATH:-}" ]]; then loop_args+=(--model-path "$MODEL_PATH"); fi
      if [[ $dry_run == 1 ]] || "$python" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("vllm") is None)'; then
        "$python" "$root/scripts/gpu_check_loop.py" ${loop_args[@]+"${loop_args[@]}"} || rc=$?
      else
        echo "gpu_check (loop): vllm is not installed for $python; skipped (pip install vllm to check it)"
      fi
      ;;
    *)
      echo "gpu_check.sh: unknown backend '$backend' (torch, verl, vllm or loop)" >&2
      rc=2
      ;;
  esac
  if [[ $status == 0 && $rc != 0 ]]; then status=$rc; fi
done
exit "$status"
