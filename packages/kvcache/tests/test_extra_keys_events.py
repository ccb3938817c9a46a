"""Extra keys: LoRA identity (name and path), source tags, and their place in KV events."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from paged.kvcache import (
    BlockPool,
    BlockRemoved,
    BlockStored,
    KVCacheManager,
    SimpleRequest,
    generate_block_hash_extra_keys,
    get_request_block_hasher,
    published_extra_keys,
    sha256,
)
from paged.kvcache.ids import BlockHash

BS = 4
MakeManager = Callable[..., KVCacheManager]
MakeRequest = Callable[..., SimpleRequest]


@dataclass(frozen=True)
class Pos:
    offset: int
    length: int


@dataclass(frozen=True)
class Feat:
    identifier: str
    mm_position: Pos


def block_hashes(tokens: range | list[int], **kw: object) -> list[BlockHash]:
    r = SimpleRequest("r", tokens, get_request_block_hasher(BS, sha256), **kw)  # type: ignore[arg-type]
    return r.block_hashes


# ------------------------------------------------------------------ LoRA path
def test_lora_path_enters_every_block_key(
    make_manager: MakeManager, make_request: MakeRequest
) -> None:
    kvm = make_manager(11)
    tokens = list(range(13))
    old = make_request("old", tokens, lora_name="ad", lora_path="/w/v1")
    assert kvm.allocate_slots(old, 13) is not None
    # Same name, same weights: every full block hits.
    same = make_request("same", tokens, lora_name="ad", lora_path="/w/v1")
    assert kvm.get_computed_blocks(same)[1] == 12
    # The name re-pointed at new weights must not reuse the old adapter's KV.
    repointed = make_request("new", tokens, lora_name="ad", lora_path="/w/v2")
    assert kvm.get_computed_blocks(repointed)[1] == 0
    v1 = block_hashes(range(8), lora_name="ad", lora_path="/w/v1")
    v2 = block_hashes(range(8), lora_name="ad", lora_path="/w/v2")
    assert v1[0] != v2[0] and v1[1] != v2[1]


# ---------------------------------------------------------------- source tags
def test_salt_never_shares_a_block_with_an_equally_named_lora(
    make_manager: MakeManager, make_request: MakeRequest
) -> None:
    kvm = make_manager(11)
    tokens = list(range(13))
    lora = make_request("lora", tokens, lora_name="x")
    assert kvm.allocate_slots(lora, 13) is not None
    salted = make_request("salt", tokens, cache_salt="x")
    assert kvm.get_computed_blocks(salted)[1] == 0
    assert salted.block_hashes[0] != lora.block_hashes[0]


_opt_text = st.one_of(st.none(), st.sampled_from(["", "x", "y", "/p"]))


@settings(max_examples=200, deadline=None)
@given(a=st.tuples(_opt_text, _opt_text, _opt_text), b=st.tuples(_opt_text, _opt_text, _opt_text))
def test_block_zero_keys_equal_only_for_equal_identities(
    a: tuple[str | None, str | None, str | None], b: tuple[str | None, str | None, str | None]
) -> None:
    """Block 0 of the same tokens hashes equal iff LoRA (name, path) and salt agree.

    The path only counts with a name, and an empty salt is no salt (as in vLLM).
    Every other pair, whatever strings the sources share, must differ.
    """

    def identity(cfg: tuple[str | None, str | None, str | None]) -> object:
        name, path, salt = cfg
        return ((name, path) if name is not None else None, salt or None)

    def h(cfg: tuple[str | None, str | None, str | None]) -> BlockHash:
        name, path, salt = cfg
        return block_hashes(range(4), lora_name=name, lora_path=path, cache_salt=salt)[0]

    assert (h(a) == h(b)) == (identity(a) == identity(b))


# --------------------------------------------------------------------- events
def test_block_stored_carries_published_extra_keys_per_block() -> None:
    pool = BlockPool(6, enable_caching=True, hash_block_size=BS, enable_kv_cache_events=True)
    img = Feat("img", Pos(offset=2, length=5))  # tokens [2, 7): blocks 0 and 1
    r = SimpleRequest(
        "r",
        range(12),
        get_request_block_hasher(BS, sha256),
        lora_name="ad",
        lora_path="/w",
        cache_salt="s",
        mm_features=[img],
    )
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(r, blocks, 0, 2, BS, 0)
    pool.cache_full_blocks(r, blocks, 2, 3, BS, 0)
    first, second = pool.take_events()
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    # vLLM's untagged form: LoRA name, (identifier, offset) per item, salt.
    assert first.extra_keys == [("ad", ("img", 2), "s"), ("ad", ("img", -2))]
    assert second.extra_keys == [("ad",)]
    assert first.lora_name == "ad" and first.group_idx == 0
    # The published keys are the hashed keys without their tags.
    tagged, _ = generate_block_hash_extra_keys(r, 0, 4)
    assert tagged == (("lora", "ad", "/w"), ("mm", "img", 2), ("cache_salt", "s"))
    assert published_extra_keys(tagged) == ("ad", ("img", 2), "s")


def test_block_stored_extra_keys_skip_null_blocks_and_plain_blocks_get_none() -> None:
    pool = BlockPool(6, enable_caching=True, hash_block_size=BS, enable_kv_cache_events=True)
    r = SimpleRequest("r", range(12), get_request_block_hasher(BS, sha256))
    blocks = [pool.null_block, *pool.get_new_blocks(2)]
    pool.cache_full_blocks(r, blocks, 0, 3, BS, 2)
    (ev,) = pool.take_events()
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == r.block_hashes[1:3]
    assert ev.extra_keys == [None, None] and ev.group_idx == 2


def test_block_removed_names_its_group() -> None:
    """One hash cached by two groups: evicting one copy says which one went."""
    pool = BlockPool(6, enable_caching=True, hash_block_size=BS, enable_kv_cache_events=True)
    r = SimpleRequest("r", range(4), get_request_block_hasher(BS, sha256))
    full_blk, sliding_blk = pool.get_new_blocks(2)
    pool.cache_full_blocks(r, [full_blk], 0, 1, BS, 0)
    pool.cache_full_blocks(r, [sliding_blk], 0, 1, BS, 1)
    pool.take_events()
    pool.evict_blocks([sliding_blk.block_id])
    assert pool.take_events() == [BlockRemoved(block_hashes=[r.block_hashes[0]], group_idx=1)]
    assert pool.get_cached_block(r.block_hashes[0], [0]) == [full_blk]
    assert pool.get_cached_block(r.block_hashes[0], [1]) is None
    pool.check_integrity()
