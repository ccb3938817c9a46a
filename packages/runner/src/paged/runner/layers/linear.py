"""Linear layers, replicated and tensor-parallel (Megatron-style).

    ColumnParallelLinear   y = x W^T, W split by OUTPUT rows: rank r holds rows
                           [r*O/tp, (r+1)*O/tp); output stays sharded.
    RowParallelLinear      W split by INPUT columns; the input is the sharded
                           output of a column-parallel layer; partial sums are
                           all-reduced, then the (unsharded) bias is added once.
    MergedColumnParallel   several column-parallel outputs in one matmul
                           (gate_proj + up_proj): each part is split per rank,
                           so rank r holds [gate_r | up_r].
    QKVParallelLinear      q, k, v projections merged the same way, split by
                           heads: rank r holds [q heads_r | k heads_r | v heads_r]
                           (layers/head_partition.py: which heads, including
                           replicated KV heads and uneven splits).

Checkpoints store the full, unsharded tensors; `load_weight(name, tensor,
shard_id)` cuts out this rank's share and checks the full shape, so a
checkpoint that disagrees with config.json fails with a message naming the
tensor instead of a broadcasting error.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from paged.runner.layers.cpu_panels import make_panels, panel_matmul, use_panels
from paged.runner.layers.head_partition import head_shard
from paged.runner.layers.parallel import TPGroup
from paged.runner.layers.quant_staging import QuantStaging
from paged.runner.layers.quantized_linear import (
    QuantizedCheckpointTensor,
    QuantizedMatmul,
    QuantReport,
    linear_forward,
)

# What a checkpoint hands to load_weight: a plain tensor, or quantised blocks
# (kept quantised by a layer that is staging a quantised load).
CheckpointTensor = torch.Tensor | QuantizedCheckpointTensor


class LinearDelta(Protocol):
    """Adds a per-row correction to a layer's output (a LoRA delta, lora/layer.py)."""

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y [T, out_local] += delta(x [T, in_local]), in place, before any collective."""


def check_shape(what: str, loaded: CheckpointTensor, expected: tuple[int, ...]) -> None:
    """ValueError naming the tensor if the checkpoint shape is not the one the config implies."""
    if tuple(loaded.shape) != expected:
        raise ValueError(
            f"{what} has shape {tuple(loaded.shape)} but the model config implies {expected}; "
            "the weights do not match config.json"
        )


def _empty(*shape: int, dtype: torch.dtype, device: torch.device | None) -> nn.Parameter:
    # Uninitialised on purpose: every parameter is overwritten by the loader,
    # and random init of a large model would cost seconds.
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def _linear_weight(
    out_features: int, in_features: int, *, dtype: torch.dtype, device: torch.device | None
) -> nn.Parameter:
    """An [out, in] weight; on CPU stored column-major (a transposed [in, out] tensor).

    Same values and shape either way. On CPU, F.linear with the weight stored
    as [in, out] rows runs x @ W^T as a plain row-major GEMM, measured 1.3-2x
    faster at 8-64 rows than with [out, in] rows (the decode batch sizes) and
    no slower at 1 or 2048 rows. CUDA keeps the usual row-major layout.
    """
    weight = _empty(out_features, in_features, dtype=dtype, device=device)
    if weight.device.type != "cpu":
        return weight
    transposed = torch.empty(in_features, out_features, dtype=dtype, device=weight.device)
    return nn.Parameter(transposed.t(), requires_grad=False)


class ShardedLinear(nn.Module, ABC):
    """y = x W^T + b over this rank's share of W; subclasses define how W is split.

    `weight` is [out_local, in_local]; `bias` (if any) is [out_local] for
    column splits and [out] for row splits.
    """

    def __init__(
        self,
        in_local: int,
        out_local: int,
        *,
        bias: bool,
        bias_size: int | None = None,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.weight = _linear_weight(out_local, in_local, dtype=dtype, device=device)
        self.bias: nn.Parameter | None = (
            _empty(bias_size or out_local, dtype=dtype, device=device) if bias else None
        )
        # A column-panel copy of `weight` for multi-row CPU GEMMs, built after
        # loading (layers/cpu_panels.py); None until then and after any reload.
        self.cpu_panels: torch.Tensor | None = None
        # Quantised weights (layers/quantized_linear.py): `quant_staging` receives the
        # checkpoint's rows while loading, `quant` is the kernel that replaces `weight`.
        self.quant_staging: QuantStaging | None = None
        self.quant: QuantizedMatmul | None = None
        # LoRA adapters on this layer (set by the runner's LoRA manager; None: base only).
        # Added to the local output before a row-parallel all-reduce (see lora/layer.py).
        self.lora: LinearDelta | None = None

    def start_quantized_load(self) -> None:
        """Stage the next weight loads so that quantised checkpoint rows stay quantised."""
        self.quant_staging = QuantStaging(*self.weight.shape)

    def finish_quantized_load(self, dtype: torch.dtype) -> QuantReport:
        """Turn the staged rows into this layer's kernel; the dense weight is released."""
        if self.quant_staging is None:
            raise ValueError(f"{type(self).__name__}: start_quantized_load was not called")
        self.quant = self.quant_staging.finalize(dtype)
        self.quant_staging = None
        # Only the shape is kept (expected_weights, error messages): no memory behind it.
        self.weight = nn.Parameter(
            torch.empty(self.weight.shape, dtype=dtype, device="meta"), requires_grad=False
        )
        return self.quant.report

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)

    def build_cpu_panels(self) -> None:
        """Keep a panelled copy of the loaded weight (CPU, 2+ rows run through it)."""
        self.cpu_panels = make_panels(self.weight.detach())

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ bias), through the quantised kernel or the panels when they pay off."""
        if self.quant is not None:
            y = linear_forward(self.quant, x)
            return y if bias is None else y.add_(bias)
        if use_panels(x, self.cpu_panels):
            assert self.cpu_panels is not None
            y = panel_matmul(x, self.cpu_panels, self.weight.shape[0])
            return y if bias is None else y.add_(bias)
        return F.linear(x, self.weight, bias)

    @abstractmethod
    def load_weight(self, name: str, loaded: CheckpointTensor, shard_id: str | int | None) -> None:
        """Copy this rank's share of the full checkpoint tensor `loaded` into `name`."""

    def _param(self, name: str) -> Any:
        """The parameter a load_weight call writes; drops panels built from the old values.

        While a quantised load is staged, "weight" is the QuantStaging (it takes
        the same `.data.narrow(0, ...).copy_(...)` calls), hence `Any`.
        """
        if name == "weight" and self.quant_staging is not None:
            return self.quant_staging
        param = self.weight if name == "weight" else self.bias
        if param is None or name not in ("weight", "bias"):
            raise ValueError(f"{type(self).__name__} has no parameter {name!r}")
        self.cpu_panels = None
        return param


class ReplicatedLinear(ShardedLinear):
    """Every rank holds the whole weight."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = False,
        dtype: torch.dtype,
        device: torch.device | None = None,
    ) -> None:
        super().__init__(
            input_size, output_size, bias=bias, tp=TPGroup(), dtype=dtype, device=device
        )

    def load_weight(self, name: str, loaded: CheckpointTensor, shard_id: str | int | None) -> None:
        param = self._param(name)
        check_shape(name, loaded, tuple(param.shape))
        param.data.copy_(loaded)


class ColumnParallelLinear(ShardedLinear):
    """Output features split across ranks; the output stays sharded unless gather_output."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = False,
        gather_output: bool = False,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device | None = None,
        shard: tuple[int, int] | None = None,
    ) -> None:
        # shard: (start, size) of this rank's output rows; None is the even split.
        self.output_size = output_size
        self.out_start, out_local = shard or tp.shard(output_size, "the output features")
        super().__init__(input_size, out_local, bias=bias, tp=tp, dtype=dtype, device=device)
        self.gather_output = gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x, self.bias)
        if self.lora is not None:
            self.lora.add_to(x, y)
        return self.tp.all_gather_last_dim(y) if self.gather_output else y

    def load_weight(self, name: str, loaded: CheckpointTensor, shard_id: str | int | None) -> None:
        param = self._param(name)
        check_shape(name, loaded, (self.output_size, *param.shape[1:]))
        param.data.copy_(loaded.narrow(0, self.out_start, param.shape[0]))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one weight.

    load_weight's shard_id is the index of the part (0 = gate, 1 = up for an MLP).
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        *,
        bias: bool = False,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device | None = None,
    ) -> None:
        for size in output_sizes:
            tp.shard(size, "a merged projection's output features")
        self.output_sizes = list(output_sizes)
        super().__init__(
            input_size, sum(output_sizes), bias=bias, tp=tp, dtype=dtype, device=device
        )

    def load_weight(self, name: str, loaded: CheckpointTensor, shard_id: str | int | None) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id must index output_sizes, got {shard_id!r}")
        param = self._param(name)
        full = self.output_sizes[shard_id]
        check_shape(name, loaded, (full, *param.shape[1:]))
        start, local = self.tp.shard(full, "a merged projection")
        offset = sum(self.output_sizes[:shard_id]) // self.tp.size
        param.data.narrow(0, offset, local).copy_(loaded.narrow(0, start, local))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one weight, split by heads (shard_id "q", "k" or "v")."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        *,
        bias: bool = False,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device | None = None,
    ) -> None:
        self.heads = head_shard(total_num_heads, total_num_kv_heads, tp.rank, tp.size)
        self.num_heads = self.heads.num_heads
        self.num_kv_heads = self.heads.num_kv_heads
        self.head_size = head_size
        self.total_heads = {"q": total_num_heads, "k": total_num_kv_heads, "v": total_num_kv_heads}
        total = (total_num_heads + 2 * total_num_kv_heads) * head_size
        local = (self.num_heads + 2 * self.num_kv_heads) * head_size
        # out_start is not used: the q, k and v rows come from three ranges.
        super().__init__(
            hidden_size, total, bias=bias, tp=tp, dtype=dtype, device=device, shard=(0, local)
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_size

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_size

    @property
    def o_proj_shard(self) -> tuple[int, int]:
        """(start, size) of o_proj's input columns that this rank's q heads produce."""
        return self.heads.q_start * self.head_size, self.q_size

    def load_weight(self, name: str, loaded: CheckpointTensor, shard_id: str | int | None) -> None:
        if shard_id not in ("q", "k", "v"):
            raise ValueError(f"shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        param = self._param(name)
        full = self.total_heads[shard_id] * self.head_size
        check_shape(name, loaded, (full, *param.shape[1:]))
        local = self.q_size if shard_id == "q" else self.kv_size
        offset = {"q": 0, "k": self.q_size, "v": self.q_size + self.kv_size}[shard_id]
        first = self.heads.q_start if shard_id == "q" else self.heads.kv_start
        start = first * self.head_size
        param.data.narrow(0, offset, local).copy_(loaded.narrow(0, start, local))


class RowParallelLinear(ShardedLinear):
    """Input features split across ranks; partial products are summed over the group."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = False,
        reduce_results: bool = True,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device | None = None,
        shard: tuple[int, int] | None = None,
    ) -> None:
        # shard: (start, size) of this rank's input columns; None is the even split
        # (o_proj passes QKVParallelLinear.o_proj_shard, which may be uneven).
        self.input_size = input_size
        self.in_start, in_local = shard or tp.shard(input_size, "the input features")
        super().__init__(
            in_local, output_size, bias=bias, bias_size=output_size, tp=tp, dtype=dtype,
            device=device,
        )  # fmt: skip
        self.reduce_results = reduce_results

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x)
        if self.lora is not None:
            self.lora.add_to(x, y)  # this rank's partial delta: the all-reduce sums it
        if self.reduce_results:
            y = self.tp.all_reduce(y)
        # The bias is added after the sum so that it counts once, not tp times.
        return y + self.bias if self.bias is not None else y

    def load_weight(self, name: str, loaded: CheckpointTensor, shard_id: str | int | None) -> None:
        param = self._param(name)
        if name == "bias":
            check_shape(name, loaded, tuple(param.shape))
            param.data.copy_(loaded)
            return
        check_shape(name, loaded, (param.shape[0], self.input_size))
        param.data.copy_(loaded.narrow(1, self.in_start, param.shape[1]))
