"""The reference paged attention against a naive per-query, per-head dense computation."""

from __future__ import annotations

import math

import pytest
import torch

from paged.kernels import reference
from paged.kernels.testing import PagedBatch, make_paged_batch


def naive_attention(
    batch: PagedBatch, scale: float, sliding_window: int | None, soft_cap: float | None
) -> torch.Tensor:
    """Loop over every query row and head; math written out scalar-style."""
    out = torch.zeros(batch.query.shape, dtype=torch.float64)
    starts = batch.query_start_loc.tolist()
    num_heads = batch.query.shape[1]
    group = num_heads // batch.key_cache.shape[2]
    for r, seq_len in enumerate(batch.seq_lens.tolist()):
        keys = batch.dense_keys[r].double()
        values = batch.dense_values[r].double()
        q_len = starts[r + 1] - starts[r]
        for i in range(q_len):
            pos = seq_len - q_len + i
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            for h in range(num_heads):
                q = batch.query[starts[r] + i, h].double()
                kv_head = h // group
                scores = []
                for j in range(lo, pos + 1):
                    s = float(q @ keys[j, kv_head]) * scale
                    if soft_cap is not None:
                        s = soft_cap * math.tanh(s / soft_cap)
                    scores.append(s)
                m = max(scores)
                weights = [math.exp(s - m) for s in scores]
                total = sum(weights)
                acc = torch.zeros(keys.shape[-1], dtype=torch.float64)
                for w, j in zip(weights, range(lo, pos + 1), strict=True):
                    acc += w / total * values[j, kv_head]
                out[starts[r] + i, h] = acc
    return out


CASES = [
    # (query_lens, seq_lens, Hq, Hkv, D, block_size, window, soft_cap)
    ([1, 1, 1], [5, 17, 1], 4, 4, 8, 4, None, None),  # decode only, MHA
    ([6, 1, 3, 0], [6, 9, 11, 4], 4, 2, 16, 4, None, None),  # mixed, GQA 2, an idle request
    ([7, 2], [10, 13], 6, 1, 8, 8, 3, None),  # MQA + sliding window
    ([4, 1], [4, 20], 2, 2, 8, 16, None, 5.0),  # soft cap, block bigger than prefill
    ([5, 1], [12, 7], 8, 2, 8, 2, 4, 2.0),  # everything at once
]


@pytest.mark.parametrize("case", CASES)
def test_reference_matches_naive(case: tuple) -> None:  # type: ignore[type-arg]
    q_lens, s_lens, hq, hkv, d, bs, window, cap = case
    batch = make_paged_batch(
        q_lens, s_lens, num_heads=hq, num_kv_heads=hkv, head_size=d, block_size=bs,
        padding_tokens=2,
    )  # fmt: skip
    scale = d**-0.5
    got = reference.paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.block_table,
        batch.query_start_loc, batch.seq_lens, scale,
        max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len,
        sliding_window=window, soft_cap=cap,
    )  # fmt: skip
    want = naive_attention(batch, scale, window, cap)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert got[-2:].abs().max() == 0  # padding rows stay zero


def test_reference_writes_into_out() -> None:
    batch = make_paged_batch([2, 1], [3, 5], num_heads=2, num_kv_heads=1, head_size=8, block_size=2)
    out = torch.full_like(batch.query, float("nan"))
    got = reference.paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.block_table,
        batch.query_start_loc, batch.seq_lens, 0.3, max_query_len=2, max_seq_len=5, out=out,
    )  # fmt: skip
    assert got is out
    torch.testing.assert_close(out.double(), naive_attention(batch, 0.3, None, None))


def _call(batch: PagedBatch, **overrides: object) -> torch.Tensor:
    args: dict[str, object] = {
        "query": batch.query, "key_cache": batch.key_cache, "value_cache": batch.value_cache,
        "block_table": batch.block_table, "query_start_loc": batch.query_start_loc,
        "seq_lens": batch.seq_lens, "scale": 0.5, "max_query_len": batch.max_query_len,
        "max_seq_len": batch.max_seq_len,
    }  # fmt: skip
    args.update(overrides)
    return reference.paged_attention(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"query": torch.zeros(3, 3, 8)}, "multiple of num_kv_heads"),
        ({"query": torch.zeros(3, 4, 4)}, "head_size"),
        ({"block_table": torch.zeros(2, 2)}, "block_table must have dtype"),
        ({"seq_lens": torch.tensor([3, 5, 1], dtype=torch.int32)}, "query_start_loc must have"),
        ({"query_start_loc": torch.tensor([0, 2, 1], dtype=torch.int32)}, "non-decreasing"),
        ({"seq_lens": torch.tensor([1, 5], dtype=torch.int32)}, "query length 2 > seq_len 1"),
        ({"max_seq_len": 4}, "exceed max_query_len"),
        ({"scale": 0.0}, "scale"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"soft_cap": -1.0}, "soft_cap"),
        ({"out": torch.zeros(3, 4, 4)}, "out must match query"),
    ],
)
def test_reference_rejects_bad_arguments(overrides: dict[str, object], match: str) -> None:
    batch = make_paged_batch([2, 1], [3, 5], num_heads=4, num_kv_heads=2, head_size=8, block_size=2)
    with pytest.raises(ValueError, match=match):
        _call(batch, **overrides)


def test_reference_rejects_mixed_cache_dtypes() -> None:
    # A cache may hold another dtype than the query (--kv-cache-dtype), but K and V
    # caches must agree.
    batch = make_paged_batch([2, 1], [3, 5], num_heads=4, num_kv_heads=2, head_size=8, block_size=2)
    with pytest.raises(ValueError, match="value_cache dtype"):
        _call(batch, key_cache=batch.key_cache.half(), value_cache=batch.value_cache)
