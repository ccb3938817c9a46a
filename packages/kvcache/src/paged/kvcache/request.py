"""`SimpleRequest`: a minimal request satisfying `KVCacheRequest`.

For engines (and tests, benchmarks, examples) that have no request class of
their own. It keeps `block_hashes` current by calling the block hasher on
construction and after every append, which is the contract the protocol asks
of any request class.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from paged.kvcache.hashing import RequestBlockHasher
from paged.kvcache.ids import BlockHash
from paged.kvcache.protocols import MultiModalFeatureLike


class SimpleRequest:
    """Token ids, computed-token count and block hashes of one request."""

    __slots__ = (
        "_block_hasher",
        "_hash_block_size",
        "all_token_ids",
        "block_hashes",
        "cache_salt",
        "lora_name",
        "lora_path",
        "mm_features",
        "num_computed_tokens",
        "num_preemptions",
        "request_id",
        "skip_reading_prefix_cache",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int],
        block_hasher: RequestBlockHasher | None = None,
        *,
        lora_name: str | None = None,
        lora_path: str | None = None,
        cache_salt: str | None = None,
        mm_features: Sequence[MultiModalFeatureLike] = (),
        skip_reading_prefix_cache: bool = False,
    ) -> None:
        self.request_id = request_id
        self.all_token_ids: list[int] = list(prompt_token_ids)
        if not self.all_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        self.lora_name = lora_name
        self.lora_path = lora_path
        self.cache_salt = cache_salt
        self.mm_features: Sequence[MultiModalFeatureLike] = tuple(
            sorted(mm_features, key=lambda f: f.mm_position.offset)
        )
        self.skip_reading_prefix_cache = skip_reading_prefix_cache
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self._block_hasher = block_hasher
        # Hashers from get_request_block_hasher expose their block size: then the
        # hasher is called only when an append can complete a block.
        hasher_block_size = getattr(block_hasher, "block_size", None)
        self._hash_block_size: int = hasher_block_size if isinstance(hasher_block_size, int) else 1
        self.block_hashes: list[BlockHash] = []
        if block_hasher is not None:
            self.block_hashes.extend(block_hasher(self))

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        """Append generated tokens and hash any block they complete."""
        if isinstance(token_ids, int):
            self.all_token_ids.append(token_ids)
        else:
            self.all_token_ids.extend(token_ids)
        hasher = self._block_hasher
        if hasher is not None and len(self.all_token_ids) >= (
            (len(self.block_hashes) + 1) * self._hash_block_size
        ):
            self.block_hashes.extend(hasher(self))

    def __repr__(self) -> str:
        return (
            f"SimpleRequest({self.request_id!r}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens})"
        )
