"""GGUF tensors kept in their quantised blocks until a layer decides what to make of them.

    GGUFQuantizedTensor   raw blocks of one [rows, cols] tensor, rows independent
      .narrow(0, ...)     a row range (tensor-parallel column shards, packed q/k/v parts)
      .narrow(1, ...)     a column range, whole blocks only
      .permute_rows(idx)  llama.cpp's Q/K row permutation undone on the blocks
      .int4_groups()      Q4_0 / Q4_1 / Q4_K: (codes 0..15 [R, C], scale, offset [R, C/32])
                          with w = codes * scale + offset, exactly the file's values;
                          Q5_K: the same form with codes 0..31 (QGemm packs it as FMT_Q5K)
      .int8_groups()      Q8_0: (codes -127..127 [R, C], scale [R, C/32]), w = codes * scale
                          Q5_0: (codes -16..15 [R, C], scale [R, C/32]), the same form
                          Q6_K: (codes -32..31 [R, C], scale [R, C/16]) per 16-weight sub-block
      .dequantize()       any type: float32 [R, C] (the gguf package's reference decoding)

Block layouts (ggml-common.h), 32 weights per Q4 block, 256 per K-quant super-block:
    Q4_0  d:f16, qs[16]           w = d * (q - 8)
    Q4_1  d:f16, m:f16, qs[16]    w = d * q + m
    Q8_0  d:f16, qs:int8[32]        w = d * q
    Q5_0  d:f16, qh:u32, qs[16]   w = d * (q - 16), q = 4 low bits (as Q4_0) | bit j of qh << 4
    Q5_1  d:f16, m:f16, qh:u32, qs[16]   w = d * q + m (5-bit codes: no exact kernel form)
    Q4_K  d:f16, dmin:f16, scales[12] (8 x 6-bit scale, 8 x 6-bit min), qs[128]
          sub-block j of 32:      w = d * sc_j * q - dmin * m_j
    Q5_K  d:f16, dmin:f16, scales[12] (as Q4_K), qh[32], qs[128]
          sub-block j of 32:      w = d * sc_j * q - dmin * m_j, q = Q4_K's 4 bits
                                  | bit j of qh[l] << 4 (l: the weight's index in j)
    Q6_K  ql[128], qh[64], scales:int8[16], d:f16
          sub-block j of 16:      w = (d * sc_j) * (q - 32), q = 4 low bits | 2 high bits << 4
In Q4_0/Q4_1 byte i holds weight i (low nibble) and weight i + 16 (high nibble);
in Q4_K each 32-byte chunk holds sub-block 2c (low nibbles) and 2c + 1 (high).
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch

INT4_GROUP = 32  # every int4 format above has one scale and one offset per 32 weights
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_K")  # Q5_K: 5-bit codes, the same form


@dataclass(frozen=True)
class Int8Groups:
    """w[r, c] = codes[r, c] * scale[r, c // g] (float32 maths), g = C / scale.shape[1]."""

    codes: torch.Tensor  # int8 [R, C]
    scale: torch.Tensor  # float32 [R, C/32] (Q8_0) or [R, C/16] (Q6_K)


@dataclass(frozen=True)
class Int4Groups:
    """w[r, c] = codes[r, c] * scale[r, c // 32] + offset[r, c // 32] (float32 maths)."""

    codes: torch.Tensor  # uint8 [R, C], values 0..15 (Q5_K: 0..31)
    scale: torch.Tensor  # float32 [R, C/32]
    offset: torch.Tensor  # float32 [R, C/32]


class GGUFQuantizedTensor:
    """One quantised GGUF tensor in Hugging Face layout ([out, in]), still as blocks."""

    def __init__(
        self, data: np.ndarray, qtype: gguf.GGMLQuantizationType, cols: int, *,
        rows: int | None = None, name: str = "",
    ) -> None:  # fmt: skip
        """data: the blocks, row after row; rows: how many the tensor's shape says (checked:
        a truncated file's tensor comes out short); name: the file's, for error messages."""
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        if cols % block != 0:
            raise ValueError(f"{qtype.name} tensor with {cols} columns is not whole blocks")
        flat = np.asarray(data, dtype=np.uint8)
        row_bytes = cols // block * type_size
        if rows is not None and flat.size != rows * row_bytes:
            raise ValueError(
                f"GGUF tensor {name!r}: {rows} rows of {cols} {qtype.name} weights take "
                f"{rows * row_bytes} bytes, the file holds {flat.size}: it is truncated or corrupt"
            )
        self.data = flat.reshape(-1, row_bytes)
        self.qtype = qtype
        self.cols = cols
        self.block = block
        self.type_size = type_size
        self.name = name

    @property
    def type_name(self) -> str:
        return self.qtype.name

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.data.shape[0]), self.cols)

    def narrow(self, dim: int, start: int, length: int) -> GGUFQuantizedTensor:
        """Rows (dim 0) or whole blocks of columns (dim 1) [start, start + length)."""
        if dim == 0:
            return self._like(self.data[start : start + length], self.cols)
        if dim != 1:
            raise ValueError(f"dim: a 2-D tensor has dims 0 and 1, got {dim}")
        if start == 0 and length == self.cols:
            return self
        if start % self.block or length % self.block:
            raise ValueError(
                f"{self.type_name} columns [{start}, {start + length}) cut through its "
                f"{self.block}-weight blocks; this tensor-parallel split needs dequantised weights"
            )
        b0, b1 = start // self.block * self.type_size, (start + length) // self.block
        return self._like(self.data[:, b0 : b1 * self.type_size], length)

    def permute_rows(self, index: torch.Tensor) -> GGUFQuantizedTensor:
        """Row i of the result is row index[i] of this tensor."""
        return self._like(self.data[index.numpy()], self.cols)

    def _like(self, data: np.ndarray, cols: int) -> GGUFQuantizedTensor:
        return GGUFQuantizedTensor(data, self.qtype, cols, name=self.name)

    def block_rows(self) -> tuple[str, np.ndarray]:
        """(the tensor's name, its blocks as uint8 [rows, bytes a row]): what
        cpu_kernels/repack.py packs straight into the kernels' tiles."""
        return self.name, self.data

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols], the gguf package's reference decoding of the blocks."""
        array = gguf.quants.dequantize(self.data, self.qtype)
        array = np.ascontiguousarray(array, dtype=np.float32).reshape(self.shape)
        return torch.from_numpy(array)

    def int8_groups(self) -> Int8Groups | None:
        """Codes and scales of Q8_0 / Q5_0 (32-weight blocks) or Q6_K (16-weight sub-blocks).

        None for other types. Q5_0's w = d (q - 16) is an 8-bit code in -16..15 with one
        scale per 32 weights: exactly Q8_0's form, so it shares Q8_0's kernels.
        """
        if self.type_name == "Q5_0":
            codes5, scale5 = _q5_0_groups(self.data.reshape(-1, self.type_size))
            return Int8Groups(
                codes=torch.from_numpy(codes5.reshape(self.shape[0], self.cols)),
                scale=torch.from_numpy(scale5.reshape(self.shape[0], self.cols // INT4_GROUP)),
            )
        if self.type_name == "Q6_K":
            codes6, scale6 = _q6_k_groups(self.data.reshape(-1, self.type_size))
            return Int8Groups(
                codes=torch.from_numpy(codes6.reshape(self.shape[0], self.cols)),
                scale=torch.from_numpy(scale6.reshape(self.shape[0], self.cols // 16)),
            )
        if self.type_name != "Q8_0":
            return None
        rows, groups_per_row = self.shape[0], self.cols // INT4_GROUP
        blocks = self.data.reshape(-1, self.type_size)
        scale = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        codes = blocks[:, 2:].copy().view(np.int8)
        return Int8Groups(
            codes=torch.from_numpy(codes.reshape(rows, self.cols)),
            scale=torch.from_numpy(scale.reshape(rows, groups_per_row)),
        )

    def int4_groups(self) -> Int4Groups | None:
        """Codes/scale/offset for the 4-bit formats (and Q5_K, codes 0..31) with 32-weight
        groups; None for others."""
        name = self.type_name
        if name not in INT4_TYPES:
            return None
        rows = self.shape[0]
        blocks = self.data.reshape(-1, self.type_size)
        if name == "Q4_K":
            codes, scale, offset = _q4_k_groups(blocks)
        elif name == "Q5_K":
            codes, scale, offset = _q5_k_groups(blocks)
        else:
            d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
            if name == "Q4_0":
                qs, offset = blocks[:, 2:], -8.0 * d
            else:
                qs = blocks[:, 4:]
                offset = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
            codes = np.concatenate([qs & 0x0F, qs >> 4], axis=1)  # [n, 32] in weight order
            scale = d
        groups_per_row = self.cols // INT4_GROUP
        return Int4Groups(
            codes=torch.from_numpy(np.ascontiguousarray(codes).reshape(rows, self.cols)),
            scale=torch.from_numpy(np.ascontiguousarray(scale).reshape(rows, groups_per_row)),
            offset=torch.from_numpy(np.ascontiguousarray(offset).reshape(rows, groups_per_row)),
        )


def _q4_k_groups(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks [n, 144] -> codes [n, 256], scale and offset [n, 8] (per sub-block)."""
    n = blocks.shape[0]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mins = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
    qs = blocks[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    codes = (qs & 0x0F).reshape(n, 256)
    return codes, d * sc.astype(np.float32), -(dmin * mins.astype(np.float32))


def _q5_k_groups(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q5_K super-blocks [n, 176] -> codes [n, 256] in 0..31, scale and offset [n, 8]."""
    n = blocks.shape[0]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mins = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
    qh, qs = blocks[:, 16:48], blocks[:, 48:]
    low = qs.reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    high = (qh.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    codes = (low.reshape(n, 8, 32) & 0x0F) | (high << 4)
    return codes.reshape(n, 256), d * sc.astype(np.float32), -(dmin * mins.astype(np.float32))


CheckpointTensor = torch.Tensor | GGUFQuantizedTensor


def _q6_k_groups(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K super-blocks [n, 210] -> codes int8 [n, 256] in -32..31, scale [n, 16] float32."""
    n = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    sc = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
    low = (ql.reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (
        qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    ) & 3
    q = low.reshape(n, 2, 4, 32) | (high.reshape(n, 2, 4, 32) << 4)
    codes = (q.reshape(n, 256).astype(np.int16) - 32).astype(np.int8)
    return np.ascontiguousarray(codes), np.ascontiguousarray(d * sc)


def _q5_0_groups(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q5_0 blocks [n, 22] -> codes int8 [n, 32] in -16..15, scale [n, 1] float32."""
    n = blocks.shape[0]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    qh = blocks[:, 2:6].copy().view("<u4").reshape(n, 1)
    high = ((qh >> np.arange(32, dtype=np.uint32).reshape(1, 32)) & 1).astype(np.uint8)
    qs = blocks[:, 6:22]
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=1)  # weight j and j + 16, as Q4_0
    codes = ((low | (high << 4)).astype(np.int16) - 16).astype(np.int8)
    return np.ascontiguousarray(codes), np.ascontiguousarray(d)
