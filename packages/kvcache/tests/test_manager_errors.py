"""Bad input raises a clear error naming the problem and leaves the pool intact."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from paged.kvcache import (
    BlockStateError,
    KVCacheBlocks,
    KVCacheManager,
    SimpleRequest,
    UnknownRequestError,
)

MakeManager = Callable[..., KVCacheManager]
MakeRequest = Callable[..., SimpleRequest]


def snapshot(kvm: KVCacheManager) -> tuple[list[int], list[int], int]:
    pool = kvm.block_pool
    return (
        [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        [b.ref_cnt for b in pool.blocks],
        len(pool.cached_block_hash_to_block),
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_new_tokens": -1}, "num_new_tokens"),
        ({"num_new_tokens": 0}, "num_new_tokens"),
        ({"num_new_tokens": 1, "num_new_computed_tokens": -4}, "num_new_computed_tokens"),
        ({"num_new_tokens": 1, "num_lookahead_tokens": -1}, "num_lookahead_tokens"),
        ({"num_new_tokens": 1, "num_external_computed_tokens": -1}, "num_external"),
        ({"num_new_tokens": 1, "num_encoder_tokens": -1}, "num_encoder_tokens"),
    ],
)
def test_allocate_slots_rejects_bad_counts(
    make_manager: MakeManager, make_request: MakeRequest, kwargs: dict[str, int], match: str
) -> None:
    kvm = make_manager(11)
    r = make_request("0", range(8))
    before = snapshot(kvm)
    with pytest.raises(ValueError, match=match):
        kvm.allocate_slots(r, **kwargs)  # type: ignore[arg-type]
    assert snapshot(kvm) == before
    kvm.check_integrity()


def test_wrong_group_count(make_manager: MakeManager, make_request: MakeRequest) -> None:
    kvm = make_manager(11)
    with pytest.raises(ValueError, match="groups"):
        kvm.allocate_slots(make_request("0", range(8)), 8, 0, KVCacheBlocks(([], [])))


def test_unknown_request_ids(make_manager: MakeManager, make_request: MakeRequest) -> None:
    kvm = make_manager(11)
    for call in (
        lambda: kvm.get_block_ids("nope"),
        lambda: kvm.get_blocks("nope"),
        lambda: kvm.get_num_common_prefix_blocks("nope"),
        lambda: kvm.cache_blocks(make_request("nope", range(8)), 8),
    ):
        with pytest.raises(UnknownRequestError, match="'nope'"):
            call()
    kvm.free(make_request("nope", range(8)))  # freeing a request never allocated: no-op
    kvm.check_integrity()


def test_running_request_cannot_take_new_hits(
    make_manager: MakeManager, make_request: MakeRequest
) -> None:
    kvm = make_manager(11)
    r0 = make_request("0", range(9))
    assert kvm.allocate_slots(r0, 9) is not None
    r0.num_computed_tokens = 9
    r1 = make_request("1", range(9))
    hits, n = kvm.get_computed_blocks(r1)
    assert n == 8
    r0.append_output_token_ids(9)
    with pytest.raises(ValueError, match="running"):
        kvm.allocate_slots(r0, 1, 0, hits)
    kvm.check_integrity()


def test_block_hashes_must_be_current(make_manager: MakeManager) -> None:
    kvm = make_manager(11)
    stale = SimpleRequest("0", range(8))  # no hasher: block_hashes stays empty
    before = snapshot(kvm)
    with pytest.raises(ValueError, match="block hashes"):
        kvm.allocate_slots(stale, 8)
    # Allocation happened before caching failed: the blocks belong to the request
    # and are released normally.
    kvm.free(stale)
    assert snapshot(kvm)[1] == before[1]
    kvm.check_integrity()


def test_double_free_of_shared_block_detected(
    make_manager: MakeManager, make_request: MakeRequest
) -> None:
    kvm = make_manager(11)
    r0 = make_request("0", range(8))
    assert kvm.allocate_slots(r0, 8) is not None
    blocks = list(kvm.get_blocks("0").blocks[0])
    kvm.free(r0)
    with pytest.raises(BlockStateError):
        kvm.block_pool.free_blocks(blocks)
    kvm.check_integrity()


def test_bad_manager_arguments(make_manager: MakeManager) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        make_manager(11, max_model_len=0)
    with pytest.raises(ValueError, match="hash_block_size"):
        make_manager(11, hash_block_size=3)
