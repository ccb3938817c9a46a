"""Checkpoint codes and scales -> GGUF's own byte counts in qgemm's tiles (qgemm_native.c).

The loader hands every 4-bit format over as float32 (scale, offset) per 32 inputs
and Q6_K as float32 scales per 16 (loader/gguf_quant.py): exact products of the
file's f16 super-block scale and its small integer sub-scales. `factor_scales`
finds such a factoring again (any one whose products are the same float32 values
is as good: the kernels multiply them back exactly), so that the packed weight
takes the file's bytes: Q4_K 4.5 bits a weight (qgemm.c's 4-bit blocks: 6),
Q5_K 5.5 (Q4_K's bytes and a plane of fifth bits; there is no float32-scale
5-bit layout to keep, the kernels expand it per tile),
Q6_K 6.5625 (qgemm.c's 8-bit blocks with two scales per 32: 12), Q4_0 4.5 (6),
Q4_1 5 (6), Q8_0 8.5 (10; Q5_0's codes take this form too: 8.5 for its 5.5).
A weight whose scales have no such form returns None (the caller keeps
qgemm.c's float32-scale blocks).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from paged.runner.cpu_kernels.packing import GROUP, TILE, _chunked, _tiles

FMT_Q4K, FMT_Q6K, FMT_Q40, FMT_Q80, FMT_Q41, FMT_Q5K = 5, 6, 7, 9, 10, 11
SB_INPUTS = 256  # inputs per K-quant super-block
SB_GROUPS = SB_INPUTS // GROUP
Q4K_SB = SB_GROUPS * 256 + 256  # bytes per tile and super-block
Q5K_GROUP = 256 + 64  # a group's 4-bit code block and its plane of fifth bits
Q5K_SB = SB_GROUPS * Q5K_GROUP + 256
Q5_BLOCK = 256 + 64 + 64 + 64  # qgemm.c's 5-bit block (what FMT_Q5K expands into)
Q6K_SB = SB_GROUPS * (256 + 128) + 256 + 32
Q40_BLOCK = 256 + 32
Q41_BLOCK = 256 + 64
Q80_BLOCK = 512 + 32

# Sub-scale candidates in the order llama.cpp's quantisers make them likely:
# Q4_K's largest 6-bit scale / min is 63; Q6_K's largest |scale| is stored as -128.
_U6 = tuple(range(63, 0, -1))
_I8 = (-128, *(s for k in range(127, 0, -1) for s in (k, -k)))


def factor_scales(
    values: torch.Tensor, candidates: Sequence[int], low: int, high: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """values float32 [B, J] -> (d float16 [B], q int16 [B, J]) with float32(d) * q == values
    exactly and low <= q <= high, or None when some row has no such factoring.

    The row's largest |value| is d times one of `candidates` (tried in order, each only
    on the rows not yet factored); an all-zero row is d = 0, q = 0.
    """
    values = values.float()
    ref = values.gather(1, values.abs().argmax(1, keepdim=True)).squeeze(1)
    d = torch.zeros(values.shape[0])
    q = torch.zeros(values.shape, dtype=torch.int16)
    todo = (ref != 0).nonzero().squeeze(1)
    everything = todo.numel() == values.shape[0]
    for k in candidates:
        if todo.numel() == 0:
            break
        # the first candidate usually factors every row: no gathering then
        v, dk = (values, ref / k) if everything else (values[todo], ref[todo] / k)
        everything = False
        qk = torch.round(v / dk[:, None])
        ok = (dk.half().float() == dk) & ((qk >= low) & (qk <= high)).all(1)
        ok &= (qk * dk[:, None] == v).all(1)
        d[todo[ok]] = dk[ok]
        q[todo[ok]] = qk[ok].to(torch.int16)
        todo = todo[~ok]
    if todo.numel():
        return None
    return d.half(), q


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] (values < 16 used) -> [T, G, 256], qgemm.c's 4-bit code blocks."""
    c = _chunked(_tiles(codes.to(torch.uint8)) & 15)
    return (c[:, :, :4] | (c[:, :, 4:] << 4)).reshape(c.shape[0], c.shape[1], 256)


def _rows_last(values: torch.Tensor, per_sb: int) -> torch.Tensor:
    """[N, S * per_sb] -> [T, S, per_sb, 16] (tile, super-block, entry, row in tile)."""
    t = _tiles(values)
    return t.reshape(t.shape[0] // TILE, TILE, -1, per_sb).permute(0, 2, 3, 1).contiguous()


def _f16_rows(d: torch.Tensor) -> torch.Tensor:
    """f16 [N, S] -> [T, S, 32] bytes: 16 rows' values of each super-block."""
    return _rows_last(d.contiguous().view(torch.int16), 1).contiguous().view(torch.uint8)[..., 0, :]


def _six_bit_planes(v: torch.Tensor) -> torch.Tensor:
    """[T, S, 8, 16] values 0..63 -> [T, S, 96]: 64 B low nibbles, 32 B high bits."""
    v = v.to(torch.uint8)
    low = (v[:, :, :4] & 15) | ((v[:, :, 4:] & 15) << 4)  # [T, S, 4, 16]
    high = (v >> 4).reshape(*v.shape[:2], 2, 4, TILE)
    shift = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 1, 4, 1)
    planes = (high << shift).sum(3, dtype=torch.uint8)  # [T, S, 2, 16]: disjoint bits
    return torch.cat([low.flatten(2), planes.flatten(2)], dim=2)


def _k_header(scale: torch.Tensor, offset: torch.Tensor, n: int, k: int) -> torch.Tensor | None:
    """Q4_K / Q5_K's scales (scale = d sc, offset = dm m per 256 inputs, sc and m 6-bit)
    -> [T, S, 256] header bytes (see qgemm_native.c), or None when they have no such form."""
    sb = k // SB_INPUTS
    d = factor_scales(scale.reshape(n * sb, SB_GROUPS), _U6, 0, 63)
    dm = factor_scales(offset.reshape(n * sb, SB_GROUPS), _U6, 0, 63)
    if d is None or dm is None:
        return None
    sc = _rows_last(d[1].reshape(n, k // GROUP), SB_GROUPS)
    mins = _rows_last(dm[1].reshape(n, k // GROUP), SB_GROUPS)
    dh, dmh = _f16_rows(d[0].reshape(n, sb)), _f16_rows(dm[0].reshape(n, sb))
    sc_planes, m_planes = _six_bit_planes(sc), _six_bit_planes(mins)
    header = [dh, dmh, sc_planes[..., :64], m_planes[..., :64], sc_planes[..., 64:]]
    return torch.cat([*header, m_planes[..., 64:]], dim=2)


def pack_q4k(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor | None:
    """w = codes * scale + offset per 32 (Q4_K's form: scale = d sc, offset = dm m per 256
    inputs, sc and m 6-bit) -> FMT_Q4K bytes, or None when the values have no such form."""
    n, k = codes.shape
    if k % SB_INPUTS:
        return None
    header = _k_header(scale, offset, n, k)
    if header is None:
        return None
    nib = _nibbles(codes).reshape(header.shape[0], header.shape[1], SB_GROUPS * 256)
    return torch.cat([nib, header], dim=2).reshape(-1).contiguous()


def _fifth_bits(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] (values < 32) -> [T, G, 64]: bit c of byte (l * 4 + b) is bit 4 of
    the code of row l, input 4c + b (chunk c of qgemm.c's code blocks)."""
    c = (_chunked(_tiles(codes.to(torch.uint8))) >> 4) & 1  # [T, G, 8, 16, 4]
    shift = torch.arange(8, dtype=torch.uint8).reshape(1, 1, 8, 1, 1)
    planes = (c << shift).sum(2, dtype=torch.uint8)  # disjoint bits
    return planes.reshape(c.shape[0], c.shape[1], 64)


def pack_q5k(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor | None:
    """w = codes * scale + offset per 32 with codes 0..31 (Q5_K's form: Q4_K's scales)
    -> FMT_Q5K bytes at the file's 5.5 bits a weight, or None when the values have no
    such form (K not whole super-blocks, codes past 31, scales not d times 6 bits)."""
    n, k = codes.shape
    if k % SB_INPUTS or int(codes.max()) > 31:
        return None
    header = _k_header(scale, offset, n, k)
    if header is None:
        return None
    per_group = torch.cat([_nibbles(codes), _fifth_bits(codes)], dim=2)  # [T, G, 320]
    body = per_group.reshape(header.shape[0], header.shape[1], SB_GROUPS * Q5K_GROUP)
    return torch.cat([body, header], dim=2).reshape(-1).contiguous()


def unpack_q5(blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The float32 [N, K] weight of qgemm.c's 5-bit blocks (FMT_Q5K expanded)."""
    groups, tiles = k // GROUP, -(-n // TILE)
    b = blocks.reshape(tiles, groups, Q5_BLOCK)
    nib = b[..., :256].reshape(tiles, groups, 4, TILE, 4)
    low = torch.cat([nib & 15, nib >> 4], dim=2)  # [T, G, 8, 16, 4]
    shift = torch.arange(8, dtype=torch.uint8).reshape(1, 1, 8, 1, 1)
    plane = b[..., 384:].reshape(tiles, groups, 1, TILE, 4)
    c = low | (((plane >> shift) & 1) << 4)
    codes = c.permute(0, 3, 1, 2, 4).reshape(tiles * TILE, k).float()
    d = b[..., 256:320].contiguous().view(torch.float32).permute(0, 2, 1)
    m = b[..., 320:384].contiguous().view(torch.float32).permute(0, 2, 1)
    d_rows = d.reshape(tiles * TILE, groups).repeat_interleave(GROUP, 1)
    m_rows = m.reshape(tiles * TILE, groups).repeat_interleave(GROUP, 1)
    return (codes * d_rows + m_rows)[:n]


def pack_q40(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor | None:
    """w = codes * scale + offset per 32 with scale an f16 value and offset = -8 scale
    (Q4_0) -> FMT_Q40 bytes, or None."""
    scale = scale.float()
    d = scale.half()
    if not (torch.equal(d.float(), scale) and torch.equal(scale * -8.0, offset.float())):
        return None
    return torch.cat([_nibbles(codes), _f16_per_group(d)], dim=2).reshape(-1).contiguous()


def _f16_exact(t: torch.Tensor) -> torch.Tensor | None:
    """t's values as float16 when every one is exactly an f16, else None."""
    half = t.half()
    return half if torch.equal(half.float(), t.float()) else None


def _f16_per_group(d: torch.Tensor) -> torch.Tensor:
    """f16 [N, G] -> [T, G, 32] bytes: 16 rows' values of each group."""
    return _rows_last(d.contiguous().view(torch.int16), 1).contiguous().view(torch.uint8)[..., 0, :]


def pack_q41(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor | None:
    """w = codes * scale + offset per 32 with f16 scale and offset (Q4_1) -> FMT_Q41 bytes,
    or None."""
    d, m = _f16_exact(scale), _f16_exact(offset)
    if d is None or m is None:
        return None
    parts = [_nibbles(codes), _f16_per_group(d), _f16_per_group(m)]
    return torch.cat(parts, dim=2).reshape(-1).contiguous()


def pack_q80(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """w = codes * scale per 32 inputs with an f16 scale (Q8_0, Q5_0) -> FMT_Q80 bytes
    (codes stored q ^ 0x80), or None."""
    n, k = codes.shape
    d = _f16_exact(scale) if scale.shape == (n, k // GROUP) else None
    if d is None:
        return None
    flipped = (_tiles(codes.to(torch.int8)).view(torch.uint8) ^ 0x80).contiguous()
    c = _chunked(flipped).reshape(-1, k // GROUP, 512)
    return torch.cat([c, _f16_per_group(d)], dim=2).reshape(-1).contiguous()


def pack_q6k(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """w = codes * scale per 16 inputs with codes in -32..31 and scale = d sc per 256
    inputs, sc int8 (Q6_K) -> FMT_Q6K bytes, or None."""
    n, k = codes.shape
    if k % SB_INPUTS or scale.shape != (n, k // 16):
        return None
    if int(codes.min()) < -32 or int(codes.max()) > 31:
        return None
    sb = k // SB_INPUTS
    d = factor_scales(scale.reshape(n * sb, 16), _I8, -128, 127)
    if d is None:
        return None
    q = _tiles((codes.to(torch.int16) + 32).to(torch.uint8))
    c = _chunked(q)  # [T, G, 8, 16, 4]
    tiles, groups = c.shape[0], c.shape[1]
    low = ((c[:, :, :4] & 15) | ((c[:, :, 4:] & 15) << 4)).reshape(tiles, groups, 256)
    shift = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 1, 4, 1, 1)
    high = ((c >> 4).reshape(tiles, groups, 2, 4, TILE, 4) << shift).sum(3, dtype=torch.uint8)
    per_group = torch.cat([low, high.reshape(tiles, groups, 128)], dim=2)
    sc = _rows_last(d[1].to(torch.int8).reshape(n, k // 16), 16).contiguous()
    dh = _f16_rows(d[0].reshape(n, sb))
    parts = [per_group.reshape(tiles, sb, -1), sc.view(torch.uint8).reshape(tiles, sb, 256), dh]
    return torch.cat(parts, dim=2).reshape(-1).contiguous()


def native_nbytes(fmt: int, n: int, k: int) -> int:
    """Bytes of an FMT_* weight [n, k] (tiles of 16 rows)."""
    tiles, groups = -(-n // TILE), k // GROUP
    per = {
        FMT_Q4K: groups // SB_GROUPS * Q4K_SB, FMT_Q6K: groups // SB_GROUPS * Q6K_SB,
        FMT_Q5K: groups // SB_GROUPS * Q5K_SB,
        FMT_Q40: groups * Q40_BLOCK, FMT_Q41: groups * Q41_BLOCK, FMT_Q80: groups * Q80_BLOCK,
    }  # fmt: skip
    return tiles * per[fmt]
