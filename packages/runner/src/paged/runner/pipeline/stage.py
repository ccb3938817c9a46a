"""`PipelineStage`: where a rank sits (pp rank, tp rank) and how it talks to its neighbours.

Rank layout (vLLM's, tensor parallelism innermost):

    rank = pp_rank * tp_size + tp_rank
    TP=2, PP=2:  stage 0 = ranks {0, 1}, stage 1 = ranks {2, 3}

Each rank sends its stage's output to the rank with the same tp_rank in the
next stage and receives from the one in the previous stage (the hidden states
are replicated across a TP group after its all-reduce, so every TP rank has
the whole tensor). Transfers are torch.distributed point-to-point on the
default (world) group: gloo on CPU, NCCL on CUDA. A send is asynchronous
(`isend`): the stage starts its next micro-batch while the message drains; the
previous send is waited for before the next one, so one is in flight at most.

TP collectives inside a stage need their own process group once there are
several stages (`init_tp_groups`); with one stage they keep the world group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from paged.runner.pipeline.tensors import IntermediateTensors


@dataclass(frozen=True)
class PipelineStage:
    """This rank's coordinates; PipelineStage() is the single-stage, single-rank case."""

    pp_rank: int = 0
    pp_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.pp_size < 1 or self.tp_size < 1:
            raise ValueError(
                f"pp_size and tp_size must be >= 1, got {self.pp_size}, {self.tp_size}"
            )
        if not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"pp_rank: must be in [0, {self.pp_size}), got {self.pp_rank}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank: must be in [0, {self.tp_size}), got {self.tp_rank}")

    @classmethod
    def of_rank(cls, rank: int, tp_size: int, pp_size: int) -> PipelineStage:
        """The coordinates of global `rank` in a TP x PP world."""
        world = tp_size * pp_size
        if not 0 <= rank < world:
            raise ValueError(f"rank: must be in [0, {world}), got {rank}")
        return cls(
            pp_rank=rank // tp_size, pp_size=pp_size, tp_rank=rank % tp_size, tp_size=tp_size
        )

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.pp_size * self.tp_size

    @property
    def is_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def tp_ranks(self) -> list[int]:
        """Global ranks of this stage's tensor-parallel group."""
        return [self.pp_rank * self.tp_size + t for t in range(self.tp_size)]


def output_rank(tp_size: int, pp_size: int) -> int:
    """The rank whose answers the executor returns: TP rank 0 of the last stage (it samples)."""
    return (pp_size - 1) * tp_size


def init_tp_groups(stage: PipelineStage) -> dist.ProcessGroup | None:
    """This rank's TP process group (None: the world group serves, one stage or TP=1).

    Every rank must call this in the same order: `new_group` is collective
    over the world, one call per stage.
    """
    if stage.pp_size == 1 or stage.tp_size == 1:
        return None
    mine: dist.ProcessGroup | None = None
    for pp_rank in range(stage.pp_size):
        ranks = [pp_rank * stage.tp_size + t for t in range(stage.tp_size)]
        group = dist.new_group(ranks)
        if pp_rank == stage.pp_rank and isinstance(group, dist.ProcessGroup):
            mine = group
    return mine


class StageLink:
    """Point-to-point transfer of `IntermediateTensors` between neighbouring stages."""

    def __init__(self, stage: PipelineStage, device: torch.device) -> None:
        if stage.pp_size > 1 and not dist.is_initialized():
            raise ValueError("pipeline_parallel_size > 1 needs torch.distributed initialised first")
        self.stage = stage
        self.device = device
        self._pending_send: dist.Work | None = None
        self._send_buffer: torch.Tensor | None = None  # alive until its send completes

    def recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype) -> IntermediateTensors:
        """The previous stage's output for this micro-batch (blocks until it arrives)."""
        if self.stage.is_first:
            raise RuntimeError("the first pipeline stage receives nothing")
        buffer = torch.empty(2, num_tokens, hidden_size, dtype=dtype, device=self.device)
        src = self.stage.rank - self.stage.tp_size
        dist.recv(buffer, src=src)
        return IntermediateTensors.unpack(buffer)

    def send(self, tensors: IntermediateTensors) -> None:
        """Start sending this micro-batch's output to the next stage (waits for the last send)."""
        if self.stage.is_last:
            raise RuntimeError("the last pipeline stage sends nothing")
        self.wait()
        packed = tensors.packed().contiguous()
        dst = self.stage.rank + self.stage.tp_size
        self._send_buffer = packed
        self._pending_send = dist.isend(packed, dst=dst)

    def wait(self) -> None:
        """Block until the last send is complete."""
        if self._pending_send is not None:
            work, self._pending_send = self._pending_send, None
            work.wait()
        self._send_buffer = None


@dataclass(frozen=True)
class StageSetup:
    """What a worker hands its runner and loader about its place in a TP x PP world.

    tp_group: the stage's TP process group (`init_tp_groups`; None: the world group).
    pp_layer_partition: `ParallelConfig.pp_layer_partition` (None: vLLM's even split).
    """

    stage: PipelineStage
    tp_group: Any = None
    pp_layer_partition: str | None = None

    @property
    def is_pipelined(self) -> bool:
        return self.stage.pp_size > 1
