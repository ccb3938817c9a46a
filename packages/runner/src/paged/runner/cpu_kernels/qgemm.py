"""QGemm: one group-quantised weight in qgemm.c's layout, and y = x W^T through it."""

from __future__ import annotations

from typing import NamedTuple

import torch

from paged.runner.cpu_kernels.build import QGemmLibrary
from paged.runner.cpu_kernels.packing import pack_q4, pack_q8, unpack_q4, unpack_q8
from paged.runner.cpu_kernels.packing_native import (
    FMT_Q4K,
    FMT_Q5K,
    FMT_Q6K,
    FMT_Q40,
    FMT_Q41,
    FMT_Q80,
    native_nbytes,
    pack_q4k,
    pack_q5k,
    pack_q6k,
    pack_q40,
    pack_q41,
    pack_q80,
    unpack_q5,
)

_DTYPES = (torch.float32, torch.bfloat16)


class QGemm:
    """A packed [out, in] weight: 4-bit (w = d q + m per 32) or 8-bit (w = d q per 32 or 16).

    fmt 4 / 8: qgemm.c's blocks with float32 scales; FMT_Q4K / FMT_Q6K / FMT_Q40 /
    FMT_Q41 / FMT_Q80: the same values in GGUF's own byte count (qgemm_native.c),
    chosen by int4 / int8 whenever the scales have that form (native=False keeps
    fmt 4 / 8).

    matmul takes float32 or bfloat16 activations [M, in] (rows contiguous) and
    returns float32 or bfloat16 [M, out]; the activations are quantised to
    int8 per 32 inputs inside the kernel (qgemm.c).
    """

    def __init__(
        self, lib: QGemmLibrary, packed: torch.Tensor, fmt: int, shape: tuple[int, int], sub: int
    ) -> None:
        self.lib = lib
        self.packed = packed
        self.fmt = fmt
        self.out_features, self.in_features = shape
        self.sub = sub

    @classmethod
    def int4(
        cls, lib: QGemmLibrary, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
        *, native: bool = True,
    ) -> QGemm:  # fmt: skip
        """w = codes * scale + offset; codes uint8 [N, K] 0..15, scale/offset [N, K/32].

        native: Q4_0's form (f16 scale, offset -8 scale) or Q4_K's (f16 d and dmin per
        256 inputs times 6-bit integers) packed at the file's 4.5 bits a weight, else
        Q4_1's (f16 scale and offset) at 5.

        Codes 0..31 (GGUF Q5_K) take FMT_Q5K at 5.5 bits a weight whatever `native`
        says (qgemm.c has no float32-scale 5-bit layout); a ValueError when their
        scales have no Q5_K form.
        """
        shape = (codes.shape[0], codes.shape[1])
        if codes.numel() and int(codes.max()) > 15:
            packed5 = pack_q5k(codes, scale, offset)
            if packed5 is None:
                raise ValueError(
                    "codes: values past 15 need Q5_K's form (codes < 32, K a multiple of 256, "
                    "scale and offset f16 per 256 inputs times 6-bit integers)"
                )
            return cls(lib, packed5, FMT_Q5K, shape, 1)
        if native:
            for fmt, pack in ((FMT_Q40, pack_q40), (FMT_Q4K, pack_q4k), (FMT_Q41, pack_q41)):
                packed = pack(codes, scale, offset)
                if packed is not None:
                    return cls(lib, packed, fmt, shape, 1)
        return cls(lib, pack_q4(codes, scale, offset), 4, shape, 1)

    @classmethod
    def int8(
        cls, lib: QGemmLibrary, codes: torch.Tensor, scale: torch.Tensor, *, native: bool = True
    ) -> QGemm:
        """w = codes * scale; codes int8 [N, K], scale [N, K/32] or [N, K/16].

        native: Q6_K's form (codes -32..31, scale per 16 = f16 d per 256 times int8)
        packed at the file's 6.5625 bits a weight; Q8_0's (f16 scale per 32) at 8.5.
        """
        shape = (codes.shape[0], codes.shape[1])
        if native:
            packed6 = pack_q6k(codes, scale)
            if packed6 is not None:
                return cls(lib, packed6, FMT_Q6K, shape, 2)
            packed80 = pack_q80(codes, scale)
            if packed80 is not None:
                return cls(lib, packed80, FMT_Q80, shape, 1)
        packed, sub = pack_q8(codes, scale)
        return cls(lib, packed, 8, shape, sub)

    @property
    def nbytes(self) -> int:
        return self.packed.numel()

    def matmul(
        self, x: torch.Tensor, out_dtype: torch.dtype | None = None, *,
        outlier_ratio: float | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """x [M, in] (float32/bfloat16, unit column stride) -> [M, out] in out_dtype (x's).

        outlier_ratio: None, int8 activations per 32 inputs; a number r, a second
        int8 level (the residual x - xs q, quantised the same way: ~14 bits in
        all) for each group whose largest |x| exceeds r times its mean |x|
        (0: every group, twice the arithmetic; the weight bytes read stay).
        """
        out_dtype = x.dtype if out_dtype is None else out_dtype
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"x must be [M, {self.in_features}], got {tuple(x.shape)}")
        if x.dtype not in _DTYPES or out_dtype not in _DTYPES:
            raise ValueError(f"qgemm takes float32/bfloat16, got {x.dtype} -> {out_dtype}")
        if x.device.type != "cpu":
            raise ValueError(f"qgemm runs on CPU tensors, got {x.device}")
        if x.stride(1) != 1 or (x.shape[0] > 1 and x.stride(0) < x.shape[1]):
            x = x.contiguous()
        m = x.shape[0]
        y = torch.empty(m, self.out_features, dtype=out_dtype)
        x_bf16, y_bf16 = int(x.dtype == torch.bfloat16), int(out_dtype == torch.bfloat16)
        x_stride = x.stride(0) if m > 1 else self.in_features
        n, k = self.out_features, self.in_features
        levels, ratio = (1, 0.0) if outlier_ratio is None else (2, float(outlier_ratio))
        if self.fmt not in (4, 8):
            rc = self.lib.native(
                self.fmt, self.packed.data_ptr(), n, k, levels, ratio, x.data_ptr(), m,
                x_stride, x_bf16, y.data_ptr(), n, y_bf16,
            )  # fmt: skip
        elif self.fmt == 4:
            rc = self.lib.q4(
                self.packed.data_ptr(), n, k, levels, ratio, x.data_ptr(), m, x_stride, x_bf16,
                y.data_ptr(), n, y_bf16,
            )  # fmt: skip
        else:
            rc = self.lib.q8(
                self.packed.data_ptr(), n, k, self.sub, levels, ratio, x.data_ptr(), m, x_stride,
                x_bf16, y.data_ptr(), n, y_bf16,
            )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"qgemm failed with code {rc} (x {tuple(x.shape)}, W {n} x {k})")
        return y

    def dequantized(self) -> torch.Tensor:
        """The float32 [out, in] weight the kernel applies (exactly the packed values)."""
        n, k = self.out_features, self.in_features
        if self.fmt == 4:
            return unpack_q4(self.packed, n, k)
        if self.fmt == 8:
            return unpack_q8(self.packed, n, k, self.sub)
        if self.fmt in (FMT_Q6K, FMT_Q80):
            return unpack_q8(self._expanded(), n, k, self.sub)
        if self.fmt == FMT_Q5K:
            return unpack_q5(self._expanded(), n, k)
        return unpack_q4(self._expanded(), n, k)

    def _expanded(self) -> torch.Tensor:
        """A native weight as the C kernels expand it (qgemm.c's float32-scale blocks)."""
        n, k = self.out_features, self.in_features
        assert self.packed.numel() == native_nbytes(self.fmt, n, k)
        per_group = {FMT_Q6K: 512 + 2 * 128, FMT_Q80: 512 + 128, FMT_Q5K: 448}.get(self.fmt, 384)
        out = torch.empty(-(-n // 16) * (k // 32) * per_group, dtype=torch.uint8)
        rc = self.lib.expand(self.fmt, self.packed.data_ptr(), n, k, out.data_ptr())
        if rc != 0:
            raise RuntimeError(f"paged_qgemm_expand failed with code {rc} (W {n} x {k})")
        return out


class QuantizedActivations(NamedTuple):
    """x's int8 codes as qgemm.c's kernels multiply them (row-major).

    q int8 [M, K] and xs, xsum float32 [M, K/32] (x ~ xs q per group, xsum = xs sum q);
    the second level (zeros where a group has none): q2, xs2, xsum2, and has2 bool
    [M, K/32], True where the group has a residual.
    """

    q: torch.Tensor
    xs: torch.Tensor
    xsum: torch.Tensor
    q2: torch.Tensor
    xs2: torch.Tensor
    xsum2: torch.Tensor
    has2: torch.Tensor


def quantized_activations(
    lib: QGemmLibrary, x: torch.Tensor, outlier_ratio: float | None = None, *,
    flip: bool = False, scalar: bool = False,
) -> QuantizedActivations:  # fmt: skip
    """The activations' codes for x [M, K] (float32/bfloat16), as matmul makes them.

    flip: the 8-bit VNNI path's unsigned codes (q ^ 0x80). scalar: the scalar
    quantiser (the definition) instead of the library path's own (AVX-512 on the
    VNNI path), so that tests can check that the two agree bit for bit.
    """
    if x.dim() != 2 or x.shape[1] % 32 or x.dtype not in _DTYPES or x.device.type != "cpu":
        raise ValueError(f"x must be a CPU float32/bfloat16 [M, K], K % 32 == 0, got {x.shape}")
    x = x.contiguous()
    m, k = x.shape
    levels, ratio = (1, 0.0) if outlier_ratio is None else (2, float(outlier_ratio))
    q, q2 = torch.zeros(m, k, dtype=torch.int8), torch.zeros(m, k, dtype=torch.int8)
    f = [torch.zeros(m, k // 32) for _ in range(4)]
    has2 = torch.zeros(m, k // 32, dtype=torch.uint8)
    rc = lib.quantize(
        x.data_ptr(), int(x.dtype == torch.bfloat16), m, k, levels, ratio, int(flip),
        int(scalar), q.data_ptr(), f[0].data_ptr(), f[1].data_ptr(), q2.data_ptr(),
        f[2].data_ptr(), f[3].data_ptr(), has2.data_ptr(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"paged_qgemm_quantize failed with code {rc} (x {tuple(x.shape)})")
    return QuantizedActivations(q, f[0], f[1], q2, f[2], f[3], has2.bool())
