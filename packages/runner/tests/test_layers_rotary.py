"""RotaryEmbedding's CPU fast path is bit-identical to paged.kernels.reference."""

from __future__ import annotations

import pytest
import torch

from paged.kernels import ops, reference
from paged.runner.layers.rotary import RotaryEmbedding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_path_equals_reference_and_tracks_positions(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    rope = RotaryEmbedding(16, 16, 64, 10000.0, None)
    # q and k as column slices of one packed qkv output, as in LlamaAttention.
    qkv = torch.randn(5, 16 * (4 + 2 + 2), generator=gen).to(dtype)
    q, k = qkv[:, :64], qkv[:, 64:96]
    positions = torch.tensor([0, 3, 7, 31, 63])
    for _ in range(2):  # the second call reuses the step's cos/sin rows
        got = rope(positions, q, k)
        want = reference.rotary_embedding(positions, q, k, 16, rope.cos_sin_cache, True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert got[0].dtype == dtype
    positions.copy_(torch.tensor([1, 2, 3, 4, 5]))  # in place: the cached rows are stale
    got = rope(positions, q, k)
    want = reference.rotary_embedding(positions, q, k, 16, rope.cos_sin_cache, True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with ops.use_backend("reference"), pytest.raises(ValueError, match="positions"):
        rope(torch.tensor([0, 1, 2, 3, 64]), q, k)
    with pytest.raises(ValueError, match="query/key"):
        rope(positions, q[:4], k[:4])
