"""Multimodal boundary types: where an item sits in the prompt and what it carries.

These cross process boundaries inside `EngineCoreRequest`, so they are
msgspec Structs (compact msgpack, no pickle).
"""

from __future__ import annotations

import msgspec


class PlaceholderRange(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """The token span `[offset, offset + length)` of one multimodal item in the prompt.

    `is_embed`, when given, marks which positions of the span receive encoder
    embeddings (some processors put break or special tokens inside the span);
    `None` means every position does.
    """

    offset: int
    length: int
    is_embed: list[bool] | None = None

    def __post_init__(self) -> None:
        if self.offset < 0:
            raise ValueError(f"PlaceholderRange.offset must be >= 0, got {self.offset}")
        if self.length <= 0:
            raise ValueError(f"PlaceholderRange.length must be > 0, got {self.length}")
        if self.is_embed is not None and len(self.is_embed) != self.length:
            raise ValueError(
                f"PlaceholderRange.is_embed has {len(self.is_embed)} entries, "
                f"expected length={self.length}"
            )

    @property
    def end(self) -> int:
        return self.offset + self.length

    def get_num_embeds(self) -> int:
        """Number of encoder embeddings this span consumes."""
        if self.is_embed is None:
            return self.length
        return sum(self.is_embed)


class TensorData(msgspec.Struct, array_like=True, frozen=True):
    """A dense array as raw bytes (row-major), free of numpy/torch at the boundary."""

    dtype: str
    shape: list[int]
    data: bytes


class MultiModalFeatureSpec(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """One processed multimodal item of a request.

    `identifier` is the content hash (`mm_hash`) used for encoder-cache
    sharing and for prefix-cache extra keys; `data` holds the processed
    encoder inputs (e.g. pixel values) and may be `None` when the item is
    served from a cache.
    """

    modality: str
    identifier: str
    mm_position: PlaceholderRange
    data: dict[str, TensorData] | None = None

    @property
    def mm_hash(self) -> str:
        return self.identifier
