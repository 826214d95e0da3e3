"""Which published policy version an inference backend should load next: pure rules shared by
the CPU inference server and the vLLM manager (``consumers/inference``, ``consumers/vllm_server.py``).

A backend serves one model name; the trainer publishes each policy version as a
``ModelCheckpoint`` (an HF folder) in a snapshot on ``agl.resources``. The rule: take the newest
checkpoint of the served model whose version is above both the loaded one and the one already
chosen, skipping versions that failed to load (they are not retried) and formats other than HF
folders. Older or equal versions never replace a newer one, so a replayed or reordered snapshot
cannot roll the policy back.
"""

from __future__ import annotations

from collections.abc import Iterable, Set
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from agl_stream.models import ModelCheckpoint

LOADABLE_FORMATS = frozenset({"hf"})


@dataclass(frozen=True)
class Choice:
    """What :func:`choose_checkpoint` decided: the checkpoint to load (None: nothing newer) and the
    newer checkpoints of the model it refused, with why (e.g. an unknown format)."""

    checkpoint: ModelCheckpoint | None
    refused: list[tuple[ModelCheckpoint, str]] = field(default_factory=list)


def choose_checkpoint(
    resources: Iterable[object],
    *,
    model: str,
    loaded_version: int,
    chosen: ModelCheckpoint | None = None,
    failed: Set[int] = frozenset(),
) -> Choice:
    """The checkpoint among ``resources`` (a snapshot's values) to load next for ``model``.

    ``loaded_version``: the version served now; ``chosen``: a checkpoint already picked and not
    yet loaded (a newer one replaces it, an older one does not); ``failed``: versions that failed
    to load. Returns the newest eligible checkpoint, or ``chosen`` when nothing beats it.
    """
    best = chosen
    refused: list[tuple[ModelCheckpoint, str]] = []
    for resource in resources:
        if not isinstance(resource, ModelCheckpoint) or resource.model != model:
            continue
        floor = max(loaded_version, best.policy_version if best is not None else -1)
        if resource.policy_version <= floor or resource.policy_version in failed:
            continue
        if resource.format not in LOADABLE_FORMATS:
            refused.append((resource, f"checkpoint format {resource.format!r} is not supported (only 'hf' folders)"))
            continue
        best = resource
    return Choice(best if best is not None and best.policy_version > loaded_version else None, refused)


def local_checkpoint_path(uri: str) -> Path:
    """The local folder a checkpoint URI names (a plain path or ``file://``); ValueError otherwise."""
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        return Path(parsed.path if parsed.scheme else uri)
    raise ValueError(f"only local checkpoint directories are supported, got {uri!r}")
