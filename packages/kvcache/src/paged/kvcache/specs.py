"""KV cache specs: what one attention layer needs per block.

Frozen dataclasses with `dtype` as a string (never a torch dtype: this package
imports no tensor library). `page_size_bytes` is the size of one block of one
layer; `max_memory_usage_bytes(max_model_len, max_num_batched_tokens=None)` is
the most one request can use.
Invalid values raise `ValueError` naming the field.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

_DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


def get_dtype_size(dtype: str) -> int:
    """Bytes per element of a dtype name such as "bfloat16"."""
    name = dtype.removeprefix("torch.")
    try:
        return _DTYPE_SIZES[name]
    except KeyError:
        raise ValueError(
            f"dtype {dtype!r} is not supported; use one of {sorted(_DTYPE_SIZES)}"
        ) from None


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(-a // b)


def _require_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class KVCacheSpec(ABC):
    """Base of all specs: every block covers `block_size` tokens."""

    block_size: int

    def __post_init__(self) -> None:
        _require_positive("block_size", self.block_size)

    @property
    @abstractmethod
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer."""

    def max_memory_usage_bytes(
        self, max_model_len: int, max_num_batched_tokens: int | None = None
    ) -> int:
        """Most memory one request of `max_model_len` tokens can hold.

        `max_num_batched_tokens` (the largest chunk one step computes) bounds
        what windowed specs hold beyond their window; None means no bound.
        """
        return cdiv(max_model_len, self.block_size) * self.page_size_bytes

    def with_block_size(self, block_size: int) -> KVCacheSpec:
        """A copy with another block size (used to unify page sizes)."""
        from dataclasses import replace

        return replace(self, block_size=block_size)


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    """Attention layer: K and V of `num_kv_heads` heads of `head_size`."""

    num_kv_heads: int
    head_size: int
    dtype: str

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_positive("num_kv_heads", self.num_kv_heads)
        _require_positive("head_size", self.head_size)
        get_dtype_size(self.dtype)

    @property
    def page_size_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size * get_dtype_size(self.dtype)


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """Causal attention over every previous token.

    `sliding_window` / `attention_chunk_size` may be set when a sliding-window
    or chunked layer is deliberately managed as full attention (keeps all
    blocks; simpler, more memory); they do not change the manager.
    """

    sliding_window: int | None = None
    attention_chunk_size: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sliding_window is not None:
            _require_positive("sliding_window", self.sliding_window)
        if self.attention_chunk_size is not None:
            _require_positive("attention_chunk_size", self.attention_chunk_size)


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention: one latent vector per token (no separate K/V)."""

    cache_dtype_str: str | None = None

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * self.head_size * get_dtype_size(self.dtype)


@dataclass(frozen=True)
class SinkFullAttentionSpec(FullAttentionSpec):
    """Full attention plus `sink_len` attention-sink tokens kept for the model's lifetime."""

    sink_len: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sink_len is None:
            raise ValueError("sink_len is required for SinkFullAttentionSpec")
        _require_positive("sink_len", self.sink_len)
        if self.sink_len % self.block_size != 0:
            raise ValueError(
                f"sink_len ({self.sink_len}) must be a multiple of block_size ({self.block_size})"
            )

    def max_memory_usage_bytes(
        self, max_model_len: int, max_num_batched_tokens: int | None = None
    ) -> int:
        assert self.sink_len is not None
        return super().max_memory_usage_bytes(max_model_len) + (
            self.sink_len // self.block_size * self.page_size_bytes
        )


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    """Each token attends to the last `sliding_window` tokens (itself included)."""

    sliding_window: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_positive("sliding_window", self.sliding_window)

    def max_memory_usage_bytes(
        self, max_model_len: int, max_num_batched_tokens: int | None = None
    ) -> int:
        # The window plus one chunk of new tokens, plus one block of misalignment
        # (vLLM's formula).
        chunk = max_model_len if max_num_batched_tokens is None else max_num_batched_tokens
        num_tokens = min(self.sliding_window - 1 + chunk, max_model_len)
        return (cdiv(num_tokens, self.block_size) + 1) * self.page_size_bytes


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Tokens attend only within their chunk of `attention_chunk_size` tokens."""

    attention_chunk_size: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_positive("attention_chunk_size", self.attention_chunk_size)
        if self.attention_chunk_size % self.block_size != 0:
            raise ValueError(
                f"attention_chunk_size ({self.attention_chunk_size}) must be a multiple "
                f"of block_size ({self.block_size})"
            )

    def max_memory_usage_bytes(
        self, max_model_len: int, max_num_batched_tokens: int | None = None
    ) -> int:
        # The current chunk plus one step of new tokens (vLLM's formula).
        chunk = max_model_len if max_num_batched_tokens is None else max_num_batched_tokens
        num_tokens = min(self.attention_chunk_size + chunk, max_model_len)
        return cdiv(num_tokens, self.block_size) * self.page_size_bytes


@dataclass(frozen=True)
class CrossAttentionSpec(AttentionSpec):
    """Decoder-to-encoder attention: blocks sized by the encoder input, no prefix caching."""


MAMBA_CACHE_MODES = ("none", "align", "all")


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    """State-space layer: a fixed-size state per block instead of per-token K/V.

    `shapes[i]` / `dtypes[i]` describe the i-th state tensor of one block;
    `page_size_padded` lets a hybrid model pad the page to match attention
    layers. `mamba_cache_mode` is vLLM's: "none" (no prefix caching of
    states: a manager with caching on refuses it), "align" (one state block
    per step, cached when the step's last token ends it) or "all" (every
    full block cached: only right when the model's kernels write the state
    at every block boundary).
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    page_size_padded: int | None = None
    mamba_type: str = "mamba2"
    mamba_cache_mode: str = "none"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise ValueError(
                f"mamba_cache_mode must be one of {MAMBA_CACHE_MODES}, "
                f"got {self.mamba_cache_mode!r}"
            )
        if not self.shapes or len(self.shapes) != len(self.dtypes):
            raise ValueError(
                f"shapes and dtypes must be non-empty and of equal length, got "
                f"{len(self.shapes)} shapes and {len(self.dtypes)} dtypes"
            )
        for shape in self.shapes:
            for dim in shape:
                _require_positive("shapes dimension", dim)
        raw = self._raw_page_size()
        if self.page_size_padded is not None and self.page_size_padded < raw:
            raise ValueError(
                f"page_size_padded ({self.page_size_padded}) is smaller than the state ({raw})"
            )

    def _raw_page_size(self) -> int:
        return sum(
            math.prod(shape) * get_dtype_size(dtype)
            for shape, dtype in zip(self.shapes, self.dtypes, strict=True)
        )

    @property
    def page_size_bytes(self) -> int:
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self._raw_page_size()

    def with_block_size(self, block_size: int) -> KVCacheSpec:
        raise ValueError("a MambaSpec's page size does not depend on block_size")


# vLLM's `KVCacheSpecKind` values (vllm/v1/kv_cache_interface.py:183-193), as
# KV events publish them in `BlockStored.kv_cache_spec_kind`.
KVCacheSpecKind = str


def kv_cache_spec_kind(spec: KVCacheSpec) -> KVCacheSpecKind:
    """The kind name vLLM 0.33.0 publishes for `spec` (kv_cache_interface.py:1421-1459).

    Subclasses are tested before their bases, so MLA and sink specs keep their
    own kind rather than "full_attention".
    """
    if isinstance(spec, MLAAttentionSpec):
        return "mla_attention"
    if isinstance(spec, SinkFullAttentionSpec):
        return "sink_full_attention"
    if isinstance(spec, FullAttentionSpec):
        return "full_attention"
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return "chunked_local_attention"
    if isinstance(spec, SlidingWindowSpec):
        return "sliding_window"
    if isinstance(spec, MambaSpec):
        return "mamba"
    if isinstance(spec, CrossAttentionSpec):
        return "cross_attention"
    return "unknown"


def kv_cache_spec_sliding_window(spec: KVCacheSpec) -> int | None:
    """The window vLLM 0.33.0 publishes for `spec` (kv_cache_interface.py:1462-1470).

    Only a `SlidingWindowSpec` has one: a sliding layer managed as full
    attention (`FullAttentionSpec.sliding_window`) keeps every block, so for
    a cache consumer it is full attention and publishes None, as vLLM does.
    """
    return spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
