"""Mamba with prefix caching: "align" mode caches only states a step really ended on."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged.kvcache import (
    BlockStored,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    KVCacheTensor,
    MambaSpec,
    SimpleRequest,
    get_kv_cache_config,
    get_request_block_hasher,
    sha256,
)

BS = 4


def mamba(mode: str = "align", block_size: int = BS) -> MambaSpec:
    return MambaSpec(
        block_size=block_size, shapes=((2, 8),), dtypes=("float32",), mamba_cache_mode=mode
    )


def manager(num_blocks: int, *specs: MambaSpec | FullAttentionSpec, **kw: object) -> KVCacheManager:
    groups = [KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)]
    config = KVCacheConfig(num_blocks, [KVCacheTensor(1, ["l0"])], groups)
    return KVCacheManager(config, max_model_len=8192, **kw)  # type: ignore[arg-type]


def req(rid: str, tokens: list[int] | range, block_size: int = BS) -> SimpleRequest:
    return SimpleRequest(rid, tokens, get_request_block_hasher(block_size, sha256))


def step(kvm: KVCacheManager, r: SimpleRequest, num_new: int) -> list[int]:
    """One scheduling step for a running request; returns the new block ids."""
    kvm.new_step_starts()
    new = kvm.allocate_slots(r, num_new)
    assert new is not None
    r.num_computed_tokens += num_new
    return new.get_block_ids()[0]


def test_prefill_step_caches_no_block_it_only_passed_through() -> None:
    """10 tokens in one step: the state is written after token 9 only.

    Before align mode, blocks [0, 4) and [4, 8) were cached and a later prompt
    hit "the state after token 7", which no block ever held.
    """
    kvm = manager(9, mamba())
    r0 = req("0", range(10))
    new = kvm.allocate_slots(r0, 10)
    # One state block, at the position of the step's last token; nulls pad the rest.
    assert new is not None and new.get_block_ids() == ([0, 0, 1],)
    r0.num_computed_tokens = 10
    assert len(kvm.block_pool.cached_block_hash_to_block) == 0
    r0.append_output_token_ids(10)
    assert step(kvm, r0, 1) == []  # token 10 still lands in block position 2
    hits, n = kvm.get_computed_blocks(req("1", [*range(10), 50, 51]))
    assert n == 0 and hits.get_block_ids() == ([],)
    kvm.check_integrity()


def test_boundary_states_are_cached_and_hit_one_step_later() -> None:
    kvm = manager(9, mamba())
    tokens = list(range(20))
    r0 = req("0", tokens)
    kvm.new_step_starts()
    new = kvm.allocate_slots(r0, 8)  # chunk [0, 8): ends on a boundary
    assert new is not None and new.get_block_ids() == ([0, 1],)
    r0.num_computed_tokens = 8
    assert step(kvm, r0, 8) == [0, 2]  # chunk [8, 16); block 1 still holds its input state
    assert kvm.get_block_ids("0") == ([0, 1, 0, 2],)
    assert step(kvm, r0, 4) == [3]  # chunk [16, 20): block 1 is no longer needed
    assert kvm.get_block_ids("0") == ([0, 0, 0, 2, 3],)
    # Cached: the states after tokens 7, 15 and 19, each at its block position.
    pool = kvm.block_pool
    for block_id, pos in ((1, 1), (2, 3), (3, 4)):
        assert pool.get_cached_block(r0.block_hashes[pos], [0]) == [pool.blocks[block_id]]
    assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == [4, 5, 6, 7, 8, 1]

    r1 = req("1", [*tokens, 99])
    hits, n = kvm.get_computed_blocks(r1)
    assert n == 20 and hits.get_block_ids() == ([0, 0, 0, 0, 3],)
    # Block 3's state is written by the step being scheduled: r1 waits a step.
    assert kvm.allocate_slots(r1, 1, n, hits) is None
    kvm.new_step_starts()
    new = kvm.allocate_slots(r1, 1, n, hits)
    assert new is not None and kvm.get_block_ids("1") == ([0, 0, 0, 0, 3, 4],)
    # A prompt sharing only the first chunk resumes from the state after token 7.
    hits, n = kvm.get_computed_blocks(req("2", [*tokens[:8], 77, 77]))
    assert n == 8 and hits.get_block_ids() == ([0, 1],)
    kvm.check_integrity()


def test_caching_with_mode_none_is_refused() -> None:
    with pytest.raises(ValueError, match="mamba_cache_mode='align'"):
        manager(9, mamba("none"))
    manager(9, mamba("none"), enable_caching=False)  # without caching "none" is fine
    with pytest.raises(ValueError, match="mamba_cache_mode must be one of"):
        mamba("sometimes")


def test_mamba_block_size_follows_the_attention_block_size() -> None:
    """The mamba page equals a 512-token attention page: one block per step, not 313."""
    attn = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="float32")
    state = MambaSpec(
        block_size=16, shapes=((512 * 16,),), dtypes=("float32",), mamba_cache_mode="align"
    )
    assert state.page_size_bytes == 32 * attn.page_size_bytes
    config = get_kv_cache_config(
        {"attn": attn, "mamba": state}, available_memory=64 * state.page_size_bytes * 2
    )
    sizes = [g.kv_cache_spec.block_size for g in config.kv_cache_groups]
    assert sizes == [512, 512]
    kvm = KVCacheManager(config, max_model_len=8192)
    r = req("0", range(5000), block_size=512)
    new = kvm.allocate_slots(r, 5000)
    assert new is not None
    attn_ids, mamba_ids = new.get_block_ids()
    assert len(attn_ids) == 10 and sum(1 for i in mamba_ids if i != 0) == 1
    kvm.check_integrity()
    # "none" mode keeps its block size (no caching: nothing to align).
    plain = MambaSpec(block_size=16, shapes=((512 * 16,),), dtypes=("float32",))
    config = get_kv_cache_config({"attn": attn, "mamba": plain}, available_memory=1 << 22)
    assert [g.kv_cache_spec.block_size for g in config.kv_cache_groups] == [512, 16]


@settings(max_examples=60, deadline=None)
@given(
    chunks=st.lists(st.integers(1, 9), min_size=1, max_size=10),
    hybrid=st.booleans(),
)
def test_every_cached_state_is_one_a_step_ended_on(chunks: list[int], hybrid: bool) -> None:
    """Whatever the chunking: each stored mamba block sits where a step ended.

    Also: a request holds at most two live state blocks (the one its step
    starts from and the one it writes), and the pool stays consistent.
    """
    specs = (FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype="float32"),)
    kvm = manager(40, *(specs if hybrid else ()), mamba(), enable_kv_cache_events=True)
    group = 1 if hybrid else 0
    total = sum(chunks)
    r = req("0", list(range(total)))
    step_ends: set[int] = set()
    for chunk in chunks:
        step(kvm, r, chunk)
        step_ends.add(r.num_computed_tokens)
        live = [b for b in kvm.get_blocks("0").blocks[group] if not b.is_null]
        assert len(live) <= 2
        kvm.check_integrity()
    for ev in kvm.take_events():
        if isinstance(ev, BlockStored) and ev.group_idx == group:
            for h in ev.block_hashes:
                assert (r.block_hashes.index(h) + 1) * BS in step_ends
    kvm.free(r)
    kvm.check_integrity()
