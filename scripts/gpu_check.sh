#!/usr/bin/env bash
# Train the torch policy backend on CUDA and print tokens/s (see scripts/gpu_check.py --help).
# Python: $PYTHON, else the repo's .venv, else python3; it needs torch, transformers and verl.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x "$root/.venv/bin/python" ]]; then python="$root/.venv/bin/python"; else python=python3; fi
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$python" "$root/scripts/gpu_check.py" "$@"
