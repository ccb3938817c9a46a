"""CUDA graphs for uniform-decode steps (every request computes one token).

A decode step's shape is fixed by its batch size alone, so the forward pass
is captured once per size in `capture_sizes` and replayed with the inputs
copied into static buffers. A batch of R requests runs the graph of the
smallest captured size >= R; the padding rows compute garbage that is never
read: their slots are PAD_SLOT_ID (-1) so `reshape_and_cache` writes nothing,
and they attend over one key of block 0.

CUDA only: on CPU the runner always runs eagerly. Never imported at module
import time by CPU code paths (it only touches `torch.cuda` when used).
"""

from __future__ import annotations

from typing import Any

import torch

from paged.runner.attention.metadata import AttentionMetadata, ForwardContext
from paged.runner.block_table import PAD_SLOT_ID
from paged.runner.models.interface import CausalLM


def default_capture_sizes(max_num_reqs: int) -> list[int]:
    """1, 2, 4, then multiples of 8 up to `max_num_reqs` (vLLM's default shape)."""
    sizes = [s for s in (1, 2, 4) if s <= max_num_reqs]
    sizes += list(range(8, max_num_reqs + 1, 8))
    if sizes[-1] != max_num_reqs:
        sizes.append(max_num_reqs)
    return sizes


class CudaGraphRunner:
    """Captured decode graphs for one model and one set of KV cache tensors."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[torch.Tensor],
        max_num_reqs: int,
        max_blocks_per_req: int,
        max_model_len: int,
        device: torch.device,
        capture_sizes: list[int] | None = None,
    ) -> None:
        if device.type != "cuda":
            raise ValueError(f"device: CUDA graphs need a CUDA device, got {device}")
        self.model = model
        self.kv_caches = kv_caches
        self.device = device
        self.max_model_len = max_model_len
        self.capture_sizes = sorted(capture_sizes or default_capture_sizes(max_num_reqs))
        n = self.capture_sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_table = torch.zeros((n, max_blocks_per_req), dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((n,), PAD_SLOT_ID, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool: Any = None  # the first graph's memory pool handle, shared by the rest

    def _ctx(self, size: int) -> ForwardContext:
        metadata = AttentionMetadata(
            num_actual_tokens=size,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            slot_mapping=self.slot_mapping[:size],
            max_query_len=1,
            # The graph must serve any length: capture with the largest.
            max_seq_len=self.max_model_len,
        )
        return ForwardContext(attn_metadata=metadata, kv_caches=self.kv_caches)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first so smaller graphs reuse its memory pool."""
        for size in reversed(self.capture_sizes):
            ctx = self._ctx(size)
            ids, pos = self.input_ids[:size], self.positions[:size]
            self.model.forward(ids, pos, ctx)  # warm-up: lazy inits must not be captured
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.model.forward(ids, pos, ctx)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[size] = graph
            self.outputs[size] = out

    def padded_size(self, num_reqs: int) -> int | None:
        """The captured size that serves `num_reqs` requests, None if none is large enough."""
        for size in self.capture_sizes:
            if size >= num_reqs and size in self.graphs:
                return size
        return None

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Replay the graph for `meta.num_reqs` one-token requests; return hidden [R, H]."""
        num_reqs = meta.num_reqs
        size = self.padded_size(num_reqs)
        if size is None:
            raise ValueError(f"no CUDA graph captured for {num_reqs} requests")
        self.input_ids[:num_reqs].copy_(input_ids, non_blocking=True)
        self.input_ids[num_reqs:size].zero_()
        self.positions[:num_reqs].copy_(positions, non_blocking=True)
        self.positions[num_reqs:size].zero_()
        self.seq_lens[:num_reqs].copy_(meta.seq_lens, non_blocking=True)
        self.seq_lens[num_reqs:size].fill_(1)
        width = meta.block_table.shape[1]
        self.block_table[:num_reqs, :width].copy_(meta.block_table, non_blocking=True)
        self.block_table[num_reqs:size].zero_()
        self.slot_mapping[:num_reqs].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[num_reqs:size].fill_(PAD_SLOT_ID)
        # query_start_loc is arange for a uniform decode batch, padding included.
        self.graphs[size].replay()
        return self.outputs[size][:num_reqs]
