"""Quantised GGUF weights: exact decoding, kernels against the float32 reference, loading."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from paged.runner.cpu_kernels.build import ISA_ENV
from paged.runner.cpu_kernels.packing_native import FMT_Q5K
from paged.runner.layers.linear import MergedColumnParallelLinear, ReplicatedLinear
from paged.runner.layers.parallel import TPGroup
from paged.runner.layers.quant_staging import QuantStaging
from paged.runner.layers.quantized_linear import (
    DenseMatmul,
    Int4GroupMatmul,
    Int8ChannelMatmul,
    Int8GroupMatmul,
    QGemmInt4Table,
    QGemmMatmul,
    QGemmTable,
    RowSplitMatmul,
    requantize_int8_groups,
)
from paged.runner.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from paged.runner.loader.gguf_quant import GGUFQuantizedTensor
from paged.runner.loader.gguf_weights import unpermute_qk

Q = gguf.GGMLQuantizationType


@pytest.fixture(params=["qgemm", "torch"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test once with paged's C kernel (the default) and once with torch's kernels."""
    if request.param == "torch":
        monkeypatch.setenv(ISA_ENV, "off")
    return str(request.param)


def _quantized(qtype: Q, rows: int, cols: int, seed: int = 0) -> GGUFQuantizedTensor:
    """A [rows, cols] GGUF tensor of `qtype` with random contents (the gguf writer's bytes)."""
    rng = np.random.default_rng(seed)
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0):
        w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
        return GGUFQuantizedTensor(gguf.quants.quantize(w, qtype), qtype, cols)
    # K-quants: gguf-py cannot quantise them; random blocks with sane f16 scales.
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    scales = rng.uniform(1e-3, 4e-3, (data.shape[0], 2)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q4_K:
        data[:, 0:4] = scales  # d, dmin
    else:  # Q6_K/Q5_K keep d (and for Q5_K dmin) at different places
        data[:, -2:] = scales[:, :2] if qtype == Q.Q6_K else data[:, -2:]
        if qtype == Q.Q5_K:
            data[:, 0:4] = scales
    return GGUFQuantizedTensor(data.reshape(rows, -1), qtype, cols)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K])
def test_int4_groups_reproduce_the_gguf_decoding_exactly(qtype: Q) -> None:
    """Q5_K (block_q5_K: Q4_K's scales, qh[32] fifth bits, qs[128]): 5-bit codes."""
    t = _quantized(qtype, 8, 512)
    g = t.int4_groups()
    assert g is not None
    assert int(g.codes.max()) == (31 if qtype == Q.Q5_K else 15)
    w = g.codes.float() * g.scale.repeat_interleave(32, 1) + g.offset.repeat_interleave(32, 1)
    torch.testing.assert_close(w, t.dequantize(), rtol=0, atol=1e-7)


def test_int8_groups_reproduce_q6_k_exactly() -> None:
    t = _quantized(Q.Q6_K, 8, 512)
    g = t.int8_groups()
    assert g is not None and t.int4_groups() is None
    assert g.scale.shape == (8, 512 // 16)
    assert int(g.codes.min()) >= -32 and int(g.codes.max()) <= 31
    w = g.codes.float() * g.scale.repeat_interleave(16, 1)
    torch.testing.assert_close(w, t.dequantize(), rtol=0, atol=0)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q5_0])
def test_int8_groups_reproduce_q8_0_and_q5_0_exactly(qtype: Q) -> None:
    t = _quantized(qtype, 8, 256)
    g = t.int8_groups()
    assert g is not None and t.int4_groups() is None
    assert g.scale.shape == (8, 256 // 32)
    if qtype == Q.Q5_0:  # w = d (q - 16), q 5 bits: every code of -16..15 is used
        assert (int(g.codes.min()), int(g.codes.max())) == (-16, 15)
    w = g.codes.float() * g.scale.repeat_interleave(32, 1)
    torch.testing.assert_close(w, t.dequantize(), rtol=0, atol=0)


def test_q5_1_has_no_exact_group_form_and_is_re_quantised_within_half_a_step() -> None:
    t = _quantized(Q.Q5_1, 8, 256)
    assert t.int4_groups() is None and t.int8_groups() is None  # 5-bit codes plus a min
    dense = t.dequantize()
    codes, scale = requantize_int8_groups(dense)
    assert codes.dtype == torch.int8 and scale.shape == (8, 256 // 32)
    w = codes.float() * scale.repeat_interleave(32, 1)
    half_step = (scale / 2).repeat_interleave(32, 1)
    assert bool(((w - dense).abs() <= half_step * (1 + 1e-6)).all())
    with pytest.raises(ValueError, match="groups of 32"):
        requantize_int8_groups(dense[:, :48])


def test_row_and_column_slices_and_permutation_match_the_dense_tensor() -> None:
    t = _quantized(Q.Q4_1, 24, 128)
    dense = t.dequantize()
    torch.testing.assert_close(t.narrow(0, 4, 8).dequantize(), dense[4:12])
    torch.testing.assert_close(t.narrow(1, 32, 64).dequantize(), dense[:, 32:96])
    perm = unpermute_qk(torch.arange(24), 3)
    torch.testing.assert_close(t.permute_rows(perm).dequantize(), unpermute_qk(dense, 3))
    with pytest.raises(ValueError, match="blocks"):
        t.narrow(1, 16, 32)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# Output error of y = x W^T against float32 activations and the dequantised
# float32 weight. Exact formats: torch's kernels round x, the scales and y to
# bfloat16 (each ~2^-9 relative): measured 2.8-3.4e-3; the C kernel rounds x
# to int8 per 32 inputs (at most 1/254 of a group's largest value each) and y
# to bfloat16: measured 5.6-6.4e-3, under the same 1e-2 bound. Re-quantised:
# int8 per channel adds ~1/254 of a row's largest weight per weight (7.3-7.8e-3).
# Re-quantised to int8 groups of 32 (Q5_1; Q5_K on torch's kernels only, the C kernel
# keeps it exact as FMT_Q5K): at most half a step, 1/254 of a group's largest weight,
# per weight; `weight_error` bounds the logged error of the weight against the
# checkpoint (measured: Q5_1 5.4e-3 on the C kernel, Q5_K 3.8e-3; torch's kernels add
# their bf16-scale bound, ~3.3e-3).
_INT8_GROUPS = {"qgemm": QGemmTable, "torch": Int8GroupMatmul}


@pytest.mark.parametrize(
    ("qtype", "kernels", "bound", "weight_error"),
    [
        (Q.Q4_0, {"qgemm": QGemmMatmul, "torch": Int4GroupMatmul}, 1e-2, 0.0),
        (Q.Q4_1, {"qgemm": QGemmMatmul, "torch": Int4GroupMatmul}, 1e-2, 0.0),
        (Q.Q4_K, {"qgemm": QGemmMatmul, "torch": Int4GroupMatmul}, 1e-2, 0.0),
        (Q.Q8_0, _INT8_GROUPS, 1e-2, 0.0),
        (Q.Q5_0, _INT8_GROUPS, 1e-2, 0.0),
        (Q.Q6_K, {"qgemm": QGemmTable, "torch": Int8ChannelMatmul}, 3e-2, 0.0),
        (Q.Q5_1, _INT8_GROUPS, 1e-2, 1e-2),
        (Q.Q5_K, {"qgemm": QGemmMatmul, "torch": Int8GroupMatmul}, 1e-2, 1e-2),
    ],
)
def test_layer_output_error_is_what_the_format_implies(
    qtype: Q, kernels: dict[str, type], bound: float, weight_error: float, backend: str
) -> None:
    torch.manual_seed(0)
    t = _quantized(qtype, 96, 512)
    layer = ReplicatedLinear(512, 96, dtype=torch.bfloat16)
    layer.start_quantized_load()
    layer.load_weight("weight", t, None)
    report = layer.finish_quantized_load(torch.bfloat16)
    assert isinstance(layer.quant, kernels[backend])
    assert report.source == qtype.name
    assert layer.weight.device.type == "meta"  # the dense copy is gone
    # 5 rows; 80 rows: torch's int4 layers switch to their bf16 copy from
    # LARGE_BATCH_ROWS (64) rows, the C kernel runs every size.
    for rows in (5, 80):
        x = torch.randn(rows, 512)
        ref = x @ t.dequantize().t()
        y = layer(x.bfloat16())
        assert y.dtype == torch.bfloat16 and y.shape == (rows, 96)
        assert _rel(y, ref) < bound
    assert report.rel_error < bound
    if backend == "qgemm":  # the logged error is the weight's against the checkpoint's
        assert layer.quant is not None
        assert report.rel_error == pytest.approx(_rel(layer.quant.dequantized(), t.dequantize()))
    if qtype == Q.Q5_K and backend == "qgemm":
        weight_error = 0.0  # FMT_Q5K: the file's 5.5 bits a weight, exact
        assert isinstance(layer.quant, QGemmMatmul) and layer.quant.gemm.fmt == FMT_Q5K
        assert "Q5_K" in report.kernel
    if weight_error > 0:  # re-quantised: the log says so, and what it cost
        assert 0 < report.rel_error < weight_error
        assert f"{qtype.name} re-quantised to int8 groups of 32" in report.kernel
    elif backend == "qgemm":
        assert report.rel_error < 1e-6  # the C kernel keeps the checkpoint's weights exactly
        assert "qgemm" in report.kernel and "re-quantised" not in report.kernel


def test_mixed_formats_in_one_packed_layer(backend: str) -> None:
    """C kernel: each run of rows exact on its own path; torch: re-quantised to int8."""
    torch.manual_seed(0)
    gate, up = _quantized(Q.Q4_K, 64, 256, seed=1), _quantized(Q.Q6_K, 64, 256, seed=2)
    layer = MergedColumnParallelLinear(256, [64, 64], tp=TPGroup(), dtype=torch.bfloat16)
    layer.start_quantized_load()
    layer.load_weight("weight", gate, 0)
    layer.load_weight("weight", up, 1)
    report = layer.finish_quantized_load(torch.bfloat16)
    assert report.source == "Q4_K+Q6_K"
    w = torch.cat([gate.dequantize(), up.dequantize()])
    x = torch.randn(3, 256)
    if backend == "torch":
        assert isinstance(layer.quant, Int8ChannelMatmul)
        assert _rel(layer(x.bfloat16()), x @ w.t()) < 3e-2
        return
    assert isinstance(layer.quant, RowSplitMatmul)
    assert [type(p) for p in layer.quant.parts] == [QGemmMatmul, QGemmTable]
    assert torch.equal(layer.quant.dequantized(), w)
    assert report.rel_error < 1e-6
    assert _rel(layer(x.bfloat16()), x @ w.t()) < 1e-2


def test_q5_k_rows_beside_4_bit_rows_of_no_q5_k_form_are_re_quantised_not_refused() -> None:
    """One run of int4 rows (Q4_0 gate, Q5_K up) whose scales have no common Q5_K form:
    the layer still loads (int8 groups of 32, logged as re-quantised), never a crash."""
    gate, up = _quantized(Q.Q4_0, 32, 256, seed=3), _quantized(Q.Q5_K, 32, 256, seed=4)
    layer = MergedColumnParallelLinear(256, [32, 32], tp=TPGroup(), dtype=torch.bfloat16)
    layer.start_quantized_load()
    layer.load_weight("weight", gate, 0)
    layer.load_weight("weight", up, 1)
    report = layer.finish_quantized_load(torch.bfloat16)
    w = torch.cat([gate.dequantize(), up.dequantize()])
    if isinstance(layer.quant, QGemmMatmul):  # no C kernel: torch's path (re-quantised)
        pytest.fail("Q4_0 scales cannot take Q5_K's form")
    assert "re-quantised" in report.kernel and 0 < report.rel_error < 1e-2
    x = torch.randn(3, 256)
    assert _rel(layer(x.bfloat16()), x @ w.t()) < 2e-2


def test_plain_float_rows_stay_dense_and_unset_rows_are_refused() -> None:
    w = torch.randn(16, 64)
    staging = QuantStaging(16, 64)
    staging.copy_(w)
    kernel = staging.finalize(torch.bfloat16)
    assert isinstance(kernel, DenseMatmul)
    partial = QuantStaging(16, 64)
    partial.narrow(0, 0, 8).copy_(w[:8])
    with pytest.raises(ValueError, match="never set"):
        partial.finalize(torch.bfloat16)
    with pytest.raises(ValueError, match="shape"):
        partial.narrow(0, 0, 8).copy_(w)


def test_tied_q8_0_embedding_looks_up_exact_rows_and_computes_logits(backend: str) -> None:
    torch.manual_seed(0)
    t = _quantized(Q.Q8_0, 200, 64)
    emb = VocabParallelEmbedding(200, 64, tp=TPGroup(), dtype=torch.bfloat16)
    head = ParallelLMHead(200, 64, tp=TPGroup(), dtype=torch.bfloat16)
    head.tie_to(emb)
    for m in (emb, head):
        m.start_quantized_load()
    emb.load_weight("weight", t, None)
    assert emb.finish_quantized_load(torch.bfloat16) is not None
    assert head.finish_quantized_load(torch.bfloat16) is None
    want = QGemmTable if backend == "qgemm" else Int8GroupMatmul
    assert isinstance(emb.quant, want) and head.quant is emb.quant
    dense = t.dequantize()
    ids = torch.tensor([0, 7, 199])
    torch.testing.assert_close(emb(ids).float(), dense[ids].bfloat16().float())
    h = torch.randn(4, 64)
    logits = head.compute_logits(h.bfloat16())
    assert logits.dtype == torch.float32 and logits.shape == (4, 200)
    assert _rel(logits, h @ dense.t()) < 1e-2


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_K])
def test_tied_int4_embedding_keeps_its_codes_on_the_c_kernel(qtype: Q, backend: str) -> None:
    """A 4-bit table (Llama-3.2's tied Q4_0 head): exact rows and logits on the C kernel's
    4-bit path (its threads), not torch's one-thread int8-per-channel re-quantisation."""
    torch.manual_seed(0)
    t = _quantized(qtype, 200, 256)
    emb = VocabParallelEmbedding(200, 256, tp=TPGroup(), dtype=torch.bfloat16)
    head = ParallelLMHead(200, 256, tp=TPGroup(), dtype=torch.bfloat16)
    head.tie_to(emb)
    for m in (emb, head):
        m.start_quantized_load()
    emb.load_weight("weight", t, None)
    report = emb.finish_quantized_load(torch.bfloat16)
    assert report is not None
    assert head.finish_quantized_load(torch.bfloat16) is None
    dense = t.dequantize()
    ids = torch.tensor([0, 7, 199])
    h = torch.randn(4, 256)
    logits = head.compute_logits(h.bfloat16())
    assert logits.dtype == torch.float32 and logits.shape == (4, 200)
    if backend == "torch":  # no C kernel: re-quantised per channel, as before
        assert isinstance(emb.quant, Int8ChannelMatmul)
        assert _rel(logits, h @ dense.t()) < 3e-2
        return
    assert isinstance(emb.quant, QGemmInt4Table) and head.quant is emb.quant
    assert report.rel_error < 1e-6 and "re-quantised" not in report.kernel
    assert torch.equal(emb.quant.dequantized(), dense)
    torch.testing.assert_close(emb(ids).float(), dense[ids].bfloat16().float(), rtol=0, atol=0)
    assert _rel(logits, h @ dense.t()) < 1e-2
    # the same kernel as a 4-bit projection of that weight: identical logits
    assert torch.equal(
        logits,
        emb.quant.gemm.matmul(h.bfloat16(), torch.float32, outlier_ratio=emb.quant.outlier_ratio),
    )


def test_int4_layer_switches_to_its_bf16_copy_at_large_batch_rows() -> None:
    from paged.runner.layers.quantized_linear import LARGE_BATCH_ROWS, _Groups

    assert LARGE_BATCH_ROWS is not None
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (48, 64), generator=gen, dtype=torch.uint8)
    scale = torch.rand(48, 2, generator=gen) * 0.1
    offset = torch.randn(48, 2, generator=gen) * 0.1
    kernel = Int4GroupMatmul(_Groups(codes, scale, offset), torch.bfloat16, "Q4_1")
    assert kernel.dense_t is not None
    for rows in (LARGE_BATCH_ROWS - 1, LARGE_BATCH_ROWS):
        x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
        int4 = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, kernel.packed, 32, kernel.scales_and_zeros
        )
        want = x @ kernel.dense_t if rows >= LARGE_BATCH_ROWS else int4
        assert torch.equal(kernel.matmul(x), want)
        # Either way the same weights up to bf16 rounding of scale/zero/weight.
        torch.testing.assert_close(kernel.matmul(x).float(), int4.float(), rtol=0.02, atol=0.05)
