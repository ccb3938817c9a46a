"""The per-rank attention shards add up to the full layer, for even, replicated and uneven splits.

Every rank of a TP group is built in this one process (a 1-process gloo group
satisfies TPGroup's check; no collective is called): each computes causal
GQA attention over its own q and KV heads and its o_proj partial product, and
the sum over ranks (what the all-reduce does) must equal the unsharded layer.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from paged.runner.layers.linear import QKVParallelLinear, RowParallelLinear
from paged.runner.layers.parallel import TPGroup

F32 = torch.float32
HEAD = 4
HIDDEN = 24


@pytest.fixture(scope="module", autouse=True)
def one_process_group() -> Iterator[None]:
    store = dist.HashStore()  # type: ignore[attr-defined]  # exported at runtime, not in stubs
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def attention(qkv: QKVParallelLinear, x: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention over this layer's heads: [tokens, num_heads * HEAD]."""
    q, k, v = qkv(x).split([qkv.q_size, qkv.kv_size, qkv.kv_size], dim=-1)
    t = x.shape[0]
    group = qkv.num_heads // qkv.num_kv_heads
    q = q.view(t, qkv.num_heads, HEAD).transpose(0, 1)
    k = k.view(t, qkv.num_kv_heads, HEAD).transpose(0, 1).repeat_interleave(group, 0)
    v = v.view(t, qkv.num_kv_heads, HEAD).transpose(0, 1).repeat_interleave(group, 0)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(0, 1).reshape(t, qkv.q_size)


def build(
    heads: int, kv_heads: int, tp: TPGroup, weights: dict[str, torch.Tensor]
) -> tuple[QKVParallelLinear, RowParallelLinear]:
    qkv = QKVParallelLinear(HIDDEN, HEAD, heads, kv_heads, bias=True, tp=tp, dtype=F32)
    o_proj = RowParallelLinear(
        heads * HEAD, HIDDEN, bias=False, reduce_results=False, tp=tp, dtype=F32,
        shard=qkv.o_proj_shard,
    )  # fmt: skip
    for part in ("q", "k", "v"):
        qkv.load_weight("weight", weights[f"{part}.weight"], part)
        qkv.load_weight("bias", weights[f"{part}.bias"], part)
    o_proj.load_weight("weight", weights["o.weight"], None)
    return qkv, o_proj


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp"),
    [(4, 2, 2), (4, 1, 2), (6, 3, 2), (9, 3, 2), (9, 3, 4), (8, 2, 3), (6, 6, 4), (5, 5, 5)],
)
def test_rank_shards_sum_to_the_full_layer(heads: int, kv_heads: int, tp: int) -> None:
    gen = torch.Generator().manual_seed(heads * 100 + kv_heads * 10 + tp)
    weights = {
        "q.weight": torch.randn(heads * HEAD, HIDDEN, generator=gen),
        "k.weight": torch.randn(kv_heads * HEAD, HIDDEN, generator=gen),
        "v.weight": torch.randn(kv_heads * HEAD, HIDDEN, generator=gen),
        "q.bias": torch.randn(heads * HEAD, generator=gen),
        "k.bias": torch.randn(kv_heads * HEAD, generator=gen),
        "v.bias": torch.randn(kv_heads * HEAD, generator=gen),
        "o.weight": torch.randn(HIDDEN, heads * HEAD, generator=gen),
    }
    x = torch.randn(7, HIDDEN, generator=gen)
    with torch.no_grad():
        full_qkv, full_o = build(heads, kv_heads, TPGroup(), weights)
        want = full_o(attention(full_qkv, x))
        got = torch.zeros_like(want)
        for rank in range(tp):
            qkv, o_proj = build(heads, kv_heads, TPGroup(rank, tp), weights)
            got += o_proj(attention(qkv, x))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
