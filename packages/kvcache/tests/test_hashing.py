"""Hash chain, canonical encoding, NONE_HASH seeding, extra keys, incremental hasher."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest

from paged.kvcache import (
    BlockHashListWithBlockSize,
    SimpleRequest,
    encode_canonical,
    generate_block_hash_extra_keys,
    get_hash_fn_by_name,
    get_none_hash,
    get_none_hash_seed,
    get_request_block_hasher,
    hash_block_tokens,
    init_none_hash,
    sha256,
    sha256_cbor,
    xxhash,
)
from paged.kvcache import hashing as hashing_module
from paged.kvcache.ids import BlockHash

BS = 4


@dataclass(frozen=True)
class Pos:
    offset: int
    length: int


@dataclass(frozen=True)
class Feat:
    identifier: str
    mm_position: Pos


def hashes(tokens: list[int] | range, **kw: object) -> list[BlockHash]:
    r = SimpleRequest("r", tokens, get_request_block_hasher(BS, sha256), **kw)  # type: ignore[arg-type]
    return r.block_hashes


def test_encoding_is_canonical_and_typed() -> None:
    assert encode_canonical((1, 2)) == encode_canonical([1, 2])
    assert encode_canonical("1") != encode_canonical(1) != encode_canonical(b"1")
    assert encode_canonical(None) != encode_canonical(0)
    assert encode_canonical((1, (2, 3))) != encode_canonical((1, 2, 3))
    assert encode_canonical(2**70) != encode_canonical(2**70 + 1)
    assert encode_canonical((2**70, 1)) != encode_canonical((1, 2**70))
    assert encode_canonical(1.5) != encode_canonical(1)
    with pytest.raises(TypeError, match="cannot hash"):
        encode_canonical({"a": 1})


def test_hash_fns() -> None:
    assert len(sha256((b"p", (1, 2), None))) == 32
    assert get_hash_fn_by_name("sha256") is sha256
    assert get_hash_fn_by_name("xxhash") is xxhash
    with pytest.raises(ValueError, match="unknown hash function"):
        get_hash_fn_by_name("md5")


def test_xxhash_needs_only_the_fast_extra() -> None:
    pytest.importorskip("xxhash")  # optional: `paged-kvcache[fast]`
    assert len(xxhash((b"p", (1, 2), None))) == 16
    assert xxhash((1,)) != xxhash((2,))


def test_chain_and_incremental_hasher_agree() -> None:
    toks = list(range(11))
    h = hashes(toks)
    assert len(h) == 2  # the partial third block is not hashed
    h0 = hash_block_tokens(sha256, None, toks[0:4])
    assert h[0] == h0 == hash_block_tokens(sha256, get_none_hash(), tuple(toks[0:4]))
    assert h[1] == hash_block_tokens(sha256, h0, toks[4:8])
    r = SimpleRequest("r", toks[:3], get_request_block_hasher(BS, sha256))
    for t in toks[3:]:
        r.append_output_token_ids(t)
    assert r.block_hashes == h
    r.append_output_token_ids([11])
    assert len(r.block_hashes) == 3


def test_prefix_dependence() -> None:
    a = hashes([1, 2, 3, 4, 5, 6, 7, 8])
    b = hashes([9, 2, 3, 4, 5, 6, 7, 8])
    assert a[0] != b[0] and a[1] != b[1]  # block 1 equal tokens, different prefix


def test_none_hash_seeding() -> None:
    s1 = init_none_hash(sha256, seed=42)
    assert hashing_module.NONE_HASH == s1 == get_none_hash()
    s2 = init_none_hash(sha256, seed=42)
    assert s1 == s2
    assert init_none_hash(sha256, seed=43) != s1


def _hash_in_subprocess(env_seed: str | None) -> str:
    code = (
        "from paged.kvcache import *\n"
        "init_none_hash(sha256, seed=7)\n"
        "r = SimpleRequest('r', range(8), get_request_block_hasher(4, sha256))\n"
        "print(r.block_hashes[1].hex())\n"
    )
    env = dict(os.environ)
    env.pop("PYTHONHASHSEED", None)
    if env_seed is not None:
        env["PYTHONHASHSEED"] = env_seed
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def test_hashes_agree_across_processes_regardless_of_pythonhashseed() -> None:
    init_none_hash(sha256, seed=7)
    local = hashes(range(8))[1].hex()
    assert _hash_in_subprocess("0") == _hash_in_subprocess("12345") == local


def test_unseeded_none_hash_follows_vllm_033s_seed_rule(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # vllm/v1/core/kv_cache_utils.py resolve_none_hash_seed: PYTHONHASHSEED wins;
    # else SHA-256 gets the fixed "vllm-none-hash", xxhash a random seed.
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert init_none_hash(sha256) == init_none_hash(sha256) == sha256("vllm-none-hash")
    assert get_none_hash_seed() == "vllm-none-hash"
    assert init_none_hash(sha256_cbor) == sha256_cbor("vllm-none-hash")
    if importlib.util.find_spec("xxhash") is not None:
        assert init_none_hash(xxhash) != init_none_hash(xxhash)
    monkeypatch.setenv("PYTHONHASHSEED", "5")
    assert init_none_hash(sha256) == sha256("5")
    assert init_none_hash(sha256, seed=7) == sha256("7")  # paged's --block-hash-seed wins


def test_cache_salt_only_in_block_zero_but_changes_chain() -> None:
    plain = hashes(range(8))
    salted = hashes(range(8), cache_salt="tenant")
    assert salted[0] != plain[0] and salted[1] != plain[1]
    r = SimpleRequest("r", range(8), None, cache_salt="tenant")
    keys0, _ = generate_block_hash_extra_keys(r, 0, 4)
    keys1, _ = generate_block_hash_extra_keys(r, 4, 8)
    assert keys0 == (("cache_salt", "tenant"),) and keys1 is None
    # Block 1's hash is the plain chain continued from the salted block 0.
    assert salted[1] == hash_block_tokens(sha256, salted[0], [4, 5, 6, 7])


def test_lora_enters_every_block() -> None:
    r = SimpleRequest("r", range(8), None, lora_name="ad")
    assert generate_block_hash_extra_keys(r, 4, 8)[0] == (("lora", "ad", None),)
    lora = hashes(range(8), lora_name="ad")
    assert lora[1] == hash_block_tokens(sha256, lora[0], [4, 5, 6, 7], (("lora", "ad", None),))
    # Parts are tagged by source: a LoRA name and a salt with the same text
    # never share a key, not even block 0's.
    assert hashes(range(4), lora_name="x") != hashes(range(4), cache_salt="x")


def test_mm_identifier_enters_overlapping_blocks_with_relative_offset() -> None:
    img = Feat("img-A", Pos(offset=2, length=5))  # tokens [2, 7): blocks 0 and 1
    r = SimpleRequest("r", range(12), None, mm_features=[img])
    assert generate_block_hash_extra_keys(r, 0, 4) == ((("mm", "img-A", 2),), 0)
    assert generate_block_hash_extra_keys(r, 4, 8) == ((("mm", "img-A", -2),), 1)
    assert generate_block_hash_extra_keys(r, 8, 12, 1) == (None, 1)
    with_img = hashes(range(12), mm_features=[img])
    other_img = hashes(range(12), mm_features=[Feat("img-B", Pos(2, 5))])
    plain = hashes(range(12))
    assert with_img[0] != other_img[0] and with_img[1] != other_img[1]
    # Block 2 has no image: its hash differs only through the chain.
    assert with_img[2] == hash_block_tokens(sha256, with_img[1], [8, 9, 10, 11])
    assert with_img[2] != plain[2]
    moved = hashes(range(12), mm_features=[Feat("img-A", Pos(1, 5))])
    assert moved[0] != with_img[0]


def test_mm_incremental_matches_one_shot() -> None:
    feats = [Feat("a", Pos(1, 2)), Feat("b", Pos(5, 6)), Feat("c", Pos(13, 1))]
    one_shot = hashes(range(16), mm_features=feats)
    r = SimpleRequest("r", range(5), get_request_block_hasher(BS, sha256), mm_features=feats)
    for t in range(5, 16):
        r.append_output_token_ids(t)
    assert r.block_hashes == one_shot


def test_block_size_adapter() -> None:
    h = hashes(range(16))
    view = BlockHashListWithBlockSize(h, 4, 8)
    assert len(view) == 2
    assert view[0] == h[1] and view[-1] == h[3]  # vLLM 0.33: the last covering hash
    assert list(view) == [h[1], h[3]] == view[0:2]
    with pytest.raises(IndexError):
        view[2]
    with pytest.raises(ValueError, match="multiple"):
        BlockHashListWithBlockSize(h, 4, 6)


def test_hasher_rejects_bad_block_size() -> None:
    with pytest.raises(ValueError, match="block_size"):
        get_request_block_hasher(0)


def test_fast_hasher_paths_match_generic_encoding() -> None:
    big = [2**70, 1, 2, 3]  # outside int64: the hasher falls back to the generic encoder
    fns = [sha256]
    try:
        import xxhash as _xxhash  # noqa: F401  (optional `fast` extra)

        fns.append(xxhash)
    except ImportError:
        pass
    for fn in fns:
        r = SimpleRequest("r", [*big, 4, 5, 6, 7], get_request_block_hasher(BS, fn))
        assert r.block_hashes[0] == hash_block_tokens(fn, None, big)
        assert r.block_hashes[1] == hash_block_tokens(fn, r.block_hashes[0], [4, 5, 6, 7])

    def custom(obj: object) -> bytes:  # not a registered function: always the generic path
        return sha256(("custom", obj))

    r = SimpleRequest("r", range(4), get_request_block_hasher(BS, custom), cache_salt="s")
    assert r.block_hashes == [hash_block_tokens(custom, None, [0, 1, 2, 3], (("cache_salt", "s"),))]


def test_simple_request_appends_many_tokens() -> None:
    r = SimpleRequest("r", range(3), get_request_block_hasher(BS, sha256))
    r.append_output_token_ids(range(3, 12))  # completes blocks 0, 1 and 2 at once
    assert r.block_hashes == hashes(range(12))
    r.append_output_token_ids(12)
    assert len(r.block_hashes) == 3 and r.num_tokens == 13
    with pytest.raises(ValueError, match="prompt_token_ids"):
        SimpleRequest("e", [])
