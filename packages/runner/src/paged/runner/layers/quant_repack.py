"""QuantStaging's fast path: a layer's GGUF rows repacked straight into qgemm's tiles.

    PendingWrite     one load_weight copy, kept as given until the layer is finalised
    BlockRows        a quantised checkpoint tensor that hands over its blocks' bytes
                     (the GGUF loader's GGUFQuantizedTensor)
    repack_runs      the writes -> one packed QGemm per run of rows, or None

QuantStaging used to decode every quantised write at once into codes and float32
scales (staging buffers as large as the weight in bytes, plus its scales in
float32) and, when finalised, to pack those in torch on one thread. It now keeps
the writes; `repack_runs` builds the kernels the old path would build, from the
file's bytes (cpu_kernels/repack.py), whenever the outcome is known to be the
same: every row written once by a tensor of a type qgemm keeps natively (Q4_0,
Q4_1, Q4_K, Q5_K as 4-bit rows; Q8_0, Q5_0, Q6_K as 8-bit rows), each run of
4-bit or 8-bit rows (the old path's runs: Q4_K_M's q and k, then v) of one type.
Anything else returns None, and the staging replays the writes through the old
path in their order (the same state as before, then the same kernels).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from paged.runner.cpu_kernels import QGemm, QGemmLibrary
from paged.runner.cpu_kernels.repack import GGUF_TYPES, repack_gguf

EIGHT_BIT_TYPES = frozenset({"Q8_0", "Q5_0", "Q6_K"})  # the old path's int8 rows
_PER_32 = frozenset({"Q8_0", "Q5_0"})  # 8-bit with one scale per 32 (Q6_K: per 16)


@runtime_checkable
class BlockRows(Protocol):
    """A quantised [rows, cols] checkpoint tensor whose blocks' bytes can be read."""

    @property
    def type_name(self) -> str: ...

    def block_rows(self) -> tuple[str, np.ndarray]:
        """(the tensor's name, uint8 [rows, bytes a row]): the checkpoint's blocks."""


@dataclass(frozen=True, slots=True)
class PendingWrite:
    """`src` copied into rows [start, start + length) (a tensor or a quantised source)."""

    start: int
    length: int
    src: object


@dataclass(frozen=True, slots=True)
class TileRun:
    """Rows [start, end) as one packed weight; eight_bit: the old path's 8-bit rows."""

    start: int
    end: int
    eight_bit: bool
    gemm: QGemm


def repack_runs(
    writes: Sequence[PendingWrite], rows: int, cols: int, lib: QGemmLibrary
) -> list[TileRun] | None:
    """The runs of a staged weight [rows, cols], packed from the writes' bytes, or None
    where the old path must build the kernels (module docstring)."""
    ordered = sorted(writes, key=lambda w: w.start)
    if cols % 32 or not _covers_once(ordered, rows):
        return None
    types: list[str] = []
    for write in ordered:
        if not isinstance(write.src, BlockRows) or write.src.type_name not in GGUF_TYPES:
            return None
        types.append(write.src.type_name)
    if "Q6_K" in types and _PER_32.intersection(types):
        return None  # the old path re-quantises rows whose 8-bit groups differ
    runs: list[TileRun] = []
    first = 0
    for i in range(1, len(ordered) + 1):
        eight_bit = types[first] in EIGHT_BIT_TYPES
        if i < len(ordered) and (types[i] in EIGHT_BIT_TYPES) == eight_bit:
            continue
        if len(set(types[first:i])) != 1:
            return None  # one run, two formats: the old packers pick the layout
        parts = [w.src.block_rows() for w in ordered[first:i] if isinstance(w.src, BlockRows)]
        gemm = repack_gguf(lib, types[first], parts, cols)
        if gemm is None:
            return None
        start, end = ordered[first].start, ordered[i - 1].start + ordered[i - 1].length
        runs.append(TileRun(start, end, eight_bit, gemm))
        first = i
    return runs


def _covers_once(ordered: Sequence[PendingWrite], rows: int) -> bool:
    """Whether the writes (sorted by start) set every row exactly once."""
    at = 0
    for write in ordered:
        if write.start != at or write.length <= 0:
            return False
        at += write.length
    return at == rows
