"""Attention metadata and the forward context, passed explicitly to the model.

There is no global forward context: the model runner builds one
`ForwardContext` per step and hands it to `model.forward`, which passes it to
each attention layer.

Layout of one step's flattened batch of T tokens from R requests:

    query_start_loc  [0, q0, q0+q1, ..., T]   (int32, R+1)
    seq_lens         [s0, s1, ...]            (int32, R)   tokens in the sequence after this step
    block_table      [R, M] int32             physical block ids per request
    slot_mapping     [T] int64                block_id * block_size + offset, -1 = padding (skip)

Request r's q_r new tokens are the last q_r of its s_r tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch


class KVLayerHooks(Protocol):
    """The per-layer half of a worker-side KV connector (see `paged.runner.kv_connector`)."""

    def wait_for_layer_load(self, layer_name: str) -> None: ...

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None: ...


@dataclass
class AttentionMetadata:
    """Per-step batch layout, tensors on the model's device (see the module docstring)."""

    num_actual_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    # [T, 2] int32, multimodal models with bidirectional image attention
    # (Gemma3): query token t also sees keys [start, end), its image's span;
    # start == end for text tokens. None: plain causal attention.
    bidirectional_ranges: torch.Tensor | None = None

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens.shape[0])


@dataclass
class ForwardContext:
    """What one forward pass needs besides the token ids and positions.

    attn_metadata None (and kv_caches empty) means a profiling or warm-up run
    without a KV cache: attention is then computed causally over each call's
    tokens treated as one sequence.
    kv_caches[i] belongs to the i-th attention layer, in the order of the
    model's `kv_cache_specs()`.
    layer_metadata, for hybrid models with several KV cache groups, gives
    layer i the metadata of its group (its own block table and slot mapping;
    the token layout is the same for every group). None: every layer uses
    attn_metadata.
    kv_connector, when set, is called around every attention layer: the
    model calls `wait_for_layer_load(i)` before layer i reads its cache and
    `save_kv_layer(i)` after it wrote it; layer_names[i] names layer i (the
    keys of the model's `kv_cache_specs()`).
    """

    attn_metadata: AttentionMetadata | None
    kv_caches: list[torch.Tensor] = field(default_factory=list)
    layer_metadata: Sequence[AttentionMetadata] | None = None
    kv_connector: KVLayerHooks | None = None
    layer_names: Sequence[str] = ()

    def __post_init__(self) -> None:
        if self.kv_connector is not None and len(self.layer_names) != len(self.kv_caches):
            raise ValueError(
                f"ForwardContext: {len(self.layer_names)} layer names for "
                f"{len(self.kv_caches)} KV caches (a KV connector needs one name per layer)"
            )

    def metadata_for(self, layer_idx: int) -> AttentionMetadata | None:
        """The attention metadata layer `layer_idx` reads and writes its cache with."""
        if self.layer_metadata is None:
            return self.attn_metadata
        return self.layer_metadata[layer_idx]

    def wait_for_layer_load(self, layer_idx: int) -> None:
        """Block until the connector has loaded layer `layer_idx`'s KV (no-op without one)."""
        if self.kv_connector is not None:
            self.kv_connector.wait_for_layer_load(self.layer_names[layer_idx])

    def save_kv_layer(self, layer_idx: int) -> None:
        """Hand layer `layer_idx`'s freshly written cache to the connector (no-op without one)."""
        if self.kv_connector is not None:
            self.kv_connector.save_kv_layer(self.layer_names[layer_idx], self.kv_caches[layer_idx])
