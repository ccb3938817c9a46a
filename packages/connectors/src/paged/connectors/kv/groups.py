"""KV cache groups as a connector sees them: which blocks of each group a resume needs.

A hybrid model (Gemma 3: sliding-window and global layers) has several KV
cache groups. Every group holds one block table per request, position i
covering tokens `[i * B, (i + 1) * B)`; all groups hash the same chain of
block hashes (connectors require one block size for every group). A
sliding-window group keeps only the blocks of the window: the KV cache
manager puts the null block at the positions before it.

A request resumed with `end` tokens computed attends, for its next token,
to tokens `end - W + 1 .. end` in a group of window W, so that group needs
only blocks from `window_start_block(W, end)` on (the same count the KV cache
manager skips: `SlidingWindowManager.get_num_skipped_tokens`):

    B = 4, W = 6, end = 16     tokens 0 .. 15
    full group      needs  [b0 b1 b2 b3]
    sliding group   needs        [b2 b3]   (tokens 11..15: blocks 2 and 3)

That is all a connector stores or moves for a sliding group (vLLM 0.33 does
the same: offloading/config.py:61-72 sizes the window in chunks,
nixl/base_scheduler.py:140-151 clips the blocks it exchanges).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from paged.kvcache import (
    FullAttentionSpec,
    KVCacheConfig,
    SlidingWindowSpec,
)


@dataclass(frozen=True)
class GroupLayout:
    """One KV cache group, in the scheduler's group order.

    layer_names: the group's layers (their caches are indexed by this group's block ids).
    sliding_window: tokens of the window, or None for full attention.
    block_bytes: bytes of one block id across this group's layers on one rank.
    """

    layer_names: tuple[str, ...]
    sliding_window: int | None = None
    block_bytes: int = 0

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.block_bytes < 0:
            raise ValueError(f"block_bytes must be >= 0, got {self.block_bytes}")


def window_start_block(sliding_window: int | None, end: int, block_size: int) -> int:
    """The first block a group needs to resume with `end` tokens computed (0: full attention)."""
    if sliding_window is None:
        return 0
    return max(0, end - sliding_window + 1) // block_size


def group_layouts(config: KVCacheConfig, block_size: int) -> tuple[GroupLayout, ...]:
    """The connector view of an engine's groups; `ValueError` naming what a connector cannot carry.

    Connectors carry full-attention and sliding-window groups that share the
    engine's block size (so every group's chunk i covers the same tokens and
    the same block hash names it).
    """
    layouts: list[GroupLayout] = []
    for i, group in enumerate(config.kv_cache_groups):
        spec = group.kv_cache_spec
        if spec.block_size != block_size:
            raise ValueError(
                f"KV connectors need one block size for every KV cache group: group {i} has "
                f"{spec.block_size}, the engine {block_size}"
            )
        window: int | None
        if isinstance(spec, SlidingWindowSpec):
            window = spec.sliding_window
        elif isinstance(spec, FullAttentionSpec):
            window = None
        else:
            raise ValueError(
                f"KV connectors carry full-attention and sliding-window KV cache groups; "
                f"group {i} is {type(spec).__name__}"
            )
        layouts.append(
            GroupLayout(
                layer_names=tuple(group.layer_names),
                sliding_window=window,
                block_bytes=spec.page_size_bytes * len(group.layer_names),
            )
        )
    return tuple(layouts)


def check_layer_groups(
    layer_names: Sequence[str], layer_groups: Sequence[Sequence[str]]
) -> list[list[str]]:
    """`layer_groups` with every registered layer in exactly one group; `ValueError` otherwise.

    A group may be empty (a pipeline stage holds none of its layers): group
    indices stay the scheduler's.
    """
    seen: dict[str, int] = {}
    for g, names in enumerate(layer_groups):
        for name in names:
            if name in seen:
                raise ValueError(f"layer {name!r} is in KV cache groups {seen[name]} and {g}")
            seen[name] = g
    missing = [n for n in layer_names if n not in seen]
    extra = [n for n in seen if n not in set(layer_names)]
    if missing or extra:
        raise ValueError(
            f"layer_groups must name every registered KV cache layer once: missing {missing}, "
            f"unknown {extra}"
        )
    return [list(names) for names in layer_groups]
