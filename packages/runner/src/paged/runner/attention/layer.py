"""The Attention layer: write this step's K/V into the paged cache, then attend.

    q [T, Hq*D], k/v [T, Hkv*D]
      -> reshape_and_cache(k, v, kv_cache[0], kv_cache[1], slot_mapping)
      -> paged_attention(q, caches, block_table, query_start_loc, seq_lens)
      -> [T, Hq*D]

T may exceed attn_metadata.num_actual_tokens (CUDA-graph padding); padded
rows are neither cached (their slots are -1) nor attended, and come out zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paged.runner.attention import cpu_decode
from paged.runner.attention.backends import AttentionBackend
from paged.runner.attention.metadata import AttentionMetadata


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        *,
        backend: AttentionBackend,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        layer_name: str = "",
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.backend = backend
        self.kernels = backend.kernels
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.layer_name = layer_name
        # Per-tensor scales of an fp8 KV cache (--kv-cache-dtype fp8*): stored = K / k_scale.
        # 1.0 is vLLM 0.33's default when the checkpoint has none; float caches ignore them.
        self.k_scale = 1.0
        self.v_scale = 1.0
        # The torch backend may take a CPU decode step in one C call (attention/cpu_decode.py).
        self._cpu_decode = backend.name == "torch"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata | None,
    ) -> torch.Tensor:
        num_tokens = query.shape[0]
        if self._cpu_decode and attn_metadata is not None and kv_cache is not None:
            plan = cpu_decode.decode_plan(attn_metadata, num_tokens)
            if plan is not None and cpu_decode.native_decode_ok(kv_cache, query):
                return cpu_decode.decode_attention(
                    plan, query, key, value, kv_cache, self.scale,
                    self.sliding_window, self.logits_soft_cap,
                )  # fmt: skip
        q = query.view(num_tokens, self.num_heads, self.head_size)
        k = key.view(num_tokens, self.num_kv_heads, self.head_size)
        v = value.contiguous().view(num_tokens, self.num_kv_heads, self.head_size)
        if attn_metadata is None or kv_cache is None:
            return self._forward_no_cache(q, k, v).reshape(num_tokens, -1)
        n = attn_metadata.num_actual_tokens
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        self.kernels.reshape_and_cache(
            k[:n], v[:n], key_cache, value_cache, attn_metadata.slot_mapping[:n],
            k_scale=self.k_scale, v_scale=self.v_scale,
        )  # fmt: skip
        out = torch.zeros_like(q) if n < num_tokens else torch.empty_like(q)
        ranges = attn_metadata.bidirectional_ranges
        self.kernels.paged_attention(
            q[:n],
            key_cache,
            value_cache,
            attn_metadata.block_table,
            attn_metadata.query_start_loc,
            attn_metadata.seq_lens,
            self.scale,
            max_query_len=attn_metadata.max_query_len,
            max_seq_len=attn_metadata.max_seq_len,
            sliding_window=self.sliding_window,
            soft_cap=self.logits_soft_cap,
            out=out[:n],
            bidirectional_ranges=None if ranges is None else ranges[:n],
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )
        return out.reshape(num_tokens, -1)

    def _forward_no_cache(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Profiling / warm-up run: all tokens are one causal sequence, nothing cached."""
        group = self.num_heads // self.num_kv_heads
        qh = q.transpose(0, 1)
        kh = k.repeat_interleave(group, dim=1).transpose(0, 1)
        vh = v.repeat_interleave(group, dim=1).transpose(0, 1)
        t = q.shape[0]
        pos = torch.arange(t, device=q.device)
        mask = pos[None, :] <= pos[:, None]
        if self.sliding_window is not None:
            mask &= pos[:, None] - pos[None, :] < self.sliding_window
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=self.scale)
        return out.transpose(0, 1)
