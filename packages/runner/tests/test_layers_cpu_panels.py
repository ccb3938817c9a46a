"""Column-panel CPU GEMMs: same products as F.linear, chosen per call, dropped on reload."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from paged.runner.config import ModelConfig
from paged.runner.layers.cpu_panels import (
    MAX_ROWS,
    TARGET_PANEL_WIDTH,
    make_panels,
    panel_matmul,
    panel_width,
    use_panels,
)
from paged.runner.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    ShardedLinear,
)
from paged.runner.layers.parallel import TPGroup
from paged.runner.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from paged.runner.loader import load_model

F32 = torch.float32


def test_panel_width_prefers_divisors_near_the_target() -> None:
    assert panel_width(3072) == 384
    assert panel_width(49152) == 384
    assert panel_width(576) == 576  # up to twice the target: one panel
    assert panel_width(960) == 320
    assert panel_width(2560) == 320  # 2560 / 384 is not whole; 320 divides it
    assert panel_width(4099) == TARGET_PANEL_WIDTH  # prime: padded panels
    with pytest.raises(ValueError, match="out_features"):
        panel_width(0)


@settings(max_examples=40, deadline=None)
@given(
    out_features=st.integers(1, 2000),
    in_features=st.integers(1, 40),
    rows=st.integers(1, 9),
    column_major=st.booleans(),
)
def test_panel_matmul_equals_linear(
    out_features: int, in_features: int, rows: int, column_major: bool
) -> None:
    gen = torch.Generator().manual_seed(out_features * 131 + in_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    if column_major:
        weight = weight.t().contiguous().t()
    x = torch.randn(rows, in_features, generator=gen)
    panels = make_panels(weight)
    assert panels.is_contiguous()
    y = panel_matmul(x, panels, out_features)
    assert y.shape == (rows, out_features) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_layers_use_panels_only_for_two_or_more_rows() -> None:
    row = RowParallelLinear(40, 900, bias=True, tp=TPGroup(), dtype=F32)
    w, b = torch.randn(900, 40), torch.randn(900)
    row.load_weight("weight", w, None)
    row.load_weight("bias", b, None)
    row.build_cpu_panels()
    assert row.cpu_panels is not None
    assert not use_panels(torch.randn(1, 40), row.cpu_panels)
    assert use_panels(torch.randn(2, 40), row.cpu_panels)
    assert not use_panels(torch.randn(MAX_ROWS + 1, 40), row.cpu_panels)
    for n in (1, 2, 7):
        x = torch.randn(n, 40)
        torch.testing.assert_close(row(x), x @ w.T + b, rtol=1e-5, atol=1e-5)


def test_reloading_a_weight_drops_stale_panels() -> None:
    merged = MergedColumnParallelLinear(8, [800, 800], tp=TPGroup(), dtype=F32)
    gate, up = torch.randn(800, 8), torch.randn(800, 8)
    merged.load_weight("weight", gate, 0)
    merged.load_weight("weight", up, 1)
    merged.build_cpu_panels()
    merged.load_weight("weight", -up, 1)
    assert merged.cpu_panels is None  # otherwise 2+ rows would use the old `up`
    x = torch.randn(3, 8)
    torch.testing.assert_close(merged(x), x @ torch.cat([gate, -up]).T)


def test_qkv_with_bias_and_tied_head_through_panels() -> None:
    qkv = QKVParallelLinear(16, 8, 4, 2, bias=True, tp=TPGroup(), dtype=F32)
    parts = {s: torch.randn(n, 16) for s, n in (("q", 32), ("k", 16), ("v", 16))}
    for s, w in parts.items():
        qkv.load_weight("weight", w, s)
        qkv.load_weight("bias", torch.full((w.shape[0],), 0.5), s)
    qkv.build_cpu_panels()
    x = torch.randn(5, 16)
    torch.testing.assert_close(qkv(x), x @ torch.cat(list(parts.values())).T + 0.5)

    emb = VocabParallelEmbedding(1000, 16, tp=TPGroup(), dtype=F32)
    table = torch.randn(1000, 16)
    emb.load_weight("weight", table, None)
    head = ParallelLMHead(1000, 16, tp=TPGroup(), dtype=F32)
    head.tie_to(emb)
    head.build_cpu_panels()
    h = torch.randn(4, 16)
    torch.testing.assert_close(head.compute_logits(h), h @ table.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(head.compute_logits(h[:1]), h[:1] @ table.T)


@pytest.mark.parametrize("panels", [True, False])
def test_loader_builds_panels_when_configured(
    tiny_checkpoint: Callable[..., Path], panels: bool
) -> None:
    path = tiny_checkpoint("llama")
    model = load_model(ModelConfig.from_pretrained(str(path), cpu_weight_panels=panels), "cpu")
    assert isinstance(model, torch.nn.Module)
    linears = [m for m in model.modules() if isinstance(m, ShardedLinear)]
    assert linears
    assert all((m.cpu_panels is not None) == panels for m in linears)
    heads = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
    assert heads and all((m.cpu_panels is not None) == panels for m in heads)
