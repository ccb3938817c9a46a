"""Checkpoint codes and scales -> qgemm.c's tile layout (and back, for tests and reports).

See the layout comment at the top of qgemm.c: tiles of 16 output rows, blocks
of 32 inputs; inside a block, 4 consecutive inputs of the 16 rows form one
64-byte vector. Rows are padded with zeros to a multiple of 16 (their
outputs are never written).
"""

from __future__ import annotations

import torch

TILE = 16
GROUP = 32
Q4_BLOCK = 256 + 64 + 64
Q8_CODES = 512


def _tiles(t: torch.Tensor) -> torch.Tensor:
    """Pad dim 0 of [N, ...] with zeros to a multiple of TILE."""
    pad = -t.shape[0] % TILE
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """[..., L] of 4-byte values -> [..., 4L] uint8."""
    return t.contiguous().view(torch.uint8)


def _chunked(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [T, G, 8, 16, 4]: (tile, group, chunk of 4 inputs, row in tile, input in chunk)."""
    n, k = codes.shape
    return codes.reshape(n // TILE, TILE, k // GROUP, 8, 4).permute(0, 2, 3, 1, 4)


def _per_tile(values: torch.Tensor, groups: int, sub: int) -> torch.Tensor:
    """[N, G * sub] -> [T, G, sub * 16] (tile, group, sub-group-major rows)."""
    n = values.shape[0]
    return (
        values.reshape(n // TILE, TILE, groups, sub)
        .permute(0, 2, 3, 1)
        .reshape(n // TILE, groups, sub * TILE)
    )


def pack_q4(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """w = codes * scale + offset per 32 inputs -> packed uint8 (one block per tile and group).

    codes uint8 [N, K] in 0..15, scale/offset float32 [N, K/32]; K a multiple of 32.
    """
    n, k = codes.shape
    if k % GROUP or scale.shape != (n, k // GROUP) or offset.shape != scale.shape:
        raise ValueError(f"pack_q4: codes {tuple(codes.shape)} need [N, K/32] scales, K % 32 == 0")
    c = _chunked(_tiles(codes.to(torch.uint8)))
    nibbles = (c[:, :, :4] | (c[:, :, 4:] << 4)).reshape(c.shape[0], k // GROUP, 256)
    d = _as_bytes(_per_tile(_tiles(scale.float()), k // GROUP, 1))
    m = _as_bytes(_per_tile(_tiles(offset.float()), k // GROUP, 1))
    return torch.cat([nibbles, d, m], dim=-1).reshape(-1).contiguous()


def pack_q8(codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, int]:
    """w = codes * scale per 32 (scale [N, K/32]) or per 16 inputs (scale [N, K/16]).

    Returns (packed uint8, sub) with sub = scales per 32 inputs (1 or 2).
    """
    n, k = codes.shape
    if k % GROUP or scale.shape[0] != n or scale.shape[1] not in (k // GROUP, 2 * k // GROUP):
        raise ValueError(
            f"pack_q8: codes {tuple(codes.shape)} need [N, K/32] or [N, K/16] scales, K % 32 == 0"
        )
    sub = scale.shape[1] // (k // GROUP)
    groups = k // GROUP
    padded = _tiles(codes.to(torch.int8))
    c = _chunked(padded).contiguous().view(torch.uint8).reshape(-1, groups, Q8_CODES)
    sums = padded.to(torch.int32).reshape(padded.shape[0], groups * sub, GROUP // sub).sum(-1)
    corr = _as_bytes(_per_tile((-128 * sums).to(torch.int32), groups, sub))
    d = _as_bytes(_per_tile(_tiles(scale.float()), groups, sub))
    return torch.cat([c, corr, d], dim=-1).reshape(-1).contiguous(), sub


def unpack_q4(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The float32 [N, K] weight a pack_q4 block array stands for."""
    groups, tiles = k // GROUP, -(-n // TILE)
    blocks = packed.reshape(tiles, groups, Q4_BLOCK)
    nib = blocks[..., :256].reshape(tiles, groups, 4, TILE, 4)
    c = torch.cat([nib & 15, nib >> 4], dim=2)  # [T, G, 8, 16, 4]
    codes = c.permute(0, 3, 1, 2, 4).reshape(tiles * TILE, k).float()
    d = blocks[..., 256:320].contiguous().view(torch.float32)  # [T, G, 16]
    m = blocks[..., 320:].contiguous().view(torch.float32)
    d_rows = d.permute(0, 2, 1).reshape(tiles * TILE, groups).repeat_interleave(GROUP, 1)
    m_rows = m.permute(0, 2, 1).reshape(tiles * TILE, groups).repeat_interleave(GROUP, 1)
    return (codes * d_rows + m_rows)[:n]


def unpack_q8(packed: torch.Tensor, n: int, k: int, sub: int) -> torch.Tensor:
    """The float32 [N, K] weight a pack_q8 block array stands for."""
    groups, tiles = k // GROUP, -(-n // TILE)
    blocks = packed.reshape(tiles, groups, Q8_CODES + sub * 128)
    c = blocks[..., :Q8_CODES].contiguous().view(torch.int8).reshape(tiles, groups, 8, TILE, 4)
    codes = c.permute(0, 3, 1, 2, 4).reshape(tiles * TILE, k).float()
    d = blocks[..., Q8_CODES + sub * 64 :].contiguous().view(torch.float32)  # [T, G, sub*16]
    d = d.reshape(tiles, groups, sub, TILE).permute(0, 3, 1, 2).reshape(tiles * TILE, groups * sub)
    return (codes * d.repeat_interleave(GROUP // sub, 1))[:n]
