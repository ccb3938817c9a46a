"""Attention layer, backends and metadata builder."""

from __future__ import annotations

import pytest
import torch

from paged.runner.attention import torch_attention
from paged.runner.attention.backends import (
    AttentionBackend,
    AttentionMetadataBuilder,
    select_attention_backend,
)
from paged.runner.attention.layer import Attention
from paged.runner.attention.metadata import AttentionMetadata


def test_backend_selection_per_device_and_override() -> None:
    assert select_attention_backend("cpu").name == "torch"
    assert select_attention_backend("cuda").name == "triton"
    assert select_attention_backend("cuda", "torch").name == "torch"
    assert select_attention_backend("cpu", "auto").name == "torch"
    assert select_attention_backend("cpu", "triton").name == "triton"
    assert AttentionBackend("torch").kernels is torch_attention
    with pytest.raises(ValueError, match="attention_backend: 'flash' is unknown"):
        select_attention_backend("cpu", "flash")


def test_builder_slices_persistent_buffers() -> None:
    md = AttentionMetadataBuilder().build(
        num_reqs=2,
        num_actual_tokens=5,
        query_start_loc=torch.tensor([0, 3, 5, 5, 5], dtype=torch.int32),
        seq_lens=torch.tensor([7, 2, 0, 0], dtype=torch.int32),
        block_table=torch.zeros(4, 3, dtype=torch.int32),
        slot_mapping=torch.arange(8),
        max_query_len=3,
        max_seq_len=7,
    )
    assert md.num_reqs == 2
    assert md.query_start_loc.tolist() == [0, 3, 5]
    assert md.block_table.shape == (2, 3)
    assert md.slot_mapping.tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="query_start_loc"):
        AttentionMetadataBuilder().build(
            num_reqs=3,
            num_actual_tokens=1,
            query_start_loc=torch.zeros(2, dtype=torch.int32),
            seq_lens=torch.zeros(3, dtype=torch.int32),
            block_table=torch.zeros(3, 1, dtype=torch.int32),
            slot_mapping=torch.zeros(1, dtype=torch.int64),
            max_query_len=1,
            max_seq_len=1,
        )


def _dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    # q [T, Hq, D], k/v [T, Hkv, D], one sequence.
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1)
    v = v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    t = q.shape[0]
    scores = scores.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_padded_rows_are_not_cached_and_come_out_zero() -> None:
    """T > num_actual_tokens (CUDA-graph padding): pads neither written nor attended."""
    torch.manual_seed(0)
    hq, hkv, d, bs = 4, 2, 8, 4
    attn = Attention(hq, d, d**-0.5, hkv, backend=AttentionBackend("torch"))
    n, pad = 6, 2
    q = torch.randn(n + pad, hq * d)
    k = torch.randn(n + pad, hkv * d)
    v = torch.randn(n + pad, hkv * d)
    kv_cache = torch.zeros(2, 4, bs, hkv, d)
    blocks = [3, 1]
    slots = [blocks[p // bs] * bs + p % bs for p in range(n)] + [-1] * pad
    md = AttentionMetadata(
        num_actual_tokens=n,
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_table=torch.tensor([blocks], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=n,
        max_seq_len=n,
    )
    out = attn(q, k, v, kv_cache, md)
    assert out.shape == (n + pad, hq * d)
    assert torch.equal(out[n:], torch.zeros(pad, hq * d))
    expected = _dense_causal(
        q[:n].view(n, hq, d), k[:n].view(n, hkv, d), v[:n].view(n, hkv, d), d**-0.5
    )
    torch.testing.assert_close(out[:n].view(n, hq, d), expected, atol=1e-5, rtol=0)
    # Only the real tokens' slots were written; blocks 0 and 2 stay empty.
    assert torch.count_nonzero(kv_cache[:, [0, 2]]) == 0
    written = kv_cache[0, 3].reshape(bs, hkv * d)
    torch.testing.assert_close(written, k[:bs])


def test_no_cache_path_is_dense_causal() -> None:
    torch.manual_seed(1)
    attn = Attention(4, 8, 0.3, 1, backend=AttentionBackend("torch"))
    q, k, v = torch.randn(5, 32), torch.randn(5, 8), torch.randn(5, 8)
    out = attn(q, k, v, None, None)
    expected = _dense_causal(q.view(5, 4, 8), k.view(5, 1, 8), v.view(5, 1, 8), 0.3)
    torch.testing.assert_close(out.view(5, 4, 8), expected, atol=1e-5, rtol=0)


def test_head_counts_validated() -> None:
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        Attention(6, 8, 1.0, 4, backend=AttentionBackend("torch"))
