"""Shared fixtures: a deterministic NONE_HASH and small manager/request factories."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import pytest

from paged.kvcache import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    KVCacheSpec,
    KVCacheTensor,
    SimpleRequest,
    get_request_block_hasher,
    init_none_hash,
    sha256,
)
from paged.kvcache.hashing import get_none_hash

BLOCK_SIZE = 4

MakeRequest = Callable[..., SimpleRequest]
MakeManager = Callable[..., KVCacheManager]


@pytest.fixture(autouse=True)
def _fixed_none_hash() -> Iterator[None]:
    """Every test starts from the same seed; the process-wide one is restored after."""
    saved = get_none_hash()
    init_none_hash(sha256, seed=1234)
    yield
    import paged.kvcache.hashing as hashing

    hashing._none_hash = saved


def full_spec(block_size: int = BLOCK_SIZE) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype="float32")


def make_config(num_blocks: int, *specs: KVCacheSpec) -> KVCacheConfig:
    if not specs:
        specs = (full_spec(),)
    groups = [KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)]
    tensors = [KVCacheTensor(size=num_blocks * specs[0].page_size_bytes, shared_by=["layer0"])]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)


@pytest.fixture
def make_manager() -> MakeManager:
    def factory(
        num_blocks: int = 11,
        *specs: KVCacheSpec,
        max_model_len: int = 1024,
        **kwargs: object,
    ) -> KVCacheManager:
        return KVCacheManager(make_config(num_blocks, *specs), max_model_len, **kwargs)  # type: ignore[arg-type]

    return factory


@pytest.fixture
def make_request() -> MakeRequest:
    def factory(
        request_id: str,
        tokens: Iterable[int],
        block_size: int = BLOCK_SIZE,
        **kwargs: object,
    ) -> SimpleRequest:
        hasher = get_request_block_hasher(block_size, sha256)
        return SimpleRequest(request_id, tokens, hasher, **kwargs)  # type: ignore[arg-type]

    return factory
