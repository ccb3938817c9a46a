"""Weight-only quantised matmuls for CPU: the checkpoint's quantised weights kept quantised.

    load time   layer.quant_staging (QuantStaging, layers/quant_staging.py)  <- load_weight
                copies row ranges into it, from quantised blocks or plain tensors
    finalize    staging -> one kernel (GGUF rows of the C kernel's own formats are packed
                straight from the file's bytes, layers/quant_repack.py, into the same one):
                  every row 4-bit with 32-weight groups (GGUF Q4_0/Q4_1/Q4_K; Q5_K's
                  5-bit codes too when the C kernel loaded: its FMT_Q5K, 5.5 bits a weight)
                      -> QGemmMatmul       paged's C kernel (cpu_kernels/qgemm.c) when it
                         compiled: codes, scales and offsets exact (float32), activations
                         quantised to int8 per 32 inside the kernel (an embedding or
                         tied head: QGemmInt4Table, the same plus exact row lookups); otherwise
                      -> Int4GroupMatmul   torch.ops.aten._weight_int4pack_mm_for_cpu, exact
                         codes; scale and zero rounded to the activation dtype (bf16)
                  every row symmetric 8-bit with 32- or 16-weight groups (Q8_0, Q5_0, Q6_K)
                      -> QGemmTable        the C kernel's 8-bit path, exact; otherwise
                      -> Int8GroupMatmul   (32-weight groups) the int4 kernel twice (high
                         and low nibbles), exact codes, float32 sum
                  other quantised rows (Q5_1, Q2_K, Q3_K, IQ*, ...; Q5_K without the C
                         kernel): no exact form on either kernel, so they are re-quantised
                         to symmetric int8 with one
                         scale per 32 weights (`requantize_int8_groups`) and take the 8-bit
                         kernels above; the error against the checkpoint is measured, logged
                  a mix of formats the row split below cannot take
                      -> Int8ChannelMatmul torch._weight_int8pack_mm, re-quantised to int8
                         with one scale per output channel; the error is measured and logged
                  only plain float rows (F32/F16/BF16 tensors)
                      -> DenseMatmul       F.linear in the activation dtype

The int4 kernel computes w = (q - 8) * scale + zero per group of 32 along the
input dimension, so a group stored as w = codes * s + o maps with scale = s and
zero = o + 8 s. Both kernels want bfloat16 (or float16) activations: measured
on this CPU (AMD EPYC, AVX-512 BF16, one thread) they read 3.5x / 1.9x less
time than the float32 GEMMs of SmolLM2-135M at one row, but with float32
activations they were 4-18x slower than float32 GEMMs, so the quantised path
runs the model in bfloat16 (norms, softmax and logits still accumulate in float32).

Nothing here imports a checkpoint reader: quantised checkpoint tensors reach
the staging through the `QuantizedCheckpointTensor` Protocol (the GGUF loader's
`GGUFQuantizedTensor` satisfies it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from paged.runner.cpu_kernels import QGemm, QGemmLibrary, load_qgemm
from paged.runner.cpu_kernels.packing_native import FMT_Q5K
from paged.runner.cpu_kernels.repack import lookup_rows

logger = logging.getLogger(__name__)

GROUP = 32
# From this many rows on (prefill chunks, decode batches of 16+ streams) a layer
# uses its bfloat16 copy of the weight. The int4 kernel's time grows linearly
# with the rows (a GEMV per row), a bf16 GEMM's much less. Measured on this CPU
# (one thread, SmolLM2's four projections, CPU ms per layer): idle, bf16 was
# 1.0x / 1.6x / 2x faster at 8 / 16 / 32 rows; with other processes loading the
# machine (load average ~12, memory bandwidth shared) the int4 kernel reads 4x
# fewer bytes and was 2.5x / 1.3x faster at 8 / 16 rows, even at 24, and bf16
# 1.1-1.3x faster at 32. 16 takes the idle gain where the loaded loss is smaller.
# 16 was measured best for speed but is not the default: a prompt's prefill then
# runs through bf16 GEMMs, whose per-layer bf16 rounding differs from the int4
# kernel's, and it flipped a near-tie (logprob margin 0.008) in the README
# quickstart's first answer token ("The capital of France is Paris." became
# "L'Étoile, ..."); float32 and the 64-row switch both answer Paris.
# The copy costs 2 bytes a weight (SmolLM2-135M: +257 MiB; the int4 weights
# take 64 MiB, float32 ones 513 MiB). None: no copy, int4 for every batch.
# Only the torch fallback (Int4GroupMatmul) uses it: paged's C kernel was
# measured faster than the bf16 GEMM at every row count from 1 to 64 and
# level with it at 128 (benchmarks/quant_kernel_bench.py, runner README).
LARGE_BATCH_ROWS: int | None = 64
# The C kernel quantises activations to int8 per group of 32, and adds a second
# int8 level (the residual) to each group whose largest |x| exceeds this many
# times its mean |x|: one outlier channel (SmolLM2's hidden states have several)
# otherwise leaves the group's other 31 values a few steps of an int8 grid.
# Measured on the default model (32 generated tokens): 17 / 5 / 8 / 17% of the
# groups of qkv / o / gate_up / down inputs exceed 8 (46 / 29 / 30 / 76% exceed 4),
# so the second level costs ~10% more arithmetic at 8. With one level the README
# quickstart's first answer token flipped (fp32: "The" ahead of "L" by 0.08 nats;
# one int8 level: "L" by 0.29); ratios 4 and 8 both restore the float32 margin
# (0.08-0.09) on the C kernel alone. With the float32 residual stream and the C
# step ops (cpu_step/) on top, ratio 8 let "L" lead by 0.22 again while ratio 4 gave
# "The" -1.883 / "L" -1.974 (float32: -1.883 / -1.965), at no measured decode cost
# (alternated LLM runs, 1 thread, load ~2: 1 stream 44-69 vs 37-39 tok/s, 16 streams
# 150-181 vs 161-192 tok/s). None: one level everywhere (llama.cpp's Q8 activations).
OUTLIER_RATIO: float | None = 4.0


class Int4GroupsLike(Protocol):
    """w = codes * scale + offset per group of 32 columns."""

    @property
    def codes(self) -> torch.Tensor: ...  # uint8 [R, C], 0..15 (Q5_K: 0..31)

    @property
    def scale(self) -> torch.Tensor: ...  # float32 [R, C/32]

    @property
    def offset(self) -> torch.Tensor: ...  # float32 [R, C/32]


class Int8GroupsLike(Protocol):
    """w = codes * scale per group of 32 columns (Q8_0) or of 16 (Q6_K: scale [R, C/16])."""

    @property
    def codes(self) -> torch.Tensor: ...  # int8 [R, C]

    @property
    def scale(self) -> torch.Tensor: ...  # float32 [R, C/32] or [R, C/16]


class QuantizedCheckpointTensor(Protocol):
    """A quantised [rows, cols] checkpoint tensor whose rows can be decoded independently."""

    @property
    def shape(self) -> tuple[int, int]: ...

    @property
    def type_name(self) -> str:
        """The format's name as the checkpoint spells it ("Q4_1")."""

    def narrow(self, dim: int, start: int, length: int) -> QuantizedCheckpointTensor: ...

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols]."""

    def int4_groups(self) -> Int4GroupsLike | None:
        """Exact 4-bit codes with one scale/offset per 32 columns, or None if not such a format."""

    def int8_groups(self) -> Int8GroupsLike | None:
        """Exact symmetric 8-bit codes with one scale per 32 (or 16) columns, or None."""


@dataclass(frozen=True)
class QuantReport:
    """What one layer's weight became, for the start-up log."""

    source: str  # "Q4_1", "Q8_0", "Q4_K+Q6_K", "F32"
    kernel: str  # "int4 groups of 32", "int8 per channel (re-quantised)", "dense bfloat16"
    rel_error: float  # ||W_kernel - W_checkpoint||_F / ||W_checkpoint||_F
    nbytes: int  # bytes the kernel's weight takes


class QuantizedMatmul(Protocol):
    """y = x W^T for a 2-D activation in the layer's activation dtype."""

    report: QuantReport

    def matmul(self, x: torch.Tensor) -> torch.Tensor: ...

    def dequantized(self) -> torch.Tensor:
        """The weight the kernel applies, float32 [out, in] (tests, error reports)."""


class EmbeddingMatmul(QuantizedMatmul, Protocol):
    """A kernel whose rows can also be looked up (embedding tables, tied LM heads)."""

    def embedding(self, ids: torch.Tensor) -> torch.Tensor: ...

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, in] -> x W^T [N, out] float32."""


def qgemm_available(dtype: torch.dtype) -> QGemmLibrary | None:
    """paged's C kernel library if it loaded and takes `dtype` activations, else None."""
    if dtype not in (torch.bfloat16, torch.float32):
        return None
    return load_qgemm()


class QGemmMatmul:
    """A 4-bit or 8-bit group weight run by paged's C kernel (cpu_kernels/qgemm.c).

    The weight is exact (codes and float32 scales as the checkpoint gives them; GGUF's
    Q4_K / Q6_K / Q4_0 / Q4_1 / Q8_0 packed at the file's byte count, qgemm_native.c);
    the kernel quantises each activation row to int8 per 32 inputs (two levels
    for outlier groups: OUTLIER_RATIO), sums the groups' integer dot products
    in float32 and writes the activation dtype.
    One kernel for every batch size: no bf16 copy of the weight.
    """

    def __init__(self, gemm: QGemm, exact: torch.Tensor | None, source: str, kind: str) -> None:
        """exact: the checkpoint's float32 weight, for the logged error; None when `gemm`
        was packed from the checkpoint's own blocks (layers/quant_repack.py): exact by
        construction, error 0, and no float32 copy of the weight to compare."""
        self.gemm = gemm
        self.outlier_ratio = OUTLIER_RATIO
        levels = (
            "one level"
            if OUTLIER_RATIO is None
            else f"2 levels where amax > {OUTLIER_RATIO:g} mean"
        )
        self.out_features, self.in_features = gemm.out_features, gemm.in_features
        self.report = QuantReport(
            source, f"qgemm {kind} ({gemm.lib.isa}; int8 activations per 32, {levels})",
            0.0 if exact is None else _rel_error(gemm.dequantized(), exact), gemm.nbytes,
        )  # fmt: skip

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm.matmul(x, outlier_ratio=self.outlier_ratio)

    def dequantized(self) -> torch.Tensor:
        return self.gemm.dequantized()


class QGemmTable(QGemmMatmul):
    """An 8-bit group table (Q8_0 embedding / tied LM head) on the C kernel.

    Built from codes and scales (`QGemmTable(lib, codes, scale, ...)`), the codes are
    kept as well, [R, C] int8, for exact row lookups; packed from the file's blocks
    (`QGemmTable.packed`), the rows are read out of the packed weight (the same
    float32 values, cpu_kernels/repack.lookup_rows). Logits come out of the kernel in
    float32 (never rounded to bf16).
    """

    def __init__(
        self, lib: object, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
        source: str,
    ) -> None:  # fmt: skip
        self.codes: torch.Tensor | None = codes  # int8 [R, C]
        self.scale: torch.Tensor | None = scale  # float32 [R, C/group]
        self.group = codes.shape[1] // scale.shape[1]
        self.dtype = dtype
        gemm = QGemm.int8(lib, codes, scale)  # type: ignore[arg-type]
        super().__init__(gemm, _int8_exact(codes, scale), source, f"int8 groups of {self.group}")

    @classmethod
    def packed(cls, gemm: QGemm, dtype: torch.dtype, source: str) -> QGemmTable:
        """A table around a weight packed from the checkpoint's blocks (exact, no codes)."""
        table = cls.__new__(cls)
        table.codes = table.scale = None
        table.group, table.dtype = GROUP // gemm.sub, dtype
        QGemmMatmul.__init__(table, gemm, None, source, f"int8 groups of {table.group}")
        return table

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T in float32."""
        return self.gemm.matmul(x, torch.float32, outlier_ratio=self.outlier_ratio)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids`, exactly as the checkpoint stores them, in the activation dtype."""
        if self.codes is None or self.scale is None:
            return lookup_rows(self.gemm, ids).to(self.dtype)
        rows = self.codes[ids].float() * self.scale[ids].repeat_interleave(self.group, -1)
        return rows.to(self.dtype)


class QGemmInt4Table(QGemmMatmul):
    """A 4-bit group table (Q4_0 / Q4_1 / Q4_K embedding or tied LM head) on the C kernel.

    The logits run on the 4-bit kernel (on the CPU pool's threads, 6 bits a weight
    streamed); the codes, scales and offsets are kept as well, so that an embedding
    looks its rows up exactly. Before, such a table was re-quantised to int8 per
    channel for torch's `_weight_int8pack_mm`, which runs on one thread beside the
    pool: Llama-3.2-1B's tied Q4_0 head (128256 x 2048) was 34% of a 2-thread
    decode step.
    """

    def __init__(
        self, lib: object, groups: Int4GroupsLike, dtype: torch.dtype, source: str
    ) -> None:
        self.groups: Int4GroupsLike | None = groups  # codes uint8 [R, C] 0..15, scales
        self.dtype = dtype
        gemm = QGemm.int4(lib, groups.codes, groups.scale, groups.offset)  # type: ignore[arg-type]
        super().__init__(gemm, _int4_exact(groups), source, "int4 groups of 32")

    @classmethod
    def packed(cls, gemm: QGemm, dtype: torch.dtype, source: str) -> QGemmInt4Table:
        """A table around a weight packed from the checkpoint's blocks (as QGemmTable's)."""
        table = cls.__new__(cls)
        table.groups, table.dtype = None, dtype
        QGemmMatmul.__init__(table, gemm, None, source, "int4 groups of 32")
        return table

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T in float32."""
        return self.gemm.matmul(x, torch.float32, outlier_ratio=self.outlier_ratio)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids`, exactly as the checkpoint stores them, in the activation dtype."""
        if self.groups is None:
            return lookup_rows(self.gemm, ids).to(self.dtype)
        g = self.groups
        rows = g.codes[ids].float() * g.scale[ids].repeat_interleave(GROUP, -1)
        rows += g.offset[ids].repeat_interleave(GROUP, -1)
        return rows.to(self.dtype)


def _int4_exact(groups: Int4GroupsLike) -> torch.Tensor:
    exact = groups.codes.float() * groups.scale.repeat_interleave(GROUP, 1)
    exact += groups.offset.repeat_interleave(GROUP, 1)
    return exact


def _int8_exact(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale.repeat_interleave(codes.shape[1] // scale.shape[1], 1)


def int4_kernel(groups: Int4GroupsLike, dtype: torch.dtype, source: str) -> QuantizedMatmul:
    """The C kernel for a 4-bit group weight when it loaded, else torch's int4 kernel."""
    lib = qgemm_available(dtype)
    five_bit = int(groups.codes.max()) > 15
    if lib is None and not five_bit:
        return Int4GroupMatmul(groups, dtype, source)
    try:
        if lib is None:
            raise ValueError("no C kernel for this dtype")
        gemm = QGemm.int4(lib, groups.codes, groups.scale, groups.offset)
    except ValueError:
        # Q5_K staged for the C kernel but finalised for a dtype it does not take, or
        # sharing a run of rows with 4-bit rows whose scales have no Q5_K form
        exact = _int4_exact(groups)
        kernel = Int8GroupMatmul(*requantize_int8_groups(exact), dtype, source)
        kernel.report = replace(
            kernel.report,
            kernel=f"{kernel.report.kernel}; {source} re-quantised to int8 groups of 32",
            rel_error=_rel_error(kernel.dequantized(), exact) + kernel.report.rel_error,
        )
        return kernel
    kind = "int5 groups of 32 (Q5_K)" if gemm.fmt == FMT_Q5K else "int4 groups of 32"
    return QGemmMatmul(gemm, _int4_exact(groups), source, kind)


def int8_table_kernel(
    codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, source: str
) -> EmbeddingMatmul | None:
    """The C kernel for an 8-bit group weight (32 or 16 per scale), else torch's (32), else None."""
    lib = qgemm_available(dtype)
    if lib is not None:
        return QGemmTable(lib, codes, scale, dtype, source)
    if scale.shape[1] * GROUP == codes.shape[1]:
        return Int8GroupMatmul(codes, scale, dtype, source)
    return None  # 16-weight groups without the C kernel: re-quantised per channel


class Int4GroupMatmul:
    """int4 codes packed for `_weight_int4pack_mm_for_cpu`, one scale/zero per 32 inputs."""

    def __init__(
        self,
        groups: Int4GroupsLike,
        dtype: torch.dtype,
        source: str,
        large_batch_rows: int | None = LARGE_BATCH_ROWS,
    ) -> None:
        codes, scale, offset = groups.codes, groups.scale, groups.offset
        self.out_features, self.in_features = codes.shape
        # The packing wants a multiple of 16 output rows: pad with zero rows, slice them off.
        pad = -self.out_features % 16
        if pad:
            codes = torch.cat([codes, codes.new_zeros(pad, codes.shape[1])])
            scale = torch.cat([scale, scale.new_zeros(pad, scale.shape[1])])
            offset = torch.cat([offset, offset.new_zeros(pad, offset.shape[1])])
        self.padded = pad != 0
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        zero = offset + 8.0 * scale
        # [C/32, R, 2]: the kernel's layout of (scale, zero) pairs.
        self.scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()
        # The error comes only from rounding scale and zero to the activation dtype.
        s_k = self.scales_and_zeros[..., 0].float().t().repeat_interleave(GROUP, 1)
        z_k = self.scales_and_zeros[..., 1].float().t().repeat_interleave(GROUP, 1)
        exact = codes.float() * scale.repeat_interleave(GROUP, 1) + offset.repeat_interleave(
            GROUP, 1
        )
        self.large_batch_rows = large_batch_rows
        self.dense_t: torch.Tensor | None = None
        if large_batch_rows is not None:  # [in, out]: a plain row-major GEMM (linear.py)
            self.dense_t = exact[: self.out_features].to(dtype).t().contiguous()
        nbytes = self.packed.numel() + self.scales_and_zeros.numel() * 2
        kernel = "int4 groups of 32"
        if self.dense_t is not None:
            nbytes += self.dense_t.numel() * 2
            kernel += f" (+bf16 copy for >= {large_batch_rows} rows)"
        self.report = QuantReport(
            source, kernel, _rel_error((codes.float() - 8.0) * s_k + z_k, exact), nbytes
        )

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.large_batch_rows
        if self.dense_t is not None and rows is not None and x.shape[0] >= rows:
            return x @ self.dense_t
        out: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed, GROUP, self.scales_and_zeros
        )
        return out[:, : self.out_features] if self.padded else out

    def dequantized(self) -> torch.Tensor:
        # The kernel applied to the identity gives W^T column by column: exactly its weights.
        eye = torch.eye(self.in_features, dtype=self.scales_and_zeros.dtype)
        return self.matmul(eye).float().t().contiguous()


class Int8GroupMatmul:
    """8-bit codes with one scale per 32 inputs (GGUF Q8_0), exact, as two int4 matmuls.

    q = 16 h + l with h = q >> 4 in -8..7 and l = q & 15 in 0..15, so
    W = W_h + W_l with W_h = (16 d) h and W_l = d l, each an int4-group weight
    (h + 8 as codes with offset -128 d; l as codes with offset 0). Two int4
    passes read the same bytes as one int8 pass, keep Q8_0's per-32 scales
    (per-channel int8 measured 1.2e-2 relative error on SmolLM2's embedding,
    this 2e-3, the bfloat16 rounding of the scales) and sum in float32.
    The codes are kept too: an embedding looks its rows up exactly.
    """

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, source: str):
        self.codes = codes  # int8 [R, C]
        self.scale = scale  # float32 [R, C/32]
        self.dtype = dtype
        high = torch.bitwise_right_shift(codes, 4)  # arithmetic: -8..7
        low = torch.bitwise_and(codes, 15)
        self.high = Int4GroupMatmul(
            _Groups((high + 8).to(torch.uint8), 16.0 * scale, -128.0 * scale), dtype, source, None
        )
        self.low = Int4GroupMatmul(
            _Groups(low.to(torch.uint8), scale, torch.zeros_like(scale)), dtype, source, None
        )
        rounded = self.high.report.rel_error + self.low.report.rel_error  # an upper bound
        self.report = QuantReport(
            source, "int8 groups of 32 (two int4 passes)", rounded,
            self.high.report.nbytes + self.low.report.nbytes,
        )  # fmt: skip

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T in float32 (each pass rounds to the activation dtype, the sum does not)."""
        return self.high.matmul(x).float() + self.low.matmul(x).float()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits(x).to(x.dtype)

    def dequantized(self) -> torch.Tensor:
        return self.codes.float() * self.scale.repeat_interleave(GROUP, 1)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids`, exactly as the checkpoint stores them, in the activation dtype."""
        rows = self.codes[ids].float() * self.scale[ids].repeat_interleave(GROUP, -1)
        return rows.to(self.dtype)


class Int8ChannelMatmul:
    """int8 weights with one scale per output channel for `torch._weight_int8pack_mm`."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, source: str) -> None:
        weight = weight.float()
        amax = weight.abs().amax(dim=1).clamp(min=1e-12)
        scale = amax / 127.0
        self.qweight = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.scales = scale.to(dtype)
        self.report = QuantReport(
            source, "int8 per channel (re-quantised)", _rel_error(self.dequantized(), weight),
            self.qweight.numel() + self.scales.numel() * self.scales.element_size(),
        )  # fmt: skip

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, self.qweight, self.scales)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x).float()

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight in the scales' dtype (a tied embedding's lookup)."""
        return self.qweight[ids].to(self.scales.dtype) * self.scales[ids, None]


class DenseMatmul:
    """A plain weight in the activation dtype, stored [in, out] (see linear._linear_weight)."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, source: str) -> None:
        self.weight_t = weight.to(dtype).t().contiguous()
        self.report = QuantReport(
            source, f"dense {str(dtype).removeprefix('torch.')}",
            _rel_error(self.dequantized(), weight.float()),
            self.weight_t.numel() * self.weight_t.element_size(),
        )  # fmt: skip

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight_t

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x).float()

    def dequantized(self) -> torch.Tensor:
        return self.weight_t.float().t()

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight (a tied embedding's lookup)."""
        return self.weight_t.t()[ids]


class RowSplitMatmul:
    """Output rows in runs, one exact kernel per run (a packed layer mixing formats)."""

    def __init__(self, parts: list[QuantizedMatmul], source: str) -> None:
        self.parts = parts
        kernels = " + ".join(p.report.kernel for p in parts)
        self.report = QuantReport(
            source, f"rows split: {kernels}", max(p.report.rel_error for p in parts),
            sum(p.report.nbytes for p in parts),
        )  # fmt: skip

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.matmul(x) for p in self.parts], dim=1)

    def dequantized(self) -> torch.Tensor:
        return torch.cat([p.dequantized() for p in self.parts])


def _rel_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    norm = float(torch.linalg.vector_norm(exact))
    return float(torch.linalg.vector_norm(approx - exact)) / norm if norm > 0 else 0.0


def requantize_int8_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [R, C] (C % 32 == 0) -> symmetric int8 codes [R, C] and scales [R, C/32].

    scale = max |w| / 127 per 32 weights, codes = round(w / scale): each weight moves by
    at most half a step, 1/254 of its group's largest |w|.
    """
    rows, cols = weight.shape
    if cols % GROUP:
        raise ValueError(f"weight: {cols} columns are not whole groups of {GROUP}")
    groups = weight.float().reshape(rows, cols // GROUP, GROUP)
    scale = groups.abs().amax(dim=-1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(groups / safe[..., None]).clamp(-127, 127).to(torch.int8)
    return codes.reshape(rows, cols), scale


@dataclass(frozen=True)
class _Groups:
    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor


def linear_forward(kernel: QuantizedMatmul, x: torch.Tensor) -> torch.Tensor:
    """kernel.matmul over any leading dims (the kernels take 2-D activations)."""
    if x.dim() == 2:
        return kernel.matmul(x.contiguous())
    y = kernel.matmul(x.reshape(-1, x.shape[-1]).contiguous())
    return y.reshape(*x.shape[:-1], y.shape[-1])
