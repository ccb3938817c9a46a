"""GGUF blocks packed straight into qgemm's tiles (cpu_kernels/repack.py, qgemm_repack.c).

The fast packer must give what the old path gave (the loader's codes and float32
scales through QGemm.int4 / QGemm.int8): the same bytes where the file's sub-scale
factoring is the one packing_native.factor_scales finds (llama.cpp's quantisers:
largest 6-bit scale and min 63, largest |Q6_K scale| stored as -128; Q4_0, Q4_1,
Q5_0 and Q8_0 always), otherwise the same values and the same matmul bits; and the
layers built from it the same kernels with the same outputs.
"""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
import torch

from paged.runner.cpu_kernels import QGemm, QGemmLibrary, load_qgemm
from paged.runner.cpu_kernels.repack import lookup_rows, repack_gguf
from paged.runner.layers import quant_staging
from paged.runner.layers.linear import MergedColumnParallelLinear, ReplicatedLinear
from paged.runner.layers.parallel import TPGroup
from paged.runner.layers.quantized_linear import (
    QGemmInt4Table,
    QGemmMatmul,
    QGemmTable,
    RowSplitMatmul,
)
from paged.runner.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from paged.runner.loader.gguf_quant import GGUFQuantizedTensor

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
Q = gguf.GGMLQuantizationType
SMALL = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0)  # gguf-py quantises these
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
ALL = (*SMALL, *K_QUANTS)
# (rows, cols): whole tiles; rows past the last tile (zero padding); 3 super-blocks a row
SHAPES = ((48, 512), (37, 256), (5, 768))
ROWS = (1, 2, 3, 9)  # the direct VNNI kernels (1-2 rows), the expanded tiles (3+)


def _lib() -> QGemmLibrary:
    lib = load_qgemm()
    assert lib is not None, "qgemm did not build (see the log)"
    return lib


def _k_scale_bytes(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per block [n, 8] -> Q4_K / Q5_K's 12 bytes (the inverse
    of llama.cpp's get_scale_min_k4)."""
    q = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    q[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    q[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    q[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return q


def _tensor(
    qtype: Q, rows: int, cols: int, seed: int, *, llama: bool = True
) -> GGUFQuantizedTensor:
    """[rows, cols] of `qtype` with random contents. K-quants: random blocks with f16
    scales in a sane range; llama: sub-scales as llama.cpp's quantisers write them
    (else random bytes: another factoring may multiply out to the same values)."""
    rng = np.random.default_rng(seed)
    if qtype in SMALL:
        w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
        return GGUFQuantizedTensor(gguf.quants.quantize(w, qtype), qtype, cols, name="w")
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = rows * cols // block
    data = rng.integers(0, 256, (n, size), dtype=np.uint8)
    scales = rng.uniform(1e-3, 4e-3, (n, 2)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q6_K:
        data[:, 208:210] = scales[:, :2]
        if llama:
            sc = data[:, 192:208].view(np.int8)
            sc[np.arange(n), rng.integers(0, 16, n)] = -128
    else:
        data[:, 0:4] = scales
        if llama:
            sc, mn = rng.integers(0, 64, (2, n, 8), dtype=np.uint8)
            sc[np.arange(n), rng.integers(0, 8, n)] = 63
            mn[np.arange(n), rng.integers(0, 8, n)] = 63
            data[:, 4:16] = _k_scale_bytes(sc, mn)
    return GGUFQuantizedTensor(data.reshape(rows, -1), qtype, cols, name="w")


def _old(lib: QGemmLibrary, t: GGUFQuantizedTensor) -> QGemm:
    """What the loader built before: codes and float32 scales through QGemm's packers."""
    g4 = t.int4_groups()
    if g4 is not None:
        return QGemm.int4(lib, g4.codes, g4.scale, g4.offset)
    g8 = t.int8_groups()
    assert g8 is not None
    return QGemm.int8(lib, g8.codes, g8.scale)


def _same_outputs(a: QGemm, b: QGemm, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for m in ROWS:
        x = torch.randn(m, a.in_features, generator=gen) * 2
        x[:, ::37] *= 20  # outlier groups: the second int8 level covers some
        for dtype in (torch.float32, torch.bfloat16):
            ya = a.matmul(x.to(dtype), torch.float32, outlier_ratio=4.0)
            yb = b.matmul(x.to(dtype), torch.float32, outlier_ratio=4.0)
            assert torch.equal(ya, yb), (m, dtype)


@pytest.mark.parametrize("qtype", ALL, ids=lambda q: q.name)
@pytest.mark.parametrize(("rows", "cols"), SHAPES)
def test_repacked_bytes_equal_the_old_packers(qtype: Q, rows: int, cols: int) -> None:
    lib = _lib()
    t = _tensor(qtype, rows, cols, seed=rows * cols + int(qtype))
    old = _old(lib, t)
    new = repack_gguf(lib, qtype.name, [t.block_rows()], cols)
    assert new is not None
    assert (new.fmt, new.sub, new.out_features, new.in_features) == (
        old.fmt, old.sub, rows, cols,
    )  # fmt: skip
    assert torch.equal(new.packed, old.packed)
    _same_outputs(new, old, seed=rows)


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda q: q.name)
def test_random_sub_scales_keep_the_values_and_the_output_bits(qtype: Q) -> None:
    """Any 6-bit / int8 sub-scales: the file's factoring may differ from the one the old
    packer found, the float32 scales the kernels multiply out may not."""
    lib = _lib()
    t = _tensor(qtype, 37, 512, seed=int(qtype), llama=False)
    old, new = _old(lib, t), repack_gguf(lib, qtype.name, [t.block_rows()], 512)
    assert new is not None and new.fmt == old.fmt and new.nbytes == old.nbytes
    assert torch.equal(new.dequantized(), old.dequantized())
    assert torch.equal(new.dequantized(), t.dequantize())
    _same_outputs(new, old, seed=3)


def test_rows_from_several_tensors_pack_as_their_concatenation() -> None:
    """q, k and v of one projection: rows of three tensors, tiles across their seams."""
    lib = _lib()
    parts = [_tensor(Q.Q4_K, rows, 256, seed=rows) for rows in (20, 7, 13)]
    whole = np.concatenate([p.data for p in parts])
    one = repack_gguf(lib, "Q4_K", [("qkv", whole)], 256)
    three = repack_gguf(lib, "Q4_K", [p.block_rows() for p in parts], 256)
    assert one is not None and three is not None
    assert torch.equal(one.packed, three.packed)


def test_what_the_old_packers_lay_out_otherwise_is_left_to_them() -> None:
    """None (the caller keeps the old path): a non-finite f16 scale, a Q4_1 tensor in Q4_0's
    form (offset -8 times the scale: packed as Q4_0), Q5_K codes that never pass 15."""
    lib = _lib()
    t = _tensor(Q.Q8_0, 16, 256, seed=1)
    t.data[3, 0:2] = np.array([np.inf], dtype=np.float16).view(np.uint8)
    assert repack_gguf(lib, "Q8_0", [t.block_rows()], 256) is None
    q41 = _tensor(Q.Q4_1, 16, 256, seed=2)
    blocks = q41.data.reshape(-1, 20)
    d = blocks[:, 0:2].copy().view(np.float16)
    blocks[:, 2:4] = (d * np.float16(-8)).view(np.uint8)
    assert repack_gguf(lib, "Q4_1", [q41.block_rows()], 256) is None
    old = _old(lib, q41)
    assert old.fmt == 7  # FMT_Q40: what the old packer made of it
    q5k = _tensor(Q.Q5_K, 16, 256, seed=3)
    q5k.data.reshape(-1, 176)[:, 16:48] = 0  # no fifth bits
    assert repack_gguf(lib, "Q5_K", [q5k.block_rows()], 256) is None
    assert repack_gguf(lib, "Q5_1", [q5k.block_rows()], 256) is None  # no tile format


def test_a_short_tensor_is_a_value_error_naming_it() -> None:
    lib = _lib()
    t = _tensor(Q.Q4_K, 16, 512, seed=4)
    with pytest.raises(ValueError, match=r"'blk\.3\.ffn_up\.weight'.*truncated or corrupt"):
        repack_gguf(lib, "Q4_K", [("blk.3.ffn_up.weight", t.data[:, :-1])], 512)
    with pytest.raises(ValueError, match=r"'blk\.3\.ffn_up\.weight'.*truncated or corrupt"):
        GGUFQuantizedTensor(
            t.data.reshape(-1)[:-144], Q.Q4_K, 512, rows=16, name="blk.3.ffn_up.weight"
        )


@pytest.mark.parametrize("qtype", ALL, ids=lambda q: q.name)
def test_looked_up_rows_equal_the_loaders_values(qtype: Q) -> None:
    """lookup_rows on the packed weight (native, or the old fmt 4 / 8 blocks): the float32
    values of the loader's codes and scales, bit for bit, negative ids from the end."""
    lib = _lib()
    t = _tensor(qtype, 37, 512, seed=int(qtype) + 7, llama=False)
    dense = t.dequantize()
    ids = torch.tensor([[0, 36], [17, -1]])
    new = repack_gguf(lib, qtype.name, [t.block_rows()], 512)
    assert new is not None
    g4 = t.int4_groups()
    if g4 is not None:
        exact = g4.codes.float() * g4.scale.repeat_interleave(32, 1)
        exact += g4.offset.repeat_interleave(32, 1)
        fallback = QGemm.int4(lib, g4.codes, g4.scale, g4.offset, native=False)
    else:
        g8 = t.int8_groups()
        assert g8 is not None
        exact = g8.codes.float() * g8.scale.repeat_interleave(512 // g8.scale.shape[1], 1)
        fallback = QGemm.int8(lib, g8.codes, g8.scale, native=False)
    assert torch.equal(exact, dense)
    for gemm in (new, fallback):
        rows = lookup_rows(gemm, ids)
        assert rows.shape == (2, 2, 512)
        assert torch.equal(rows.view(torch.int32), exact[ids].view(torch.int32))
    with pytest.raises(IndexError, match="37 rows"):
        lookup_rows(new, torch.tensor([37]))


def _staged(monkeypatch: pytest.MonkeyPatch, fast: bool) -> None:
    if not fast:  # the old path: decode, stage, pack with packing_native.py
        monkeypatch.setattr(quant_staging, "repack_runs", lambda *a: None)


def test_a_mixed_layer_is_built_the_same_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """Q4_K_M's qkv: Q4_K q and k, Q6_K v, in a row split whose parts hold the old path's
    bytes; the outputs are the same bits."""
    parts = [_tensor(Q.Q4_K, 64, 256, 1), _tensor(Q.Q4_K, 9, 256, 2), _tensor(Q.Q6_K, 23, 256, 3)]
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0)).bfloat16()
    out = {}
    for fast in (True, False):
        with monkeypatch.context() as patch:
            _staged(patch, fast)
            layer = MergedColumnParallelLinear(256, [64, 9, 23], tp=TPGroup(), dtype=torch.bfloat16)
            layer.start_quantized_load()
            for i, part in enumerate(parts):
                layer.load_weight("weight", part, i)
            report = layer.finish_quantized_load(torch.bfloat16)
            assert report.source == "Q4_K+Q6_K" and report.rel_error == 0.0
            assert isinstance(layer.quant, RowSplitMatmul)
            assert [type(p) for p in layer.quant.parts] == [QGemmMatmul, QGemmTable]
            w = torch.cat([p.dequantize() for p in parts])
            assert torch.equal(layer.quant.dequantized(), w)
            packed = [p.gemm.packed for p in layer.quant.parts if isinstance(p, QGemmMatmul)]
            out[fast] = (layer(x), report, packed)
    assert torch.equal(out[True][0], out[False][0])
    assert out[True][1] == out[False][1]
    assert all(torch.equal(a, b) for a, b in zip(out[True][2], out[False][2], strict=True))


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q4_0], ids=lambda q: q.name)
def test_a_tied_table_looks_up_and_computes_logits_as_before(
    monkeypatch: pytest.MonkeyPatch, qtype: Q
) -> None:
    t = _tensor(qtype, 200, 256, seed=11, llama=False)
    ids = torch.tensor([0, 7, 199, 7])
    h = torch.randn(4, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    out = {}
    for fast in (True, False):
        with monkeypatch.context() as patch:
            _staged(patch, fast)
            emb = VocabParallelEmbedding(200, 256, tp=TPGroup(), dtype=torch.bfloat16)
            head = ParallelLMHead(200, 256, tp=TPGroup(), dtype=torch.bfloat16)
            head.tie_to(emb)
            for m in (emb, head):
                m.start_quantized_load()
            emb.load_weight("weight", t, None)
            report = emb.finish_quantized_load(torch.bfloat16)
            assert head.finish_quantized_load(torch.bfloat16) is None
            assert report is not None and report.rel_error == 0.0
            want = QGemmTable if qtype in (Q.Q6_K, Q.Q8_0) else QGemmInt4Table
            assert type(emb.quant) is want and head.quant is emb.quant
            out[fast] = (emb(ids), head.compute_logits(h), report)
    assert torch.equal(out[True][0].view(torch.int16), out[False][0].view(torch.int16))
    assert torch.equal(out[True][1], out[False][1])
    assert out[True][2] == out[False][2]


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.Q4_1], ids=lambda q: q.name)
def test_a_linear_layer_reports_and_computes_as_before(
    monkeypatch: pytest.MonkeyPatch, qtype: Q
) -> None:
    t = _tensor(qtype, 96, 512, seed=5)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(2)).bfloat16()
    out = {}
    for fast in (True, False):
        with monkeypatch.context() as patch:
            _staged(patch, fast)
            layer = ReplicatedLinear(512, 96, dtype=torch.bfloat16)
            layer.start_quantized_load()
            layer.load_weight("weight", t, None)
            report = layer.finish_quantized_load(torch.bfloat16)
            assert isinstance(layer.quant, QGemmMatmul)
            out[fast] = (layer(x), report, type(layer.quant), layer.quant.gemm.packed)
    assert torch.equal(out[True][0], out[False][0])
    assert out[True][1:3] == out[False][1:3]
    assert torch.equal(out[True][3], out[False][3])
