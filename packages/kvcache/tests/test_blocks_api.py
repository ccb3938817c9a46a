"""KVCacheBlocks helpers and the request Protocol (checked statically by mypy too)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from paged.kvcache import (
    BlockHash,
    KVCacheBlocks,
    KVCacheManager,
    KVCacheRequest,
    SimpleRequest,
    get_request_block_hasher,
)

MakeManager = Callable[..., KVCacheManager]


@dataclass
class PlainRequest:
    """Another engine's request class: no paged base class involved."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)
    lora_name: str | None = None
    lora_path: str | None = None
    cache_salt: str | None = None
    mm_features: tuple[()] = ()
    skip_reading_prefix_cache: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def test_request_protocol_structural(make_manager: MakeManager) -> None:
    plain: KVCacheRequest = PlainRequest("p", list(range(9)))  # mypy checks conformance
    simple: KVCacheRequest = SimpleRequest("s", range(9))
    assert isinstance(plain, PlainRequest) and simple.num_tokens == 9
    req = PlainRequest("p", list(range(9)))
    req.block_hashes.extend(get_request_block_hasher(4)(req))
    kvm = make_manager(11)
    assert kvm.allocate_slots(req, 9) is not None
    assert kvm.get_block_ids("p") == ([1, 2, 3],)


def test_kv_cache_blocks_helpers(make_manager: MakeManager) -> None:
    kvm = make_manager(11)
    req = PlainRequest("p", list(range(9)))
    req.block_hashes.extend(get_request_block_hasher(4)(req))
    new = kvm.allocate_slots(req, 9)
    assert new is not None
    assert new.get_unhashed_block_ids() == [3]
    assert len(new) == 3
    empty = kvm.create_empty_block_list()
    assert empty.get_block_ids() == ([],) and empty is not kvm.create_empty_block_list()
    both = new + KVCacheBlocks(([kvm.block_pool.blocks[5]],))
    assert both.get_block_ids() == ([1, 2, 3, 5],)
    assert new.new_empty().get_block_ids() == ([],)
    assert len(KVCacheBlocks(())) == 0
