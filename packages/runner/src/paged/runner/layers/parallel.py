"""Tensor-parallel plumbing: the rank/size pair layers carry, and the collectives.

Layers receive their `TPGroup` explicitly (no global parallel state). The
collectives use `TPGroup.group`: torch.distributed's default process group
(None), or, with pipeline parallelism, the stage's own TP group; the worker
initialises them (gloo on CPU, NCCL on CUDA) before building the model; with
`size == 1` they are identities and torch.distributed is never touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group."""

    rank: int = 0
    size: int = 1
    # The TP ranks' own process group when pipeline stages split the world
    # (pipeline/stage.init_tp_groups); None: the default (world) group.
    group: Any = None

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"tp_size: must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tp_rank: must be in [0, {self.size}), got {self.rank}")
        if self.size > 1 and not dist.is_initialized():
            raise ValueError(
                f"tp_size={self.size} needs torch.distributed initialised first "
                "(the worker calls init_process_group before loading the model)"
            )

    def shard(self, total: int, what: str) -> tuple[int, int]:
        """(start, size) of this rank's even share of `total` (ValueError if uneven)."""
        if total % self.size != 0:
            raise ValueError(f"tensor_parallel_size {self.size} does not divide {what} ({total})")
        part = total // self.size
        return self.rank * part, part

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group (in place; returns `x`)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)
