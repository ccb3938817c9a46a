"""paged's C GEMM for quantised weights: torch reference, ISA paths agree, build, fallback."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from paged.runner.cpu_kernels import QGemm, QGemmLibrary, build, load_qgemm
from paged.runner.cpu_kernels.packing import pack_q4, unpack_q4

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
ROWS = (1, 3, 8, 33, 64)
DTYPES = (torch.float32, torch.bfloat16)


def _lib(isa: str = "native") -> QGemmLibrary:
    lib = load_qgemm(isa)
    assert lib is not None, "qgemm did not build (see the log)"
    return lib


def _int8_levels(g: torch.Tensor) -> torch.Tensor:
    """Groups [..., 32] float32 -> int8 codes times amax / 127, as float32."""
    d = g.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return torch.round(g * inv) * d


def _quantised_activations(x: torch.Tensor, ratio: float | None = None) -> torch.Tensor:
    """What the kernel multiplies: each row's groups of 32 as int8 codes times amax / 127,
    plus the residual quantised the same way where amax > ratio * mean |x| (ratio given)."""
    m, k = x.shape
    g = x.float().reshape(m, k // 32, 32)
    first = _int8_levels(g)
    if ratio is None:
        return first.reshape(m, k)
    a = g.abs()
    outlier = (a.amax(-1, keepdim=True) > ratio * a.mean(-1, keepdim=True)).float()
    return (first + outlier * _int8_levels(g - first)).reshape(m, k)


def _int4(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    scale = torch.rand(n, k // 32, generator=gen) * 0.02
    offset = -8 * scale + torch.randn(n, k // 32, generator=gen) * 0.01
    return codes, scale, offset


def _int8(n: int, k: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    return codes, torch.rand(n, k // group, generator=gen) * 0.002


def _check(
    gemm: QGemm,
    weight: torch.Tensor,
    m: int,
    x_dtype: torch.dtype,
    y_dtype: torch.dtype,
    ratio: float | None = None,
) -> None:
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, gemm.in_features, generator=gen) * 2
    x[:, ::37] *= 20  # outlier channels: some groups take the second level, some not
    x = x.to(x_dtype)
    y = gemm.matmul(x, y_dtype, outlier_ratio=ratio)
    assert y.dtype == y_dtype and y.shape == (m, gemm.out_features)
    ref = _quantised_activations(x, ratio).double() @ weight.double().t()
    # float32 accumulation of K / 32 group products, then the output dtype's rounding.
    tol = 2e-6 if y_dtype == torch.float32 else 2**-8
    scale = ref.abs().amax(dim=1, keepdim=True).clamp(min=1e-6)
    err = ((y.double() - ref).abs() / scale).max().item()
    assert err < tol, (m, x_dtype, y_dtype, err)
    if y_dtype == torch.bfloat16:  # the bf16 output is the float32 result rounded once
        f32 = gemm.matmul(x, torch.float32, outlier_ratio=ratio)
        assert torch.equal(y, f32.to(torch.bfloat16))


@needs_cc
@pytest.mark.parametrize(("n", "k"), [(37, 96), (576, 1536), (16, 32)])
def test_int4_kernel_equals_the_reference(n: int, k: int) -> None:
    codes, scale, offset = _int4(n, k, seed=n)
    gemm = QGemm.int4(_lib(), codes, scale, offset)
    weight = codes.float() * scale.repeat_interleave(32, 1) + offset.repeat_interleave(32, 1)
    assert torch.equal(gemm.dequantized(), weight)  # the packing keeps every value exactly
    for m in ROWS:
        for x_dtype in DTYPES:
            for y_dtype in DTYPES:
                for ratio in (None, 0.0, 8.0):
                    _check(gemm, weight, m, x_dtype, y_dtype, ratio)


@needs_cc
@pytest.mark.parametrize("group", [32, 16])
@pytest.mark.parametrize(("n", "k"), [(37, 96), (200, 576)])
def test_int8_kernel_equals_the_reference(n: int, k: int, group: int) -> None:
    codes, scale = _int8(n, k, group, seed=n + group)
    gemm = QGemm.int8(_lib(), codes, scale)
    weight = codes.float() * scale.repeat_interleave(group, 1)
    assert torch.equal(gemm.dequantized(), weight)
    for m in ROWS:
        for x_dtype in DTYPES:
            for y_dtype in DTYPES:
                for ratio in (None, 0.0, 8.0):
                    _check(gemm, weight, m, x_dtype, y_dtype, ratio)


@needs_cc
def test_two_levels_make_outlier_groups_nearly_exact() -> None:
    """One outlier per group: one int8 level loses the other values, two keep ~14 bits."""
    codes, scale, offset = _int4(64, 256, seed=9)
    gemm = QGemm.int4(_lib(), codes, scale, offset)
    weight = gemm.dequantized().double()
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(1))
    x[:, ::32] = 300.0
    exact = x.double() @ weight.t()
    one, two = gemm.matmul(x), gemm.matmul(x, outlier_ratio=8.0)
    err1 = float((one.double() - exact).norm() / exact.norm())
    err2 = float((two.double() - exact).norm() / exact.norm())
    assert err2 < err1 / 100 and err2 < 1e-4, (err1, err2)  # measured 0.0126 vs 4.6e-5


@needs_cc
def test_every_isa_path_gives_the_same_results() -> None:
    """VNNI, AVX2 and scalar sum the same integers; only float32 summation order differs."""
    libs = {isa: _lib(isa) for isa in build.ISAS}
    assert libs["scalar"].isa == "scalar"
    codes, scale, offset = _int4(51, 160, seed=5)
    codes8, scale8 = _int8(51, 160, 16, seed=6)
    x = torch.randn(9, 160, generator=torch.Generator().manual_seed(7))
    x[:, ::29] *= 30
    outs4 = {isa: QGemm.int4(lib, codes, scale, offset).matmul(x) for isa, lib in libs.items()}
    outs8 = {isa: QGemm.int8(lib, codes8, scale8).matmul(x) for isa, lib in libs.items()}
    two = {
        isa: QGemm.int4(lib, codes, scale, offset).matmul(x, outlier_ratio=8.0)
        for isa, lib in libs.items()
    }
    for outs in (outs4, outs8, two):
        for isa, y in outs.items():
            torch.testing.assert_close(y, outs["scalar"], rtol=1e-5, atol=1e-5, msg=isa)


def _gemms(lib: QGemmLibrary, n: int, k: int, seed: int) -> dict[str, tuple[QGemm, torch.Tensor]]:
    """One kernel of each packed format (4-bit, 8-bit per 32, 8-bit per 16) and its weight."""
    codes, scale, offset = _int4(n, k, seed=seed)
    q4 = QGemm.int4(lib, codes, scale, offset)
    c32, s32 = _int8(n, k, 32, seed=seed + 1)
    c16, s16 = _int8(n, k, 16, seed=seed + 2)
    return {
        "q4": (
            q4,
            codes.float() * scale.repeat_interleave(32, 1) + offset.repeat_interleave(32, 1),
        ),
        "q8": (QGemm.int8(lib, c32, s32), c32.float() * s32.repeat_interleave(32, 1)),
        "q8_16": (QGemm.int8(lib, c16, s16), c16.float() * s16.repeat_interleave(16, 1)),
    }


# Row counts around the kernels' row blocks (8 rows on AVX512-VNNI, 4 below) and the
# 256-row (128 with two levels) activation chunks; N around the 16-wide tiles; K of one group.
EDGE_ROWS = (2, 5, 7, 9, 15, 17, 127, 129, 257)
EDGE_SHAPES = ((16, 32), (17, 32), (33, 64), (47, 96))


@needs_cc
@pytest.mark.parametrize(("n", "k"), EDGE_SHAPES)
def test_blocking_edges_equal_the_reference(n: int, k: int) -> None:
    for gemm, weight in _gemms(_lib(), n, k, seed=n * k).values():
        for m in EDGE_ROWS:
            for ratio in (None, 0.0, 8.0):
                _check(gemm, weight, m, torch.bfloat16, torch.float32, ratio)


@needs_cc
@pytest.mark.parametrize("isa", build.ISAS)
def test_a_row_gets_the_same_bits_alone_or_in_any_batch(isa: str) -> None:
    """Each output row's float32 sums run in the same order whatever row block, chunk or
    neighbours it is computed with: batching (decode of many streams, prefill, spec
    verification) never changes a row's result, on every ISA path."""
    gen = torch.Generator().manual_seed(11)
    for name, (gemm, _) in _gemms(_lib(isa), 33, 96, seed=4).items():
        x = torch.randn(140, 96, generator=gen)
        x[:, ::23] *= 30  # outlier groups: the second level covers some rows' groups only
        x[3, 32:64] = 0.0  # an all-zero group
        for ratio in (None, 8.0, 0.0):
            whole = gemm.matmul(x, outlier_ratio=ratio)
            alone = torch.cat([gemm.matmul(x[i : i + 1], outlier_ratio=ratio) for i in range(10)])
            assert torch.equal(whole[:10], alone), (isa, name, ratio)
            for lo, hi in ((0, 3), (5, 14), (7, 140), (130, 139)):
                part = gemm.matmul(x[lo:hi], outlier_ratio=ratio)
                assert torch.equal(part, whole[lo:hi]), (isa, name, ratio, lo, hi)


@needs_cc
def test_isa_paths_agree_at_the_blocking_edges() -> None:
    libs = {isa: _lib(isa) for isa in build.ISAS}
    x = torch.randn(17, 64, generator=torch.Generator().manual_seed(3))
    x[:, ::29] *= 30
    outs = {isa: {k: g.matmul(x, outlier_ratio=8.0) for k, (g, _) in _gemms(lib, 17, 64, 8).items()}
            for isa, lib in libs.items()}  # fmt: skip
    for isa, per_format in outs.items():
        for name, y in per_format.items():
            torch.testing.assert_close(y, outs["scalar"][name], rtol=1e-5, atol=1e-5, msg=isa)


@needs_cc
def test_bad_inputs_are_refused() -> None:
    codes, scale, offset = _int4(16, 64, seed=1)
    gemm = QGemm.int4(_lib(), codes, scale, offset)
    with pytest.raises(ValueError, match="x must be"):
        gemm.matmul(torch.randn(2, 32))
    with pytest.raises(ValueError, match="float32/bfloat16"):
        gemm.matmul(torch.randn(2, 64).half())
    with pytest.raises(ValueError, match="K % 32"):
        pack_q4(codes[:, :48], scale[:, :1], offset[:, :1])
    # A strided (non-contiguous) activation is copied, not misread.
    wide = torch.randn(3, 128)
    torch.testing.assert_close(gemm.matmul(wide[:, :64]), gemm.matmul(wide[:, :64].contiguous()))
    assert gemm.matmul(torch.empty(0, 64)).shape == (0, 16)


def test_packing_round_trips() -> None:
    codes, scale, offset = _int4(21, 64, seed=2)
    packed = pack_q4(codes, scale, offset)
    assert packed.numel() == 2 * 2 * 384  # 2 tiles of 16 rows x 2 groups
    weight = codes.float() * scale.repeat_interleave(32, 1) + offset.repeat_interleave(32, 1)
    assert torch.equal(unpack_q4(packed, 21, 64), weight)


@needs_cc
def test_compiles_once_into_the_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(build, "_LOADED", {})
    lib = load_qgemm("scalar")
    assert lib is not None and lib.path.parent == tmp_path
    assert [p.name for p in tmp_path.iterdir()] == [lib.path.name]  # no temporary left behind
    mtime = lib.path.stat().st_mtime_ns
    monkeypatch.setattr(build, "_LOADED", {})
    again = load_qgemm("scalar")
    assert again is not None and again.path == lib.path and lib.path.stat().st_mtime_ns == mtime


def test_a_failed_build_falls_back_to_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No compiler (or one that fails): one warning, and the layers take torch's kernels."""
    from paged.runner.layers.quant_staging import QuantStaging
    from paged.runner.layers.quantized_linear import Int4GroupMatmul

    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(build, "_LOADED", {})
    broken = tmp_path / "broken-cc"
    broken.write_text("#!/bin/sh\n[ \"$1\" = --version ] && exit 0\necho 'error: no' >&2\nexit 1\n")
    broken.chmod(0o755)
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        assert load_qgemm("native", compiler="/nonexistent/cc") is None
        assert load_qgemm("native", compiler=str(broken)) is None
    warnings = [r for r in caplog.records if "qgemm C kernel unavailable" in r.message]
    assert len(warnings) == 2 and "failed" in warnings[1].getMessage()
    monkeypatch.setenv("CC", "/nonexistent/cc")
    codes, scale, offset = _int4(16, 64, seed=3)
    staging = QuantStaging(16, 64)
    rows = staging.narrow(0, 0, 16)
    _FakeInt4.install(rows, codes, scale, offset)
    assert isinstance(staging.finalize(torch.bfloat16), Int4GroupMatmul)


class _FakeInt4:
    """A minimal QuantizedCheckpointTensor of 4-bit groups."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> None:
        self.codes, self.scale, self.offset = codes, scale, offset
        self.shape = tuple(codes.shape)
        self.type_name = "Q4_1"

    def int4_groups(self) -> _FakeInt4:
        return self

    def int8_groups(self) -> None:
        return None

    @staticmethod
    def install(
        rows: object, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor
    ) -> None:
        rows.copy_(_FakeInt4(codes, scale, offset))  # type: ignore[attr-defined]


def test_isa_env_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(build.ISA_ENV, "avx9000")
    with pytest.raises(ValueError, match="PAGED_QGEMM_ISA"):
        load_qgemm()
    monkeypatch.setenv(build.ISA_ENV, "off")
    assert load_qgemm() is None


@needs_cc
def test_two_processes_compiling_at_once_both_load(tmp_path: Path) -> None:
    """Each build writes a private temporary and renames it into place: no torn file."""
    import os
    import subprocess
    import sys

    script = (
        "from paged.runner.cpu_kernels import load_qgemm; "
        "lib = load_qgemm('avx2'); assert lib is not None; print(lib.path)"
    )
    env = {**os.environ, build.CACHE_ENV: str(tmp_path)}
    procs = [
        subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    paths = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(paths) == 1 and [f.name for f in tmp_path.iterdir()] == [Path(paths.pop()).name]


def _near_threshold_groups(m: int, groups: int, ratio: float, seed: int) -> torch.Tensor:
    """[m, groups * 32] float32 whose groups sit within a few ulps of the level-2 test
    amax > ratio * mean |x| (either side), where a sum of |x| in another order than
    the scalar code's could decide it the other way."""
    gen = torch.Generator().manual_seed(seed)
    rest = torch.rand(m, groups, 31, generator=gen) * 2 - 1
    s = rest.abs().sum(-1, keepdim=True)
    peak = ratio * s / (32 - ratio)  # amax = ratio * (amax + s) / 32
    ulps = torch.randint(-4, 5, (m, groups, 1), generator=gen).float()
    peak = peak * (1 + ulps * 2.0**-23)
    sign = torch.where(torch.rand(m, groups, 1, generator=gen) < 0.5, -1.0, 1.0)
    g = torch.cat([rest, sign * peak], dim=-1)
    perm = torch.argsort(torch.rand(m, groups, 32, generator=gen), dim=-1)
    return torch.gather(g, -1, perm).reshape(m, groups * 32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_vector_quantiser_gives_the_scalar_bits(dtype: torch.dtype) -> None:
    """The VNNI path quantises with AVX-512 (qgemm_quantize.c); its codes, scales and
    level-2 choices must be the scalar code's bit for bit (or outputs would change)."""
    from paged.runner.cpu_kernels.qgemm import quantized_activations

    lib = _lib()
    gen = torch.Generator().manual_seed(5)
    plain = torch.randn(24, 192, generator=gen)
    plain[:, ::37] *= 30
    plain[3] = 0.0  # all-zero groups: xs 0, no residual
    plain[4, :32] = 1e-40  # subnormal: 1 / xs overflows
    plain[5, 32:64] = torch.arange(32) - 15.5  # halves: round to even
    ratio = 4.0
    cases = [plain, _near_threshold_groups(24, 6, ratio, seed=6), torch.zeros(0, 64)]
    for x in cases:
        x = x.to(dtype)
        for level2 in (None, ratio, 0.0):
            for flip in (False, True):
                vec = quantized_activations(lib, x, level2, flip=flip)
                ref = quantized_activations(lib, x, level2, flip=flip, scalar=True)
                for name, a, b in zip(vec._fields, vec, ref, strict=True):
                    assert torch.equal(a, b), (lib.isa, dtype, level2, flip, name)
    near = quantized_activations(lib, cases[1].to(dtype), ratio, scalar=True).has2
    assert 0 < near.float().mean() < 1  # the threshold cases fall on both sides


def test_quantised_codes_match_the_torch_definition() -> None:
    from paged.runner.cpu_kernels.qgemm import quantized_activations

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 96, generator=gen) * 3
    got = quantized_activations(_lib(), x)
    g = x.reshape(5, 3, 32)
    xs = g.abs().amax(-1) / 127.0
    q = torch.round(g * (1.0 / xs).unsqueeze(-1))
    assert torch.equal(got.xs, xs)
    assert torch.equal(got.q.float(), q.reshape(5, 96))
    assert torch.equal(got.xsum, xs * q.sum(-1))
    with pytest.raises(ValueError, match="x must be"):
        quantized_activations(_lib(), torch.zeros(2, 40))


@needs_cc
def test_the_cache_key_follows_what_native_means_on_this_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache shared with a machine of another CPU must not load its -march=native build."""
    from paged.runner import c_compile

    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(build, "_LOADED", {})
    here = load_qgemm("native")
    assert here is not None
    assert "#define __STDC__ 1" in c_compile._native_target(shutil.which("cc") or "cc")
    monkeypatch.setattr(c_compile, "_native_target", lambda compiler: "#define __other_cpu__ 1")
    monkeypatch.setattr(build, "_LOADED", {})
    other = load_qgemm("native")
    assert other is not None and other.path != here.path
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([here.path.name, other.path.name])
    monkeypatch.setattr(build, "_LOADED", {})
    scalar = load_qgemm("scalar")  # its flags carry -march=native too
    monkeypatch.setattr(
        c_compile, "_native_target", lambda compiler: "#define __yet_another_cpu__ 1"
    )
    monkeypatch.setattr(build, "_LOADED", {})
    scalar_elsewhere = load_qgemm("scalar")
    assert scalar is not None and scalar_elsewhere is not None
    assert scalar_elsewhere.path != scalar.path
