"""Linear / embedding / norm layers: weight sharding arithmetic at TP=1 and shape checks."""

from __future__ import annotations

import pytest
import torch

from paged.runner.layers.activation import get_gated_activation
from paged.runner.layers.layernorm import RMSNorm
from paged.runner.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from paged.runner.layers.parallel import TPGroup
from paged.runner.layers.rotary import rope_scaling_from_hf
from paged.runner.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

F32 = torch.float32


def test_qkv_packs_q_k_v_rows() -> None:
    layer = QKVParallelLinear(8, 2, 4, 2, bias=True, tp=TPGroup(), dtype=F32)
    q, k, v = torch.randn(8, 8), torch.randn(4, 8), torch.randn(4, 8)
    for name, w in (("q", q), ("k", k), ("v", v)):
        layer.load_weight("weight", w, name)
        layer.load_weight("bias", torch.full((w.shape[0],), float(ord(name))), name)
    assert torch.equal(layer.weight, torch.cat([q, k, v]))
    assert layer.bias is not None
    assert layer.bias.tolist() == [113.0] * 8 + [107.0] * 4 + [118.0] * 4
    x = torch.randn(3, 8)
    torch.testing.assert_close(layer(x)[:, 8:12], x @ k.T + 107.0)
    with pytest.raises(ValueError, match=r"has shape \(4, 8\) but the model config implies"):
        layer.load_weight("weight", torch.randn(4, 8), "q")
    with pytest.raises(ValueError, match="shard_id"):
        layer.load_weight("weight", q, "o")


def test_merged_column_and_row_and_replicated() -> None:
    merged = MergedColumnParallelLinear(4, [6, 6], tp=TPGroup(), dtype=F32)
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    merged.load_weight("weight", up, 1)
    merged.load_weight("weight", gate, 0)
    assert torch.equal(merged.weight, torch.cat([gate, up]))
    row = RowParallelLinear(6, 4, bias=True, tp=TPGroup(), dtype=F32)
    w, b = torch.randn(4, 6), torch.randn(4)
    row.load_weight("weight", w, None)
    row.load_weight("bias", b, None)
    x = torch.randn(2, 6)
    torch.testing.assert_close(row(x), x @ w.T + b)
    col = ColumnParallelLinear(4, 6, tp=TPGroup(), dtype=F32)
    col.load_weight("weight", gate, None)
    assert torch.equal(col.weight, gate)
    rep = ReplicatedLinear(4, 6, dtype=F32)
    rep.load_weight("weight", up, None)
    assert torch.equal(rep.weight, up)
    with pytest.raises(ValueError, match="has no parameter 'bias'"):
        rep.load_weight("bias", torch.zeros(6), None)


def test_embedding_and_tied_head() -> None:
    emb = VocabParallelEmbedding(10, 4, tp=TPGroup(), dtype=F32)
    table = torch.randn(10, 4)
    emb.load_weight("weight", table, None)
    ids = torch.tensor([0, 9, 3])
    assert torch.equal(emb(ids), table[ids])
    head = ParallelLMHead(10, 4, tp=TPGroup(), dtype=F32)
    head.tie_to(emb)
    h = torch.randn(2, 4)
    torch.testing.assert_close(head.compute_logits(h), h @ table.T)
    with pytest.raises(ValueError, match="same shape"):
        ParallelLMHead(11, 4, tp=TPGroup(), dtype=F32).tie_to(emb)


def test_rmsnorm_and_activation_and_rope_parsing() -> None:
    norm = RMSNorm(4, 1e-6, dtype=F32)
    norm.load_weight("weight", torch.tensor([1.0, 2.0, 3.0, 4.0]), None)
    x = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    torch.testing.assert_close(norm(x), x * torch.tensor([1.0, 2.0, 3.0, 4.0]), atol=1e-5, rtol=0)
    out, res = norm.forward_with_residual(x, x)
    torch.testing.assert_close(res, 2 * x)
    torch.testing.assert_close(out, norm(2 * x))
    act = get_gated_activation("silu")
    y = torch.randn(3, 8)
    torch.testing.assert_close(act(y), torch.nn.functional.silu(y[:, :4]) * y[:, 4:])
    assert rope_scaling_from_hf({"rope_type": "default", "rope_theta": 1.0}) is None
    linear = rope_scaling_from_hf({"rope_type": "linear", "factor": 2.0})
    assert linear is not None and linear.factor == 2.0
    with pytest.raises(ValueError, match="'dynamic' is not supported"):
        rope_scaling_from_hf({"rope_type": "dynamic", "factor": 2.0})
