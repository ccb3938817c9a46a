"""The batched torch attention equals paged.kernels.reference on random mixed batches."""

from __future__ import annotations

import random
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged.kernels import reference
from paged.runner.attention import torch_attention

batches = st.fixed_dictionaries(
    {
        "seed": st.integers(0, 2**16),
        "block_size": st.sampled_from([1, 4, 16]),
        "heads": st.sampled_from([(4, 4), (4, 2), (6, 2), (3, 1)]),
        "window": st.one_of(st.none(), st.integers(1, 12)),
        "soft_cap": st.one_of(st.none(), st.just(5.0)),
        # (tokens already cached, new tokens) per request; 0 new = decode-free row
        "reqs": st.lists(st.tuples(st.integers(0, 20), st.integers(1, 9)), min_size=1, max_size=5)
        | st.lists(st.tuples(st.integers(0, 20), st.just(1)), min_size=1, max_size=5),
        "pad": st.integers(0, 3),
    }
)


@settings(max_examples=60, deadline=None)
@given(batches)
def test_matches_reference(case: dict[str, Any]) -> None:
    gen = torch.Generator().manual_seed(case["seed"])
    rng = random.Random(case["seed"])
    hq, hkv = case["heads"]
    d, bs = 8, case["block_size"]
    reqs = case["reqs"]
    seq_lens = [c + n for c, n in reqs]
    width = max(-(-s // bs) for s in seq_lens)
    num_blocks = width * len(reqs) + 2
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    table = torch.tensor(
        [ids[i * width : (i + 1) * width] for i in range(len(reqs))], dtype=torch.int32
    )
    caches = [torch.randn(num_blocks, bs, hkv, d, generator=gen) for _ in range(2)]
    mine = [c.clone() for c in caches]
    starts = [0]
    slots: list[int] = []
    for i, (cached, new) in enumerate(reqs):
        starts.append(starts[-1] + new)
        for p in range(cached, cached + new):
            slots.append(int(table[i, p // bs]) * bs + p % bs)
    t = starts[-1]
    slots += [-1] * case["pad"]
    q = torch.randn(t + case["pad"], hq, d, generator=gen)
    k = torch.randn(t + case["pad"], hkv, d, generator=gen)
    v = torch.randn(t + case["pad"], hkv, d, generator=gen)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    reference.reshape_and_cache(k, v, caches[0], caches[1], slot_mapping)
    torch_attention.reshape_and_cache(k, v, mine[0], mine[1], slot_mapping)
    assert torch.equal(caches[0], mine[0]) and torch.equal(caches[1], mine[1])
    args = (
        table,
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
        d**-0.5,
    )
    kwargs = {
        "max_query_len": max(n for _, n in reqs),
        "max_seq_len": max(seq_lens),
        "sliding_window": case["window"],
        "soft_cap": case["soft_cap"],
    }
    expected = reference.paged_attention(q[:t], caches[0], caches[1], *args, **kwargs)
    out = torch.full_like(q[:t], float("nan"))
    got = torch_attention.paged_attention(q[:t], mine[0], mine[1], *args, **kwargs, out=out)
    assert got is out
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
