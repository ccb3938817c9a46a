"""QuantStaging: where a quantised layer's checkpoint rows land while loading.

    QuantStaging           load_weight's destination for `weight` while a quantised load
                           is staged (`narrow(0, ...).copy_(src)`, as into a parameter);
                           `finalize(dtype)` builds the kernel (layers/quantized_linear.py
                           lists which)
    StagingRows            a row range of it

The copies are kept until finalize. GGUF rows of the formats the C kernel keeps
natively are packed there straight from the file's bytes (layers/quant_repack.py,
cpu_kernels/qgemm_repack.c); everything else is decoded into codes and scales, in the
order the copies were made, and picked from as before.
"""

from __future__ import annotations

from dataclasses import replace
from typing import cast

import torch

from paged.runner.cpu_kernels import load_qgemm
from paged.runner.cpu_kernels.packing_native import FMT_Q5K
from paged.runner.layers.quant_repack import PendingWrite, TileRun, repack_runs
from paged.runner.layers.quantized_linear import (
    GROUP,
    DenseMatmul,
    EmbeddingMatmul,
    Int4GroupsLike,
    Int8ChannelMatmul,
    Int8GroupMatmul,
    QGemmInt4Table,
    QGemmMatmul,
    QGemmTable,
    QuantizedCheckpointTensor,
    QuantizedMatmul,
    RowSplitMatmul,
    _Groups,
    _int8_exact,
    _rel_error,
    int4_kernel,
    int8_table_kernel,
    qgemm_available,
    requantize_int8_groups,
)

_UNSET, _INT4, _DENSE, _INT8 = 0, 1, 2, 3


class QuantStaging:
    """Load-time destination of a linear weight [rows, cols] that may arrive quantised.

    `narrow(0, start, n).copy_(src)` takes a row range from a quantised
    checkpoint tensor (int4-group formats keep their codes, others are
    dequantised to float32) or from a plain tensor, the way load_weight copies
    into a parameter; `finalize(dtype)` picks the kernel (quantized_linear's docstring).
    Rows are tracked so that a weight with unfilled rows is never finalised.

    The copies are kept as given (`pending`) until finalize: GGUF rows of the formats
    the C kernel keeps natively are packed straight from the file's bytes there
    (layers/quant_repack.py); otherwise the copies are applied in their order
    (`_apply_pending`) and the kernel is picked from the buffers below.
    """

    def __init__(self, rows: int, cols: int) -> None:
        self.shape = (rows, cols)
        self.pending: list[PendingWrite] = []
        self.row_kind = torch.zeros(rows, dtype=torch.int8)
        self.sources: set[str] = set()
        self.codes: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        self.offset: torch.Tensor | None = None
        self.dense: torch.Tensor | None = None
        self.codes8: torch.Tensor | None = None
        self.scale8: torch.Tensor | None = None
        # _INT8 rows whose codes were re-quantised (no exact form): their checkpoint
        # values are kept in `dense`, the reference of the error report.
        self.requantized = torch.zeros(rows, dtype=torch.bool)
        self.requantized_sources: set[str] = set()

    @property
    def data(self) -> QuantStaging:
        return self  # load_weight writes `param.data.narrow(...)`

    def narrow(self, dim: int, start: int, length: int) -> StagingRows:
        if dim != 0:
            raise ValueError("quantised weights are staged by whole rows (dim 0) only")
        if not 0 <= start <= start + length <= self.shape[0]:
            raise ValueError(f"rows [{start}, {start + length}) outside {self.shape[0]} rows")
        return StagingRows(self, start, length)

    def copy_(self, src: torch.Tensor | QuantizedCheckpointTensor) -> None:
        StagingRows(self, 0, self.shape[0]).copy_(src)

    def _int4_buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.codes is None or self.scale is None or self.offset is None:
            rows, cols = self.shape
            self.codes = torch.zeros(rows, cols, dtype=torch.uint8)
            self.scale = torch.zeros(rows, cols // GROUP)
            self.offset = torch.zeros(rows, cols // GROUP)
        return self.codes, self.scale, self.offset

    def _int8_buffers(self, scales_per_row: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Codes and scales (one per 32 or per 16 columns); None if staged rows use the other."""
        if self.codes8 is None or self.scale8 is None:
            rows, cols = self.shape
            self.codes8 = torch.zeros(rows, cols, dtype=torch.int8)
            self.scale8 = torch.zeros(rows, scales_per_row)
        if self.scale8.shape[1] != scales_per_row:
            return None
        return self.codes8, self.scale8

    def _dense_buffer(self) -> torch.Tensor:
        if self.dense is None:
            self.dense = torch.zeros(self.shape)
        return self.dense

    def finalize(self, dtype: torch.dtype, *, allow_int4: bool = True) -> QuantizedMatmul:
        """The kernel for the staged weight (ValueError if any row was never written).

        allow_int4=False (an embedding table, whose rows are also looked up): int4
        rows take QGemmInt4Table on the C kernel, else are re-quantised to int8 per row.
        """
        fast = self._packed_kernel(dtype, allow_int4)
        if fast is not None:
            self.pending = []
            return fast
        self._apply_pending()
        if bool((self.row_kind == _UNSET).any()):
            raise ValueError("a quantised weight was finalised with rows the checkpoint never set")
        kernel = self._pick_kernel(dtype, allow_int4)
        per_channel = isinstance(kernel, (Int8ChannelMatmul, DenseMatmul))  # own error is right
        if bool(self.requantized.any()) and not per_channel:
            # The kernel's own report compares it with the re-quantised codes; the
            # log must compare it with the checkpoint. dequantized() gives the codes the
            # kernel holds; its own error (torch's bf16 scales) adds at most its report's.
            sources = "+".join(sorted(self.requantized_sources))
            error = _rel_error(kernel.dequantized(), self.dequantized())
            kernel.report = replace(
                kernel.report,
                kernel=f"{kernel.report.kernel}; {sources} re-quantised to int8 groups of 32",
                rel_error=error + kernel.report.rel_error,
            )
        return kernel

    def _packed_kernel(self, dtype: torch.dtype, allow_int4: bool) -> QuantizedMatmul | None:
        """The kernel _pick_kernel would build, packed from the pending copies' GGUF bytes;
        None where that path does not apply (layers/quant_repack.py)."""
        lib = qgemm_available(dtype)
        if lib is None or not self.pending or bool((self.row_kind != _UNSET).any()):
            return None
        runs = repack_runs(self.pending, self.shape[0], self.shape[1], lib)
        if runs is None or (len(runs) > 1 and not allow_int4):
            return None  # a table mixing 4- and 8-bit rows: re-quantised per channel
        source = "+".join(sorted({str(getattr(w.src, "type_name", "")) for w in self.pending}))
        if len(runs) == 1:
            return _packed_table(runs[0], dtype, source, allow_int4)
        return RowSplitMatmul([_packed_table(run, dtype, source, True) for run in runs], source)

    def _apply_pending(self) -> None:
        """The pending copies into the buffers, in the order they were made."""
        pending, self.pending = self.pending, []
        for write in pending:
            src = cast("torch.Tensor | QuantizedCheckpointTensor", write.src)
            StagingRows(self, write.start, write.length).apply(src)

    def _pick_kernel(self, dtype: torch.dtype, allow_int4: bool) -> QuantizedMatmul:
        source = "+".join(sorted(self.sources))
        all_int4 = bool((self.row_kind == _INT4).all())
        if allow_int4 and all_int4 and self.shape[1] % GROUP == 0 and self.codes is not None:
            assert self.scale is not None and self.offset is not None
            groups = _Groups(self.codes, self.scale, self.offset)
            return int4_kernel(groups, dtype, source)
        if all_int4 and self.shape[1] % GROUP == 0 and self.codes is not None:
            lib = qgemm_available(dtype)  # a table: exact on the C kernel, with its lookup
            if lib is not None:
                assert self.scale is not None and self.offset is not None
                try:
                    return QGemmInt4Table(
                        lib, _Groups(self.codes, self.scale, self.offset), dtype, source
                    )
                except ValueError:  # Q5_K rows beside 4-bit rows of no Q5_K form
                    pass
        if bool((self.row_kind == _INT8).all()) and self.codes8 is not None:
            assert self.scale8 is not None
            table = int8_table_kernel(self.codes8, self.scale8, dtype, source)
            if table is not None:
                return table
        split = self._row_split(dtype, source) if allow_int4 else None
        if split is not None:
            return split
        weight = self.dequantized()
        quantised_source = any(not s.startswith(("F", "BF")) for s in self.sources)
        if quantised_source:
            return Int8ChannelMatmul(weight, dtype, source)
        return DenseMatmul(weight, dtype, source)

    def _row_split(self, dtype: torch.dtype, source: str) -> RowSplitMatmul | None:
        """Runs of 4-bit and 8-bit rows (Q4_K_M's qkv: Q4_K q/k, Q6_K v), each exact on the
        C kernel; None when a row is dense or the C kernel did not load."""
        kinds = self.row_kind.tolist()
        if _DENSE in kinds or _UNSET in kinds or qgemm_available(dtype) is None:
            return None
        parts: list[QuantizedMatmul] = []
        start = 0
        for end in range(1, len(kinds) + 1):
            if end < len(kinds) and kinds[end] == kinds[start]:
                continue
            rows = slice(start, end)
            if kinds[start] == _INT4:
                assert self.codes is not None and self.scale is not None
                assert self.offset is not None
                groups = _Groups(self.codes[rows], self.scale[rows], self.offset[rows])
                parts.append(int4_kernel(groups, dtype, source))
            else:
                assert self.codes8 is not None and self.scale8 is not None
                table = int8_table_kernel(self.codes8[rows], self.scale8[rows], dtype, source)
                assert table is not None  # the C kernel loaded
                parts.append(table)
            start = end
        return RowSplitMatmul(parts, source)

    def finalize_embedding(self, dtype: torch.dtype) -> EmbeddingMatmul:
        """finalize() for a table whose rows are looked up too: int8 per row or dense."""
        kernel = self.finalize(dtype, allow_int4=False)
        assert isinstance(
            kernel, (QGemmTable, QGemmInt4Table, Int8GroupMatmul, Int8ChannelMatmul, DenseMatmul)
        )
        return kernel

    def dequantized(self) -> torch.Tensor:
        """float32 [rows, cols] of what the checkpoint stored (the reference for errors)."""
        self._apply_pending()
        out = self.dense.clone() if self.dense is not None else torch.zeros(self.shape)
        if self.codes is not None:
            assert self.scale is not None and self.offset is not None
            rows = self.row_kind == _INT4
            exact = self.codes[rows].float() * self.scale[rows].repeat_interleave(GROUP, 1)
            out[rows] = exact + self.offset[rows].repeat_interleave(GROUP, 1)
        if self.codes8 is not None:
            assert self.scale8 is not None
            rows = (self.row_kind == _INT8) & ~self.requantized
            out[rows] = _int8_exact(self.codes8[rows], self.scale8[rows])
        return out


class StagingRows:
    """Rows [start, start + length) of a QuantStaging (what `narrow(0, ...)` returns)."""

    def __init__(self, staging: QuantStaging, start: int, length: int) -> None:
        self.staging = staging
        self.start = start
        self.length = length

    @property
    def shape(self) -> tuple[int, int]:
        return (self.length, self.staging.shape[1])

    def copy_(self, src: torch.Tensor | QuantizedCheckpointTensor) -> None:
        """Checked now, kept until the staging is finalised (QuantStaging's docstring)."""
        if tuple(src.shape) != self.shape:
            raise ValueError(f"copying a {tuple(src.shape)} tensor into rows of shape {self.shape}")
        self.staging.pending.append(PendingWrite(self.start, self.length, src))

    def apply(self, src: torch.Tensor | QuantizedCheckpointTensor) -> None:
        """Write `src` into the staging's buffers (codes, 8-bit codes or float32 rows)."""
        st, rows = self.staging, slice(self.start, self.start + self.length)
        if isinstance(src, torch.Tensor):
            st._dense_buffer()[rows].copy_(src)
            st.row_kind[rows] = _DENSE
            st.sources.add(str(src.dtype).removeprefix("torch.").upper().replace("FLOAT", "F"))
            return
        st.sources.add(src.type_name)
        groups = src.int4_groups() if st.shape[1] % GROUP == 0 else None
        if groups is not None and not _int4_codes_fit(groups):
            groups = None  # Q5_K without the C kernel's FMT_Q5K: re-quantised below
        groups8 = src.int8_groups() if groups is None and st.shape[1] % GROUP == 0 else None
        # A row range whose 8-bit grouping differs from the rows staged before it is
        # dequantised (the layer then takes the re-quantising kernel).
        buffers8 = st._int8_buffers(groups8.scale.shape[1]) if groups8 is not None else None
        if groups8 is not None and buffers8 is not None:
            codes8, scale8 = buffers8
            codes8[rows].copy_(groups8.codes)
            scale8[rows].copy_(groups8.scale)
            st.row_kind[rows] = _INT8
            return
        if groups is None:
            self._copy_requantized(src)
            return
        codes, scale, offset = st._int4_buffers()
        codes[rows].copy_(groups.codes)
        scale[rows].copy_(groups.scale)
        offset[rows].copy_(groups.offset)
        st.row_kind[rows] = _INT4

    def _copy_requantized(self, src: QuantizedCheckpointTensor) -> None:
        """A format with no exact kernel form: int8 groups of 32 where the rows allow it
        (the checkpoint values stay in `dense` for the error report), else dense rows."""
        st, rows = self.staging, slice(self.start, self.start + self.length)
        weight = src.dequantize()
        st._dense_buffer()[rows].copy_(weight)
        cols = st.shape[1]
        buffers = st._int8_buffers(cols // GROUP) if cols % GROUP == 0 else None
        if buffers is None:  # or 8-bit rows with 16-weight groups were staged before
            st.row_kind[rows] = _DENSE
            return
        codes8, scale8 = buffers
        codes, scale = requantize_int8_groups(weight)
        codes8[rows].copy_(codes)
        scale8[rows].copy_(scale)
        st.row_kind[rows] = _INT8
        st.requantized[rows] = True
        st.requantized_sources.add(src.type_name)


def _int4_codes_fit(groups: Int4GroupsLike) -> bool:
    """Whether a kernel takes these codes exactly: 0..15 always; Q5_K's 0..31 only on the
    C kernel (FMT_Q5K; torch's int4 kernel stops at 15), with K whole super-blocks.
    Q5_K rows from a file always have FMT_Q5K's scale form (d, dmin f16 x 6 bits)."""
    codes = groups.codes
    if codes.numel() == 0 or int(codes.max()) <= 15:
        return True
    return codes.shape[1] % 256 == 0 and load_qgemm() is not None


def _packed_table(
    run: TileRun, dtype: torch.dtype, source: str, allow_int4: bool
) -> QuantizedMatmul:
    """The kernel _pick_kernel gives such rows: 8-bit rows a QGemmTable, 4-bit rows a
    QGemmMatmul (a table's: QGemmInt4Table), here around the packed weight."""
    if run.eight_bit:
        return QGemmTable.packed(run.gemm, dtype, source)
    if not allow_int4:
        return QGemmInt4Table.packed(run.gemm, dtype, source)
    kind = "int5 groups of 32 (Q5_K)" if run.gemm.fmt == FMT_Q5K else "int4 groups of 32"
    return QGemmMatmul(run.gemm, None, source, kind)
