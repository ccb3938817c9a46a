"""Attention backends: which kernels run attention, chosen per device, overridable.

    torch   batched pure torch (attention/torch_attention.py, checked against
            paged.kernels.reference; CPU default, also runs on CUDA)
    triton  paged.kernels.triton_ops (CUDA default; on CPU only under TRITON_INTERPRET=1)

Both consume the same `AttentionMetadata`, so they share one metadata
builder; the backend object is what the model runner asks for the builder,
as in vLLM v1 (backend -> builder -> metadata).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Literal, Protocol, cast

import torch

from paged.runner.attention.metadata import AttentionMetadata

AttentionBackendName = Literal["torch", "triton"]


class AttentionKernels(Protocol):
    """The two ops an attention backend provides (paged.kernels signatures)."""

    def reshape_and_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None: ...

    def paged_attention(
        self,
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
    ) -> torch.Tensor: ...


class AttentionMetadataBuilder:
    """Turns the runner's (possibly over-allocated) step buffers into AttentionMetadata.

    The runner keeps persistent buffers sized for the largest batch; build()
    slices them to this step's requests and tokens. max_query_len and
    max_seq_len are passed in as Python ints (the runner knows them from its
    host-side copies), so building never synchronises with the device.
    """

    def build(
        self,
        *,
        num_reqs: int,
        num_actual_tokens: int,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        max_query_len: int,
        max_seq_len: int,
    ) -> AttentionMetadata:
        if num_reqs < 0 or query_start_loc.shape[0] < num_reqs + 1:
            raise ValueError(
                f"query_start_loc has {query_start_loc.shape[0]} entries, need num_reqs + 1 = "
                f"{num_reqs + 1}"
            )
        if seq_lens.shape[0] < num_reqs or block_table.shape[0] < num_reqs:
            raise ValueError(f"seq_lens and block_table need at least num_reqs={num_reqs} rows")
        if slot_mapping.shape[0] < num_actual_tokens:
            raise ValueError(
                f"slot_mapping has {slot_mapping.shape[0]} entries, need {num_actual_tokens}"
            )
        return AttentionMetadata(
            num_actual_tokens=num_actual_tokens,
            query_start_loc=query_start_loc[: num_reqs + 1],
            seq_lens=seq_lens[:num_reqs],
            block_table=block_table[:num_reqs],
            slot_mapping=slot_mapping[:num_actual_tokens],
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
        )


@dataclass(frozen=True)
class AttentionBackend:
    """A named kernel set for attention (reshape_and_cache + paged_attention)."""

    name: AttentionBackendName

    @property
    def kernels(self) -> AttentionKernels:
        # Imported on use: the Triton module imports triton, which CPU-only
        # users never need.
        if self.name == "torch":
            module = "paged.runner.attention.torch_attention"
        else:
            module = "paged.kernels.triton_ops"
        return cast(AttentionKernels, importlib.import_module(module))

    def get_builder(self) -> AttentionMetadataBuilder:
        return AttentionMetadataBuilder()


def select_attention_backend(
    device: torch.device | str, override: str | None = None
) -> AttentionBackend:
    """`override` ("torch"/"triton") wins; "auto"/None = triton on CUDA, torch elsewhere."""
    if override not in (None, "auto", "torch", "triton"):
        raise ValueError(f"attention_backend: {override!r} is unknown; use auto, torch or triton")
    if override in ("torch", "triton"):
        return AttentionBackend(cast(AttentionBackendName, override))
    return AttentionBackend("triton" if torch.device(device).type == "cuda" else "torch")
