"""Property tests: random operation sequences keep every invariant (checked after each step)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from paged.kvcache import (
    BlockPool,
    BlockStateError,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheBlocks,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    NotEnoughBlocksError,
    SimpleRequest,
    SlidingWindowSpec,
    get_request_block_hasher,
    init_none_hash,
    sha256,
)
from paged.kvcache.ids import make_block_hash_with_group_id
from paged.kvcache.specs import cdiv

BS = 4
ATTN = {"num_kv_heads": 1, "head_size": 4, "dtype": "float16"}
FULL = FullAttentionSpec(block_size=BS, **ATTN)  # type: ignore[arg-type]
SW = SlidingWindowSpec(block_size=BS, sliding_window=6, **ATTN)  # type: ignore[arg-type]
CHUNKED = ChunkedLocalAttentionSpec(block_size=BS, attention_chunk_size=8, **ATTN)  # type: ignore[arg-type]
MAMBA = MambaSpec(block_size=BS, shapes=((2, 2),), dtypes=("float16",), mamba_cache_mode="align")
MAMBA_ALL = MambaSpec(block_size=BS, shapes=((2, 2),), dtypes=("float16",), mamba_cache_mode="all")
FULL8 = FullAttentionSpec(block_size=8, **ATTN)  # type: ignore[arg-type]

LAYOUTS: dict[str, tuple[KVCacheSpec, ...]] = {
    "full": (FULL,),
    "sliding": (SW,),
    "chunked": (CHUNKED,),
    "mamba": (MAMBA,),
    "mamba_all": (MAMBA_ALL,),
    "full+mamba": (FULL, MAMBA),
    "full+sliding": (FULL, SW),
    "full+sliding+chunked": (FULL, SW, CHUNKED),
    "full4+full8": (FULL, FULL8),
}
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 9, 9, 9, 9], [5] * 12]
PROPERTY_SETTINGS = settings(
    max_examples=40,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def config(specs: tuple[KVCacheSpec, ...], num_blocks: int) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)]
    return KVCacheConfig(num_blocks, [KVCacheTensor(1, ["l0"])], groups)


class ManagerMachine(RuleBasedStateMachine):
    """A scheduler-like driver: admit (with prefix hits), chunked prefill, decode, free."""

    def __init__(self) -> None:
        super().__init__()
        self.kvm: KVCacheManager
        self.twin: KVCacheManager  # same config, general allocate_slots path only
        self.running: dict[str, SimpleRequest] = {}
        self.next_id = 0

    def allocate(self, req: SimpleRequest, *args: object, **kwargs: object) -> object:
        """allocate_slots on both managers; they must agree exactly."""
        new = self.kvm.allocate_slots(req, *args, **kwargs)  # type: ignore[arg-type]
        twin_args = list(args)
        if len(twin_args) >= 3 and isinstance(twin_args[2], KVCacheBlocks):
            hits, _ = self.twin.get_computed_blocks(req)
            twin_args[2] = hits
        twin_new = self.twin.allocate_slots(req, *twin_args, **kwargs)  # type: ignore[arg-type]
        assert (new is None) == (twin_new is None)
        if new is not None and twin_new is not None:
            assert new.get_block_ids() == twin_new.get_block_ids()
        return new

    def both_free(self, req: SimpleRequest) -> None:
        self.kvm.free(req)
        self.twin.free(req)

    layout = "full"  # subclasses below pick the other layouts

    @initialize(num_blocks=st.integers(4, 40), caching=st.booleans())
    def setup(self, num_blocks: int, caching: bool) -> None:
        init_none_hash(sha256, seed=0)
        self.specs = LAYOUTS[self.layout]
        self.kvm = KVCacheManager(
            config(self.specs, num_blocks),
            max_model_len=64,
            enable_caching=caching,
            enable_kv_cache_events=True,
            log_stats=True,
        )
        self.twin = KVCacheManager(
            config(self.specs, num_blocks), max_model_len=64, enable_caching=caching
        )
        self.twin._fast_full_manager = None
        self.hasher = get_request_block_hasher(self.kvm.hash_block_size, sha256)

    @rule(
        prefix=st.sampled_from(PREFIXES),
        cut=st.integers(1, 12),
        suffix=st.lists(st.integers(0, 20), max_size=12),
        chunk=st.integers(1, 24),
        lookahead=st.integers(0, 3),
    )
    def admit(
        self, prefix: list[int], cut: int, suffix: list[int], chunk: int, lookahead: int
    ) -> None:
        rid = str(self.next_id)
        self.next_id += 1
        req = SimpleRequest(rid, [*prefix[:cut], *suffix], self.hasher)
        hits, num_hit = self.kvm.get_computed_blocks(req)
        assert num_hit < req.num_tokens
        assert all(
            len(g) * spec.block_size == num_hit
            for g, spec in zip(hits.blocks, self.specs, strict=True)
        )
        num_new = min(chunk, req.num_tokens - num_hit)
        new = self.allocate(req, num_new, num_hit, hits, num_lookahead_tokens=lookahead)
        if new is not None:
            req.num_computed_tokens = num_hit + num_new
            self.running[rid] = req

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data(), token=st.integers(0, 20), lookahead=st.integers(0, 3))
    def step(self, data: st.DataObject, token: int, lookahead: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        req = self.running[rid]
        if req.num_computed_tokens == req.num_tokens:  # decode: a sampled token arrives
            if req.num_tokens >= 60:
                return
            req.append_output_token_ids(token)
        num_new = min(data.draw(st.integers(1, 8)), req.num_tokens - req.num_computed_tokens)
        new = self.allocate(req, num_new, num_lookahead_tokens=lookahead)
        if new is None:  # preempt: free everything, recompute later (here: drop)
            self.both_free(req)
            del self.running[rid]
        else:
            req.num_computed_tokens += num_new

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        self.both_free(self.running.pop(rid))

    @rule(ids=st.sets(st.integers(0, 39), max_size=4))
    def evict(self, ids: set[int]) -> None:
        valid = [i for i in ids if i < self.kvm.block_pool.num_gpu_blocks]
        self.kvm.evict_blocks(valid)
        self.twin.evict_blocks(valid)

    @rule()
    def reset(self) -> None:
        assert self.kvm.reset_prefix_cache() == (not self.running)
        assert self.twin.reset_prefix_cache() == (not self.running)

    @rule()
    def new_step(self) -> None:
        self.kvm.new_step_starts()
        self.twin.new_step_starts()

    @rule()
    def drain(self) -> None:
        self.kvm.take_events()
        stats = self.kvm.make_prefix_cache_stats()
        assert stats is not None and 0 <= stats.hits <= stats.queries

    @invariant()
    def integrity(self) -> None:
        kvm = getattr(self, "kvm", None)
        if kvm is None:
            return
        kvm.check_integrity()
        self.twin.check_integrity()
        for rid in self.running:
            assert kvm.get_block_ids(rid) == self.twin.get_block_ids(rid)
        assert [b.block_id for b in kvm.block_pool.free_block_queue.get_all_free_blocks()] == [
            b.block_id for b in self.twin.block_pool.free_block_queue.get_all_free_blocks()
        ]
        null = kvm.block_pool.null_block
        for rid, req in self.running.items():
            for gid, (spec, blocks) in enumerate(
                zip(self.specs, kvm.get_blocks(rid).blocks, strict=True)
            ):
                # Enough slots for every computed token.
                assert len(blocks) >= cdiv(req.num_computed_tokens, spec.block_size) or gid > 0
                # Every cached block's hash is the hash of this request's tokens there.
                ratio = spec.block_size // kvm.hash_block_size
                for i, blk in enumerate(blocks):
                    if blk is null or blk.block_hash is None:
                        continue
                    if (i + 1) * ratio > len(req.block_hashes):
                        continue
                    expected = req.block_hashes[(i + 1) * ratio - 1]
                    if blk.block_hash == make_block_hash_with_group_id(expected, gid):
                        continue
                    # A block may also be a hit computed for another request's tokens
                    # only if the hashes matched at lookup: so they must match here.
                    raise AssertionError(f"block {blk.block_id} of {rid} has a foreign hash")


def _machine_test(layout: str) -> type:
    machine: type[ManagerMachine] = type(
        f"ManagerMachine_{layout}", (ManagerMachine,), {"layout": layout}
    )
    test_case: type = machine.TestCase
    test_case.settings = settings(PROPERTY_SETTINGS, max_examples=15)  # type: ignore[attr-defined]
    return test_case


# One test per layout so that each gets its share of examples.
TestFull = _machine_test("full")
TestSliding = _machine_test("sliding")
TestChunked = _machine_test("chunked")
TestMamba = _machine_test("mamba")
TestMambaAll = _machine_test("mamba_all")
TestFullMamba = _machine_test("full+mamba")
TestFullSliding = _machine_test("full+sliding")
TestThreeTypes = _machine_test("full+sliding+chunked")
TestTwoBlockSizes = _machine_test("full4+full8")


class PoolMachine(RuleBasedStateMachine):
    """BlockPool alone, including misuse that must be rejected without damage."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(12, enable_caching=True, hash_block_size=BS)
        self.held: list[list[int]] = []  # block ids per owner
        self.req = SimpleRequest("r", list(range(12 * BS)), get_request_block_hasher(BS, sha256))

    @rule(n=st.integers(0, 14))
    def allocate(self, n: int) -> None:
        free = self.pool.get_num_free_blocks()
        try:
            blocks = self.pool.get_new_blocks(n)
        except NotEnoughBlocksError:
            assert n > free
            return
        self.held.append([b.block_id for b in blocks])

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def cache(self, data: st.DataObject) -> None:
        owner = data.draw(st.sampled_from(self.held))
        blocks = [self.pool.blocks[i] for i in owner]
        start = data.draw(st.integers(0, len(blocks)))
        # Different offsets give different hashes per position.
        offset = data.draw(st.integers(0, 12 - len(blocks)))
        sub = self.req.block_hashes[offset : offset + len(blocks)]
        view = SimpleRequest("v", [0])
        view.block_hashes = list(sub)
        try:
            self.pool.cache_full_blocks(view, blocks, start, len(blocks), BS, 0)
        except BlockStateError:
            new = [b for b in blocks[start:] if not b.is_null]
            assert any(b.block_hash is not None for b in new) or len({id(b) for b in new}) < len(
                new
            )

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        idx = data.draw(st.integers(0, len(self.held) - 1))
        owner = self.held.pop(idx)
        self.pool.free_blocks(reversed([self.pool.blocks[i] for i in owner]))

    @rule(ids=st.lists(st.integers(0, 11), max_size=4))
    def touch(self, ids: list[int]) -> None:
        blocks = [self.pool.blocks[i] for i in ids]
        self.pool.touch(blocks)  # any block, free or not (vLLM semantics)
        self.held.append([i for i in ids if i != 0])

    @rule(i=st.integers(1, 11))
    def double_free(self, i: int) -> None:
        block = self.pool.blocks[i]
        if block.ref_cnt == 0:
            with pytest.raises(BlockStateError):
                self.pool.free_blocks([block])

    @rule(ids=st.sets(st.integers(0, 11), max_size=3))
    def evict(self, ids: set[int]) -> None:
        self.pool.evict_blocks(ids)

    @rule()
    def reset(self) -> None:
        assert self.pool.reset_prefix_cache() == (not any(self.held))

    @invariant()
    def integrity(self) -> None:
        self.pool.check_integrity()
        counts = [0] * 12
        for owner in self.held:
            for i in owner:
                counts[i] += 1
        assert [b.ref_cnt for b in self.pool.blocks[1:]] == counts[1:]


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = PROPERTY_SETTINGS
