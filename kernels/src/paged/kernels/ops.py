"""Backend dispatch: Triton on CUDA, the torch reference elsewhere.

``set_backend("auto")`` (default) picks per call from the first tensor's device;
``"reference"`` always uses torch; ``"triton"`` always uses Triton (on CPU this
needs ``TRITON_INTERPRET=1``, which is how the tests run it). Triton is imported
only on the first Triton call, so CPU-only users never load it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import torch

from paged.kernels import reference
from paged.kernels.interface import KernelBackend
from paged.kernels.lora import LoRARowGroups as LoRARowGroups
from paged.kernels.lora import group_lora_rows as group_lora_rows
from paged.kernels.rope import RopeScaling as RopeScaling
from paged.kernels.rope import compute_cos_sin_cache as compute_cos_sin_cache

__all__ = [
    "BackendName",
    "LoRARowGroups",
    "RopeScaling",
    "apply_penalties",
    "apply_top_k_top_p",
    "backend_for",
    "compute_cos_sin_cache",
    "copy_blocks",
    "fused_add_rms_norm",
    "gelu_tanh_and_mul",
    "get_backend",
    "group_lora_rows",
    "lora_expand",
    "lora_shrink",
    "paged_attention",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "set_backend",
    "silu_and_mul",
    "use_backend",
]

BackendName = Literal["auto", "reference", "triton"]
_BACKENDS = ("auto", "reference", "triton")
_REFERENCE: KernelBackend = reference
_state: dict[str, BackendName] = {"backend": "auto"}


def set_backend(name: BackendName) -> None:
    """Choose the backend for every later op call in this process."""
    if name not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {name!r}")
    _state["backend"] = name


def get_backend() -> BackendName:
    return _state["backend"]


@contextmanager
def use_backend(name: BackendName) -> Iterator[None]:
    """Temporarily switch backend (tests, benchmarks)."""
    previous = get_backend()
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton() -> KernelBackend:
    from paged.kernels import triton_ops  # imports triton: only on first Triton use

    backend: KernelBackend = triton_ops  # mypy checks the module against the Protocol
    return backend


def backend_for(*tensors: torch.Tensor) -> KernelBackend:
    """The backend module an op on ``tensors`` runs with under the current setting."""
    name = get_backend()
    if name == "reference":
        return _REFERENCE
    if name == "triton":
        return _triton()
    if any(t.is_cuda for t in tensors) and triton_available():
        return _triton()
    return _REFERENCE


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    backend_for(key).reshape_and_cache(
        key, value, key_cache, value_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale
    )


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int,
    max_seq_len: int,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    out: torch.Tensor | None = None,
    bidirectional_ranges: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    return backend_for(query).paged_attention(
        query, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale,
        max_query_len=max_query_len, max_seq_len=max_seq_len,
        sliding_window=sliding_window, soft_cap=soft_cap, out=out,
        bidirectional_ranges=bidirectional_ranges, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return backend_for(query).rotary_embedding(
        positions, query, key, head_size, cos_sin_cache, is_neox
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, gemma_style: bool = False
) -> torch.Tensor:
    return backend_for(x).rms_norm(x, weight, eps, gemma_style=gemma_style)


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    gemma_style: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    return backend_for(x).fused_add_rms_norm(x, residual, weight, eps, gemma_style=gemma_style)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return backend_for(x).silu_and_mul(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    return backend_for(x).gelu_tanh_and_mul(x)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    return backend_for(logits).apply_top_k_top_p(logits, top_k, top_p)


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    return backend_for(logits).apply_penalties(
        logits, prompt_mask, output_counts, presence, frequency, repetition
    )


def copy_blocks(
    src: torch.Tensor, dst: torch.Tensor, src_block_ids: torch.Tensor, dst_block_ids: torch.Tensor
) -> None:
    backend_for(src, dst).copy_blocks(src, dst, src_block_ids, dst_block_ids)


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    token_slots: torch.Tensor,
    *,
    groups: LoRARowGroups | None = None,
) -> torch.Tensor:
    return backend_for(x).lora_shrink(x, lora_a, token_slots, groups=groups)


def lora_expand(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    out: torch.Tensor,
    out_offset: int,
    scaling: torch.Tensor,
    *,
    groups: LoRARowGroups | None = None,
) -> None:
    backend_for(y, out).lora_expand(y, lora_b, token_slots, out, out_offset, scaling, groups=groups)
