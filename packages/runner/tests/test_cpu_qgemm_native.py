"""qgemm's GGUF-native layouts (Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q8_0 at the file's byte count).

The native weights hold the same values as qgemm.c's float32-scale blocks, so every
ISA path must give the same bits as those blocks at every row count (the direct
VNNI kernels at 1-2 rows, the per-tile expansion above), and the kernels the
dequantised reference within the tolerance test_cpu_qgemm.py uses. Q5_K has no
float32-scale layout to compare with: its rows must not depend on the path (direct
at 1-2 rows, expanded above) or the batch, and it meets the same reference.
"""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
import torch

from paged.runner.cpu_kernels import QGemm, QGemmLibrary, build, load_qgemm
from paged.runner.cpu_kernels.packing_native import (
    FMT_Q4K,
    FMT_Q5K,
    FMT_Q6K,
    FMT_Q40,
    FMT_Q41,
    FMT_Q80,
    factor_scales,
)
from paged.runner.loader.gguf_quant import GGUFQuantizedTensor

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
Q = gguf.GGMLQuantizationType
ROWS = (1, 2, 3, 9, 140)  # direct kernels (1, 2), one row block, several, two chunks


def _lib(isa: str = "native") -> QGemmLibrary:
    lib = load_qgemm(isa)
    assert lib is not None, "qgemm did not build (see the log)"
    return lib


def _q4k(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K's form: scale = d sc, offset = -(dmin m) per 32, f16 d/dmin per 256, 6-bit sc/m."""
    gen = torch.Generator().manual_seed(seed)
    sb = k // 256
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    d = (torch.rand(n, sb, 1, generator=gen) * 0.01).half().float()
    dmin = (torch.rand(n, sb, 1, generator=gen) * 0.01).half().float()
    sc = torch.randint(0, 64, (n, sb, 8), generator=gen).float()
    mins = torch.randint(0, 64, (n, sb, 8), generator=gen).float()
    return codes, (d * sc).reshape(n, k // 32), (-(dmin * mins)).reshape(n, k // 32)


def _q5k(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q5_K's form: Q4_K's scales with codes 0..31."""
    codes, scale, offset = _q4k(n, k, seed)
    gen = torch.Generator().manual_seed(seed)
    high = torch.randint(0, 2, (n, k), dtype=torch.uint8, generator=gen)
    return codes | (high << 4), scale, offset


def _q6k(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K's form: codes -32..31, scale = d sc per 16, f16 d per 256, int8 sc."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=gen)
    d = (torch.rand(n, k // 256, 1, generator=gen) * 0.001).half().float()
    sc = torch.randint(-128, 128, (n, k // 256, 16), generator=gen).float()
    return codes, (d * sc).reshape(n, k // 16)


def _q40(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    d = (torch.rand(n, k // 32, generator=gen) * 0.01).half().float()
    return codes, d, d * -8.0


def _q41(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    codes, d, _ = _q40(n, k, seed)
    m = (torch.randn(n, k // 32, generator=torch.Generator().manual_seed(seed)) * 0.05).half()
    return codes, d, m.float()


def _q80(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    return codes, (torch.rand(n, k // 32, generator=gen) * 0.002).half().float()


def _pairs(lib: QGemmLibrary, n: int, k: int, seed: int) -> dict[str, tuple[QGemm, QGemm]]:
    """Each native format and the float32-scale layout of the same values."""
    c4, s4, o4 = _q4k(n, k, seed)
    c6, s6 = _q6k(n, k, seed + 1)
    c0, s0, o0 = _q40(n, k, seed + 2)
    c1, s1, o1 = _q41(n, k, seed + 3)
    c8, s8 = _q80(n, k, seed + 4)
    return {
        "q4k": (QGemm.int4(lib, c4, s4, o4), QGemm.int4(lib, c4, s4, o4, native=False)),
        "q6k": (QGemm.int8(lib, c6, s6), QGemm.int8(lib, c6, s6, native=False)),
        "q40": (QGemm.int4(lib, c0, s0, o0), QGemm.int4(lib, c0, s0, o0, native=False)),
        "q41": (QGemm.int4(lib, c1, s1, o1), QGemm.int4(lib, c1, s1, o1, native=False)),
        "q80": (QGemm.int8(lib, c8, s8), QGemm.int8(lib, c8, s8, native=False)),
    }


def test_the_native_layouts_take_the_files_bytes() -> None:
    """Bits a weight: Q4_K and Q4_0 4.5, Q4_1 5, Q6_K 6.5625, Q8_0 8.5 (qgemm.c's blocks:
    6 for the 4-bit ones, 12 for Q6_K's two scales per 32, 10 for Q8_0)."""
    n, k = 64, 512
    pairs = _pairs(_lib(), n, k, seed=1)
    expected = {
        "q4k": (FMT_Q4K, 4.5, 6.0), "q6k": (FMT_Q6K, 6.5625, 12.0), "q40": (FMT_Q40, 4.5, 6.0),
        "q41": (FMT_Q41, 5.0, 6.0), "q80": (FMT_Q80, 8.5, 10.0),
    }  # fmt: skip
    for name, (native, packed) in pairs.items():
        fmt, bits, old_bits = expected[name]
        assert native.fmt == fmt, name
        assert native.nbytes * 8 == n * k * bits, name
        assert packed.nbytes * 8 == n * k * old_bits, name


@pytest.mark.parametrize("isa", build.ISAS)
@pytest.mark.parametrize(("n", "k"), [(37, 256), (16, 512), (70, 768)])
def test_native_weights_give_the_float32_layouts_bits(isa: str, n: int, k: int) -> None:
    """Same values, same float32 operations in the same order: equal bits at every row
    count, activation dtype and outlier setting, on every ISA path."""
    gen = torch.Generator().manual_seed(n + k)
    for name, (native, packed) in _pairs(_lib(isa), n, k, seed=n * k).items():
        assert torch.equal(native.dequantized(), packed.dequantized()), name
        for m in ROWS:
            x = torch.randn(m, k, generator=gen) * 2
            x[:, ::37] *= 20  # outlier groups: the second level covers some
            x[0, 32:64] = 0.0  # an all-zero group
            for dtype in (torch.float32, torch.bfloat16):
                for ratio in (None, 4.0, 0.0):
                    a = native.matmul(x.to(dtype), torch.float32, outlier_ratio=ratio)
                    b = packed.matmul(x.to(dtype), torch.float32, outlier_ratio=ratio)
                    assert torch.equal(a, b), (isa, name, m, dtype, ratio)


def test_q5k_packs_at_the_files_bytes_and_values() -> None:
    """5.5 bits a weight (GGUF's 176 bytes a 256), every code 0..31 kept exactly."""
    n, k = 40, 512
    codes, scale, offset = _q5k(n, k, seed=11)
    gemm = QGemm.int4(_lib(), codes, scale, offset)
    assert gemm.fmt == FMT_Q5K
    assert gemm.nbytes * 8 == 48 * k * 5.5  # 3 tiles of 16 rows
    exact = codes.float() * scale.repeat_interleave(32, 1) + offset.repeat_interleave(32, 1)
    assert torch.equal(gemm.dequantized(), exact)
    bad = scale * (1 + 2**-20)  # no f16 times a 6-bit integer: refused, not guessed
    with pytest.raises(ValueError, match="Q5_K"):
        QGemm.int4(_lib(), codes, bad, offset)


@pytest.mark.parametrize("isa", build.ISAS)
def test_q5k_rows_do_not_depend_on_the_batch_or_the_path(isa: str) -> None:
    """The direct VNNI kernel (1-2 rows) and the expanded 5-bit tiles (3+ rows) do the same
    float32 operations: each row's bits equal its bits in a 140-row call."""
    n, k = 37, 768
    gemm = QGemm.int4(_lib(isa), *_q5k(n, k, seed=5))
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(max(ROWS), k, generator=gen) * 2
    x[:, ::37] *= 20
    x[0, 32:64] = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        for ratio in (None, 4.0, 0.0):
            full = gemm.matmul(x.to(dtype), torch.float32, outlier_ratio=ratio)
            for m in ROWS[:-1]:
                part = gemm.matmul(x[:m].to(dtype), torch.float32, outlier_ratio=ratio)
                assert torch.equal(part, full[:m]), (isa, m, dtype, ratio)


def test_native_kernels_equal_the_dequantised_reference() -> None:
    """The int8-activation reference of test_cpu_qgemm.py (relative 2e-6 in float32)."""
    n, k = 45, 512
    pairs = _pairs(_lib(), n, k, seed=3)
    q5k = QGemm.int4(_lib(), *_q5k(n, k, seed=8))
    for name, native in [*((name, p[0]) for name, p in pairs.items()), ("q5k", q5k)]:
        weight = native.dequantized().double()
        for m in (1, 2, 5):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            g = x.reshape(m, k // 32, 32)
            d = g.abs().amax(-1, keepdim=True) / 127.0
            xq = (torch.round(g / d) * d).reshape(m, k).double()
            ref = xq @ weight.t()
            y = native.matmul(x, torch.float32)
            err = ((y.double() - ref).abs() / ref.abs().amax(1, keepdim=True)).max().item()
            assert err < 2e-6, (name, m, err)


def test_scales_without_the_files_form_keep_the_float32_blocks() -> None:
    """float32 scales that are no f16 times a small integer stay exact in fmt 4 / 8."""
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (32, 512), dtype=torch.uint8, generator=gen)
    scale, offset = torch.rand(32, 16, generator=gen), torch.rand(32, 16, generator=gen)
    assert QGemm.int4(_lib(), codes, scale, offset).fmt == 4
    codes8 = torch.randint(-32, 32, (32, 512), dtype=torch.int8, generator=gen)
    assert QGemm.int8(_lib(), codes8, torch.rand(32, 32, generator=gen)).fmt == 8
    wide = torch.randint(-100, 100, (32, 512), dtype=torch.int8, generator=gen)  # not 6-bit
    _, q6_scale = _q6k(32, 512, seed=6)
    assert QGemm.int8(_lib(), wide, q6_scale).fmt == 8  # and 16-input scales: no Q8_0
    c4, s4, o4 = _q4k(32, 512, seed=7)
    # K % 256 != 0: no Q4_K form; the scales are no f16 either (d sc rounds): fmt 4
    s4 = s4 * (1 + 2**-20)
    assert QGemm.int4(_lib(), c4[:, :480], s4[:, :15], o4[:, :15]).fmt == 4


def test_factor_scales_finds_a_factoring_whatever_the_largest_sub_scale() -> None:
    d = torch.tensor([0.0123, 3.5e-5, 0.5], dtype=torch.float16).float()
    q = torch.tensor([[40, 3, 0, 17], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.float32)
    values = d[:, None] * q
    found = factor_scales(values, tuple(range(63, 0, -1)), 0, 63)
    assert found is not None
    d16, codes = found
    assert torch.equal(d16.float()[:, None] * codes.float(), values)
    assert factor_scales(torch.tensor([[0.3, 0.7, 0.1]]), tuple(range(63, 0, -1)), 0, 63) is None


def _gguf_blocks(qtype: Q, rows: int, cols: int, seed: int) -> GGUFQuantizedTensor:
    """Random K-quant blocks with sane f16 scales (gguf-py cannot quantise K-quants)."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    scales = rng.uniform(1e-3, 4e-3, (data.shape[0], 2)).astype(np.float16).view(np.uint8)
    if qtype in (Q.Q4_K, Q.Q5_K):
        data[:, 0:4] = scales
    elif qtype == Q.Q6_K:
        data[:, -2:] = scales[:, :2]
    else:
        w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
        return GGUFQuantizedTensor(gguf.quants.quantize(w, qtype), qtype, cols)
    return GGUFQuantizedTensor(data.reshape(rows, -1), qtype, cols)


@pytest.mark.parametrize(
    ("qtype", "fmt"),
    [
        (Q.Q4_K, FMT_Q4K),
        (Q.Q5_K, FMT_Q5K),
        (Q.Q6_K, FMT_Q6K),
        (Q.Q4_0, FMT_Q40),
        (Q.Q4_1, FMT_Q41),
        (Q.Q8_0, FMT_Q80),
    ],
)
def test_a_gguf_tensor_packs_at_its_own_bytes_and_values(qtype: Q, fmt: int) -> None:
    """The loader's groups of a file's tensor factor back into the file's form: the
    packed weight is as large as the file's blocks and equals gguf-py's decoding."""
    t = _gguf_blocks(qtype, 48, 512, seed=int(qtype))
    g4, g8 = t.int4_groups(), t.int8_groups()
    # exactly the loader's values; gguf-py's decoding as test_layers_quantized_linear checks it
    if g4 is not None:
        gemm = QGemm.int4(_lib(), g4.codes, g4.scale, g4.offset)
        exact = g4.codes.float() * g4.scale.repeat_interleave(32, 1)
        exact += g4.offset.repeat_interleave(32, 1)
    else:
        assert g8 is not None
        gemm = QGemm.int8(_lib(), g8.codes, g8.scale)
        group = g8.codes.shape[1] // g8.scale.shape[1]
        exact = g8.codes.float() * g8.scale.repeat_interleave(group, 1)
    assert gemm.fmt == fmt
    assert gemm.nbytes == t.data.nbytes
    assert torch.equal(gemm.dequantized(), exact)
    torch.testing.assert_close(gemm.dequantized(), t.dequantize(), rtol=0, atol=1e-7)
