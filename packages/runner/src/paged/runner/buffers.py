"""`CpuGpuBuffer`: a host tensor, its numpy view and a device twin.

The runner fills inputs on the host with numpy (fast, no autograd, no
dispatch overhead), then issues one copy per buffer to the device. On CUDA
the host side is pinned so `copy_to_gpu(..., non_blocking=True)` is a real
asynchronous DMA that overlaps the CPU work issued after it. On CPU the
"device" tensor IS the host tensor (no copy at all).
"""

from __future__ import annotations

from typing import Any

import numpy.typing as npt
import torch


class CpuGpuBuffer:
    """A preallocated `[*shape]` buffer with `.cpu` (host), `.np` (numpy view) and `.gpu`.

    `.np` shares memory with `.cpu`: writes through either are the same
    write. `copy_to_gpu(n)` copies the first `n` rows (all when `n` is None)
    and returns the device slice.
    """

    def __init__(
        self,
        *shape: int,
        dtype: torch.dtype,
        device: torch.device | str,
        pin_memory: bool | None = None,
    ) -> None:
        if not shape or any(s < 0 for s in shape):
            raise ValueError(f"shape must be non-empty and non-negative, got {shape}")
        self.device = torch.device(device)
        if pin_memory is None:
            pin_memory = self.device.type == "cuda" and torch.cuda.is_available()
        self.cpu = torch.zeros(shape, dtype=dtype, pin_memory=pin_memory)
        self.np: npt.NDArray[Any] = self.cpu.numpy()
        # On CPU the device twin is the same storage: `copy_to_gpu` is free.
        self.gpu = (
            self.cpu
            if self.device.type == "cpu"
            else torch.zeros_like(self.cpu, device=self.device)
        )

    @property
    def shares_storage(self) -> bool:
        """True when host and device tensors are one tensor (CPU device)."""
        return self.gpu is self.cpu

    def copy_to_gpu(self, n: int | None = None) -> torch.Tensor:
        """Copy rows `[:n]` host -> device (non-blocking) and return the device slice."""
        if n is None:
            if not self.shares_storage:
                self.gpu.copy_(self.cpu, non_blocking=True)
            return self.gpu
        if n < 0 or n > self.cpu.shape[0]:
            raise ValueError(f"n must be in [0, {self.cpu.shape[0]}], got {n}")
        if not self.shares_storage:
            self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)
        return self.gpu[:n]

    def copy_to_cpu(self, n: int | None = None) -> torch.Tensor:
        """Copy rows `[:n]` device -> host (blocking) and return the host slice."""
        end = self.cpu.shape[0] if n is None else n
        if not self.shares_storage:
            self.cpu[:end].copy_(self.gpu[:end])
        return self.cpu[:end]
