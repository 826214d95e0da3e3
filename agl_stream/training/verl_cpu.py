"""VERL on the CPU: a platform for VERL's plugin registry (VERL ships CUDA, NPU and ROCm only), so
its FSDP engine trains in one process on a gloo group (tests, CPU-only machines). Installed with
VERL's own ``set_platform`` before the engine module is imported."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
from verl.plugin.platform import PlatformBase, set_platform


class CpuDeviceModule(ModuleType):
    """``torch.cpu`` plus the memory calls VERL makes on its device module (nothing to report)."""

    def __init__(self) -> None:
        super().__init__("agl_stream_verl_cpu_device")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def mem_get_info(*_args: Any) -> tuple[int, int]:
        return 0, 0

    @staticmethod
    def memory_allocated(*_args: Any) -> int:
        return 0

    @staticmethod
    def memory_reserved(*_args: Any) -> int:
        return 0

    @staticmethod
    def max_memory_allocated(*_args: Any) -> int:
        return 0

    @staticmethod
    def max_memory_reserved(*_args: Any) -> int:
        return 0

    @staticmethod
    def reset_peak_memory_stats(*_args: Any) -> None:
        return None

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def get_rng_state(*_args: Any) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, *_args: Any) -> None:
        torch.set_rng_state(state)


class CpuPlatform(PlatformBase):  # type: ignore[misc]
    """VERL's platform interface for a machine without accelerators (see the module docstring)."""

    _module = CpuDeviceModule()

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return self._module

    def is_available(self) -> bool:
        return True

    def current_device(self) -> Any:
        return "cpu"  # read as tensor.to(get_device_id()): the CPU, not cuda:0

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def use_cpu_platform() -> None:
    if platform_name() == "cpu":
        return
    set_platform(CpuPlatform())
    engine_module = sys.modules.get("verl.workers.engine.fsdp.transformer_impl")
    if engine_module is not None:
        # Imported before the shim: it cached the device name at import time.
        engine_module.__dict__["device_name"] = "cpu"


def platform_name() -> str | None:
    """The device name of VERL's platform if one is set already, else None (nothing is detected)."""
    from verl.plugin.platform import platform_manager

    current = platform_manager._current_platform
    return None if current is None else str(current.device_name)
