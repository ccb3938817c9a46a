"""The request view paged.kvcache needs (structural typing: no base class).

Any request class that has these attributes (plain attributes or read-only
properties both work) can be passed to `KVCacheManager` and to the block
hasher; the scheduler's `Request` satisfies `KVCacheRequest` structurally, and
so can another engine's request class. Everything is read-only from the
package's point of view: paged.kvcache never mutates a request. The caller
keeps `block_hashes` up to date by extending it with the output of the hasher
returned by `get_request_block_hasher` whenever tokens are appended.

`MultiModalFeatureSpec` / `PlaceholderRange` of paged.multimodal satisfy
`MultiModalFeatureLike` / `PlaceholderLike`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from paged.kvcache.ids import BlockHash


class PlaceholderLike(Protocol):
    """Token span `[offset, offset + length)` of a multimodal item in the prompt."""

    @property
    def offset(self) -> int: ...

    @property
    def length(self) -> int: ...


class MultiModalFeatureLike(Protocol):
    """A multimodal item: a content identifier (e.g. the mm hash) and its span."""

    @property
    def identifier(self) -> str: ...

    @property
    def mm_position(self) -> PlaceholderLike: ...


class HashableRequest(Protocol):
    """What the request block hasher reads.

    - `all_token_ids`: prompt plus output tokens so far.
    - `num_tokens`: `len(all_token_ids)` (kept separate because engines cache it).
    - `block_hashes`: hashes of the full blocks hashed so far, in order.
    - `lora_name`: the LoRA adapter's name, or None; enters every block's key.
    - `lora_path`: where the adapter's weights were loaded from, or None;
      enters every block's key with the name (vLLM keys both: a name
      re-pointed at new weights must not reuse the old KV). Read only when
      `lora_name` is set.
    - `cache_salt`: a per-tenant salt, or None; enters block 0's key only.
    - `mm_features`: multimodal items sorted by `mm_position.offset`; an item's
      identifier enters the key of every block its span overlaps.
    """

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def block_hashes(self) -> Sequence[BlockHash]: ...

    @property
    def lora_name(self) -> str | None: ...

    @property
    def lora_path(self) -> str | None: ...

    @property
    def cache_salt(self) -> str | None: ...

    @property
    def mm_features(self) -> Sequence[MultiModalFeatureLike]: ...


class KVCacheRequest(HashableRequest, Protocol):
    """What `KVCacheManager` reads, on top of `HashableRequest`.

    - `request_id`: unique among live requests.
    - `num_computed_tokens`: tokens whose KV is already in the cache (the
      scheduler advances it after each step; 0 after a preemption).
    - `skip_reading_prefix_cache`: True when the request must not read the
      prefix cache, e.g. it asks for prompt logprobs (which need every prompt
      position to go through the model).
    """

    @property
    def request_id(self) -> str: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def skip_reading_prefix_cache(self) -> bool: ...
