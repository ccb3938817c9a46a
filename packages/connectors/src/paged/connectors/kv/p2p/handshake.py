"""The handshake between a decoder and a prefill engine: do their KV caches agree?

On first contact with a prefill engine (per TP rank) the decoder sends its
`KVLayoutInfo` and gets the prefill's back; each side runs `check_compatible`.
Blocks are copied byte for byte, so everything that decides what a block's
bytes mean must match: the model, the KV dtype, the block size, the layout
of a block (`[2, block_size, num_kv_heads, head_size]`, K then V), the layer
count and names, and the tensor-parallel size (heterogeneous TP, where a
decode rank would assemble heads from several prefill ranks, is not
supported). A mismatch names the first field that differs.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec
import torch


class KVHandshakeError(RuntimeError):
    """The two engines' KV caches are not compatible; the message names the field."""


class KVLayoutInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one worker's KV cache looks like (the handshake payload)."""

    engine_id: str
    model: str
    dtype: str
    block_size: int
    kv_layout: str  # shape of one block of one layer, e.g. "2x16x4x64" (K/V, tokens, heads, dim)
    num_layers: int
    tp_size: int
    tp_rank: int
    layer_names: list[str]


# Checked in this order: the first one that differs is the one reported.
_CHECKED = ("model", "dtype", "block_size", "kv_layout", "num_layers", "tp_size", "layer_names")


def layout_info(
    engine_id: str,
    model: str,
    block_size: int,
    tp_size: int,
    tp_rank: int,
    kv_caches: Mapping[str, torch.Tensor],
) -> KVLayoutInfo:
    """This worker's `KVLayoutInfo`, from its registered KV caches."""
    if not kv_caches:
        raise ValueError("no KV caches registered")
    first = next(iter(kv_caches.values()))
    for name, cache in kv_caches.items():
        if cache.shape[2:] != first.shape[2:] or cache.dtype != first.dtype:
            raise ValueError(f"layer {name!r} has a different KV block layout from the others")
    two, _, size, heads, dim = first.shape
    if size != block_size:
        raise ValueError(f"KV cache block size {size} differs from the engine's {block_size}")
    return KVLayoutInfo(
        engine_id=engine_id,
        model=model,
        dtype=str(first.dtype).removeprefix("torch."),
        block_size=block_size,
        kv_layout=f"{two}x{size}x{heads}x{dim}",
        num_layers=len(kv_caches),
        tp_size=tp_size,
        tp_rank=tp_rank,
        layer_names=list(kv_caches),
    )


def check_compatible(local: KVLayoutInfo, remote: KVLayoutInfo) -> None:
    """`KVHandshakeError` naming the first field where the two engines differ."""
    for field in _CHECKED:
        mine, theirs = getattr(local, field), getattr(remote, field)
        if mine != theirs:
            if field == "layer_names":
                mine, theirs = _first_difference(mine, theirs)
            hint = (
                " (heterogeneous tensor parallelism is not supported)" if field == "tp_size" else ""
            )
            raise KVHandshakeError(
                f"KV transfer handshake with engine {remote.engine_id!r} failed: {field} "
                f"differs (local {mine!r}, remote {theirs!r}){hint}"
            )


def _first_difference(a: list[str], b: list[str]) -> tuple[str, str]:
    for x, y in zip(a, b, strict=False):
        if x != y:
            return x, y
    return (a[len(b)] if len(a) > len(b) else "<none>"), (
        b[len(a)] if len(b) > len(a) else "<none>"
    )
