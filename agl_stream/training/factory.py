"""Which policy backend to open: the one place that knows both (torch here, VERL's FSDP engine
in verl_backend), so neither backend module imports the other."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agl_stream.policy import load_checkpoint
from agl_stream.rl_options import BackendKind
from agl_stream.training.backend import TRAINER_STATE_FILE, PolicyBackend
from agl_stream.training.torch_backend import TorchPolicyBackend


def open_backend(kind: BackendKind, checkpoint_dir: str | Path | None, **options: Any) -> PolicyBackend:
    """The policy backend named ``kind`` ("torch": :class:`TorchPolicyBackend`; "verl":
    :class:`~agl_stream.training.verl_backend.VerlFSDPBackend`, imported only when asked for).

    ``checkpoint_dir``: None starts from the tiny random policy (:func:`agl_stream.policy.build_model`
    with ``options``' seed); a folder the same kind saved with its trainer state resumes it (``options``
    then override the saved ones); any other HF causal-LM folder starts a new backend on its weights
    (pass ``policy_version`` to carry a version over). ``options``: the backend's options
    (:class:`TorchBackendOptions` / ``VerlBackendOptions`` fields) and ``device``.
    """
    if kind == "torch":
        if checkpoint_dir is None:
            from agl_stream.policy import build_model, build_tokenizer

            return TorchPolicyBackend(build_model(seed=int(options.get("seed", 0))), build_tokenizer(), **options)
        path = Path(checkpoint_dir)
        if (path / TRAINER_STATE_FILE).is_file():
            return TorchPolicyBackend.load(path, **options)
        model, tokenizer = load_checkpoint(path)
        return TorchPolicyBackend(model, tokenizer, **options)
    if kind == "verl":
        from agl_stream.training.verl_backend import VERL_STATE_FILE, VerlFSDPBackend, open_tiny_verl_backend

        if checkpoint_dir is None:
            return open_tiny_verl_backend(**options)
        path = Path(checkpoint_dir)
        if (path / VERL_STATE_FILE).is_file():
            return VerlFSDPBackend.load(path, **options)
        return VerlFSDPBackend(path, **options)
    raise ValueError(f"backend must be 'torch' or 'verl', not {kind!r}")
