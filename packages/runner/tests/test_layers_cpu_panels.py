"""Column-panel CPU GEMMs: same products as F.linear, chosen per call, dropped on reload."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from paged.runner.config import CpuWeightPanels, ModelConfig
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
from paged.runner.loader import loader as loader_module
from paged.runner.loader.loader import available_host_memory, cpu_panel_bytes

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
    untied = ParallelLMHead(1000, 16, tp=TPGroup(), dtype=F32)
    untied.load_weight("weight", table, None)
    untied.build_cpu_panels()
    untied.load_weight("weight", -table, None)
    assert untied.cpu_panels is None
    torch.testing.assert_close(untied.compute_logits(h), -(h @ table.T), rtol=1e-5, atol=1e-5)


def _panel_state(model: torch.nn.Module) -> set[bool]:
    modules = [m for m in model.modules() if isinstance(m, (ShardedLinear, ParallelLMHead))]
    assert any(isinstance(m, ParallelLMHead) for m in modules)
    return {m.cpu_panels is not None for m in modules}


@pytest.mark.parametrize(
    ("mode", "available", "built"),
    [
        ("on", 0, True),
        ("off", 1 << 40, False),
        ("auto", 1 << 40, True),
        ("auto", 1024, False),  # the copy would not fit in a quarter of this
        ("auto", None, False),  # no /proc/meminfo: do not guess
    ],
)
def test_loader_builds_panels_per_mode_and_memory(
    tiny_checkpoint: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
    mode: CpuWeightPanels,
    available: int | None,
    built: bool,
) -> None:
    monkeypatch.setattr(loader_module, "available_host_memory", lambda: available)
    path = tiny_checkpoint("llama")
    model = load_model(ModelConfig.from_pretrained(str(path), cpu_weight_panels=mode), "cpu")
    assert isinstance(model, torch.nn.Module)
    assert _panel_state(model) == {built}
    assert 0 < cpu_panel_bytes(model) < 1 << 30


def test_panels_are_float32_only_and_the_mode_is_checked(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    path = tiny_checkpoint("llama")
    config = ModelConfig.from_pretrained(str(path), dtype="bfloat16", cpu_weight_panels="on")
    model = load_model(config, "cpu")
    assert isinstance(model, torch.nn.Module)
    assert _panel_state(model) == {False}
    with pytest.raises(ValueError, match="cpu_weight_panels"):
        ModelConfig.from_pretrained(str(path), cpu_weight_panels="yes")  # type: ignore[arg-type]


def test_available_host_memory_reads_meminfo() -> None:
    available = available_host_memory()
    if Path("/proc/meminfo").exists():
        assert available is not None and available > 0
    else:
        assert available is None
