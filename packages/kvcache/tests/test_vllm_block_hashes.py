"""paged's block hashes equal vLLM 0.33.0's, bit for bit, for each --prefix-caching-hash-algo.

GOLDEN was produced by running vLLM 0.33.0's own vllm/utils/hashing.py (the PyPI
sdist, with cbor2 and xxhash installed) with kv_cache_utils.py's chain rule:
NONE_HASH = hash_fn(seed), block i = hash_fn((parent, tuple(tokens), extra_keys)),
extra keys as generate_block_hash_extra_keys builds them (LoRA, mm, cache_salt):
/tmp/golden.py in the session that wrote this test; the script is reproduced in
the kvcache README's "Block hashes" section.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from paged.kvcache import (
    SimpleRequest,
    cbor,
    get_hash_fn_by_name,
    get_request_block_hasher,
    init_none_hash,
)

BS = 16
TOKENS = list(range(1000, 1000 + 3 * BS))

GOLDEN: dict[str, dict[str, Any]] = {
    "sha256": {
        "seed": "vllm-none-hash",
        "none_hash": "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198",
        "plain": [
            "9d9c413731095d0ee811a14814414907cafccd751ce2052f659e8e1f547aeb68",
            "6eab5151ee783ec014728198ae09f5b0c20f18673ff098bcec4f29beb1e71e61",
            "caf3fc6b0a70cebaaae638e8451ab3a5afb03fba4ab9ed391dcf2e6ca4dadf06",
        ],
        "keyed": [
            "f16f5eea1319fb03101a1927d4ce39696be70a1d6035b160f611f55c8f75573c",
            "1b9ab1ffeb313b95f661d03b4ac7b7c9525bca602273d10796141ba699428c16",
            "9a3669eea8c8dd3e288c6c23b666bdb01eb2e29e1179e8ee7e1107b7dd2ac8b8",
        ],
    },
    "sha256_cbor": {
        "seed": "vllm-none-hash",
        "none_hash": "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0",
        "plain": [
            "15528b726efb88cb4d9efc583657a821bceb1f67307c6e813417567050a24fdc",
            "b057b31190789434ae1b5f233801e9a318f5a49e9baf90762102e4d3c29c9005",
            "4556726f5ac9636556c58b01b840d90a19e6de63d7361b063fbfcc18764d8f2f",
        ],
        "keyed": [
            "fdd9e5652ce94a76439dffd53d2bc771e38d5999b5a0ccc6e3bf7dee94958ce6",
            "90f4917bbd58579918e6a7bbfa43ed0d1ee1057c24dbaecbbb5c92f11c3c7b2a",
            "7a273af735c682edcc55eef93db6996a982c01db2ce520d1b177f0c36cec4639",
        ],
    },
    "xxhash": {
        "seed": "0",
        "none_hash": "6fb31cc38bba6066183f7f2104b9c051",
        "plain": [
            "03a4aeab19c461739009df05e8227471",
            "0b7b449965ff12b69e639b6769f25ec5",
            "963be41d35363a2eeb620c36e0ba015e",
        ],
        "keyed": [
            "9da550b5851783db3f6eddea1778f3b5",
            "dd344cf3916602ae3397ed288986031a",
            "242925469b48526e3f32bfec1bcaa1f0",
        ],
    },
    "xxhash_cbor": {
        "seed": "0",
        "none_hash": "1ebe36576dcb573f26b99533a20aaeca",
        "plain": [
            "45e10e34ad1aea9e71fa5267c1a3fd78",
            "5492333e0f8f921a29b61c28df9edb4d",
            "62eb4dd398e085c1488411df373258d0",
        ],
        "keyed": [
            "6cb94abb391d3453772ce6049958d834",
            "eabdd0b48622bf81ffce1129e8d58561",
            "2e9dda3836c4d81fd5f591c60c2245af",
        ],
    },
}


@dataclass(frozen=True)
class _Pos:
    offset: int
    length: int


@dataclass(frozen=True)
class _Feature:
    identifier: str
    mm_position: _Pos


def _needs(algo: str) -> None:
    if algo.startswith("xxhash") and importlib.util.find_spec("xxhash") is None:
        pytest.skip("xxhash is the optional `fast` extra")


@pytest.mark.parametrize("algo", list(GOLDEN))
def test_none_hash_and_plain_chain_equal_vllm(algo: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _needs(algo)
    gold = GOLDEN[algo]
    fn = get_hash_fn_by_name(algo)
    monkeypatch.setenv("PYTHONHASHSEED", gold["seed"])
    if algo.startswith("sha"):  # the fixed default seed needs no environment
        monkeypatch.delenv("PYTHONHASHSEED")
    assert init_none_hash(fn).hex() == gold["none_hash"]
    r = SimpleRequest("r", TOKENS, get_request_block_hasher(BS, fn))
    assert [h.hex() for h in r.block_hashes] == gold["plain"]


@pytest.mark.parametrize("algo", list(GOLDEN))
def test_lora_mm_and_salt_keys_equal_vllm(algo: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _needs(algo)
    gold = GOLDEN[algo]
    fn = get_hash_fn_by_name(algo)
    monkeypatch.setenv("PYTHONHASHSEED", gold["seed"])
    init_none_hash(fn)
    r = SimpleRequest(
        "r",
        TOKENS,
        get_request_block_hasher(BS, fn),
        lora_name="ad1",
        lora_path="/adapters/ad1",
        cache_salt="tenant",
        mm_features=[_Feature("img-hash", _Pos(4, 20))],
    )
    assert [h.hex() for h in r.block_hashes] == gold["keyed"]


_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False)
    | st.text(max_size=30)
    | st.binary(max_size=40)
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=6)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=5) | st.integers(-300, 300), inner, max_size=4)
    ),
    max_leaves=25,
)


@given(_values)
def test_cbor_encoder_writes_cbor2_canonical_bytes(value: object) -> None:
    cbor2 = pytest.importorskip("cbor2")
    assert cbor.dumps(value) == cbor2.dumps(value, canonical=True)


def test_cbor_special_floats_and_bignums() -> None:
    cbor2 = pytest.importorskip("cbor2")
    for value in [float("nan"), float("inf"), -float("inf"), -0.0, 1e300, 2**64, -(2**64) - 1]:
        assert cbor.dumps(value) == cbor2.dumps(value, canonical=True)
    with pytest.raises(TypeError, match="cannot CBOR-encode"):
        cbor.dumps({1, 2})
