"""The ranks of the ``verl`` backend: torchrun's process group joined (or a one-process one made,
on the CPU behind VERL's CPU platform shim, ``verl_cpu.py``), and the collectives the backend
makes over a gloo group of all ranks (pickled objects, CPU tensors; no-ops on one rank)."""

from __future__ import annotations

import os
from typing import Any, Literal

import torch
import torch.distributed as dist

from agl_stream.training.verl_cpu import use_cpu_platform

Device = Literal["auto", "cuda", "cpu"]

_OBJECT_GROUPS: dict[int, dist.ProcessGroup] = {}


def resolve_device(device: Device) -> Literal["cuda", "cpu"]:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' asked for, but torch sees no CUDA device")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'auto', 'cuda' or 'cpu', not {device!r}")
    return device


def init_distributed(device: Device = "auto") -> tuple[int, int]:
    """Join torchrun's process group (or make a one-process one, on the CPU behind VERL's CPU
    platform shim); (rank, world size). The backend calls it; a trainer calls it first when it must
    tell the other ranks something before they build the backend (see :func:`broadcast_object`)."""
    resolved = resolve_device(device)
    if resolved == "cpu":
        use_cpu_platform()
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    # As VERL's initialize_global_process_group: gloo for CPU tensors, NCCL for CUDA ones.
    backend = "cpu:gloo,cuda:nccl" if resolved == "cuda" else "gloo"
    if resolved == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend=backend)  # torchrun's env:// rendezvous
    else:
        # One process: an in-memory store, so no port is opened.
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def broadcast_object(value: Any, *, src: int = 0) -> Any:
    """Rank ``src``'s ``value`` on every rank (the others pass anything, e.g. None): how a trainer gives
    the other ranks what only rank 0 read, such as the checkpoint to resume. Picklable values only."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box: list[Any] = [value]
    dist.broadcast_object_list(box, src=src, group=_object_group())
    return box[0]


def _object_group() -> dist.ProcessGroup:
    """A gloo group of all ranks for pickled objects, made once per process (every rank makes it at
    the same point: creating a group is collective)."""
    world = dist.group.WORLD
    key = id(world)
    if key not in _OBJECT_GROUPS:
        group = dist.new_group(backend="gloo")
        if not isinstance(group, dist.ProcessGroup):
            raise RuntimeError("this rank is not in the gloo group of all ranks")
        _OBJECT_GROUPS[key] = group
    return _OBJECT_GROUPS[key]


class Ranks:
    """This process's rank among ``size`` and the collectives over the gloo group of all of them.

    Constructed on every rank at the same point (it joins the process group and makes the gloo
    group, both collective)."""

    def __init__(self, device: Literal["cuda", "cpu"]) -> None:
        self.rank, self.size = init_distributed(device)
        # Object broadcasts (commands, batches) go over gloo whatever the tensor backend is.
        self._group = _object_group() if self.size > 1 else None

    def share(self, indices: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``indices`` (uneven shares are fine)."""
        return indices.tensor_split(self.size)[self.rank]

    def gather(self, mine: torch.Tensor) -> torch.Tensor:
        """Every rank's ``mine``, concatenated in rank order along the first dimension."""
        if self.size == 1:
            return mine
        shares: list[Any] = [None] * self.size
        dist.all_gather_object(shares, mine, group=self._group)
        return torch.cat(shares, dim=0)

    def mean(self, values: dict[str, float]) -> dict[str, float]:
        """Each value's mean over the ranks."""
        if self.size == 1:
            return values
        keys = sorted(values)
        stacked = torch.tensor([values[key] for key in keys], dtype=torch.float64)
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=self._group)  # gloo has no AVG
        return {key: float(value) / self.size for key, value in zip(keys, stacked.tolist(), strict=True)}

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self._group)
