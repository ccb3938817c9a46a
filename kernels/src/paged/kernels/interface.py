"""``KernelBackend``: the op set every backend module provides, with one signature.

``paged.kernels.reference`` and ``paged.kernels.triton_ops`` are *modules* that
satisfy this Protocol structurally; mypy checks it where ``paged.kernels.ops``
assigns them to a ``KernelBackend`` variable, so the two cannot drift apart.
Shapes: T tokens, R requests, Hq/Hkv query/KV heads, D head size, N blocks of
B tokens, M block-table columns, V vocab. LoRA: S adapter slots, Rk max rank, In/N a layer's
in/out features, W the width of a (fused) output.
"""

from __future__ import annotations

from typing import Protocol

import torch

from paged.kernels.lora import LoRARowGroups
from paged.kernels.rope import RopeScaling


class KernelBackend(Protocol):
    def reshape_and_cache(
        self,
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        key_cache: torch.Tensor,  # [N, B, Hkv, D]
        value_cache: torch.Tensor,  # [N, B, Hkv, D]
        slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
        *,
        k_scale: float = 1.0,  # per-tensor fp8 scales (kv_quant); ignored by float caches
        v_scale: float = 1.0,
    ) -> None: ...

    def paged_attention(
        self,
        query: torch.Tensor,  # [T, Hq, D]
        key_cache: torch.Tensor,  # [N, B, Hkv, D]
        value_cache: torch.Tensor,  # [N, B, Hkv, D]
        block_table: torch.Tensor,  # [R, M] int32
        query_start_loc: torch.Tensor,  # [R + 1] int32
        seq_lens: torch.Tensor,  # [R] int32
        scale: float,
        *,
        max_query_len: int,
        max_seq_len: int,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
        out: torch.Tensor | None = None,
        bidirectional_ranges: torch.Tensor | None = None,  # [T, 2] int32
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor: ...

    def compute_cos_sin_cache(
        self,
        rotary_dim: int,
        max_position: int,
        base: float,
        rope_scaling: RopeScaling | None,
        dtype: torch.dtype,
    ) -> torch.Tensor: ...

    def rotary_embedding(
        self,
        positions: torch.Tensor,  # [T]
        query: torch.Tensor,  # [T, Hq * D]
        key: torch.Tensor,  # [T, Hkv * D]
        head_size: int,
        cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim]
        is_neox: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, *, gemma_style: bool = False
    ) -> torch.Tensor: ...

    def fused_add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        *,
        gemma_style: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor: ...

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor: ...

    def apply_top_k_top_p(
        self, logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
    ) -> torch.Tensor: ...

    def apply_penalties(
        self,
        logits: torch.Tensor,
        prompt_mask: torch.Tensor,
        output_counts: torch.Tensor,
        presence: torch.Tensor,
        frequency: torch.Tensor,
        repetition: torch.Tensor,
    ) -> torch.Tensor: ...

    def copy_blocks(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        src_block_ids: torch.Tensor,
        dst_block_ids: torch.Tensor,
    ) -> None: ...

    def lora_shrink(
        self,
        x: torch.Tensor,  # [T, In]
        lora_a: torch.Tensor,  # [S, Rk, In]
        token_slots: torch.Tensor,  # [T] int32/int64, -1 = no adapter
        *,
        groups: LoRARowGroups | None = None,  # group_lora_rows(token_slots), once per step
    ) -> torch.Tensor: ...  # [T, Rk], dtype of x, zero rows where slot == -1

    def lora_expand(
        self,
        y: torch.Tensor,  # [T, Rk]
        lora_b: torch.Tensor,  # [S, N, Rk]
        token_slots: torch.Tensor,  # [T]
        out: torch.Tensor,  # [T, W]: out[:, off:off+N] += scaling[slot] * y @ B^T, in place
        out_offset: int,
        scaling: torch.Tensor,  # [S] float32
        *,
        groups: LoRARowGroups | None = None,
    ) -> None: ...
