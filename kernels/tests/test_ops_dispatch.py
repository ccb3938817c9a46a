from __future__ import annotations

import pytest
import torch

from paged.kernels import ops, reference


def test_set_backend_validates_and_use_backend_restores() -> None:
    assert ops.get_backend() == "auto"
    with pytest.raises(ValueError, match="backend must be one of"):
        ops.set_backend("cuda")  # type: ignore[arg-type]
    with ops.use_backend("reference"):
        assert ops.get_backend() == "reference"
    assert ops.get_backend() == "auto"


def test_auto_uses_reference_on_cpu() -> None:
    assert ops.backend_for(torch.zeros(1)) is reference
    with ops.use_backend("reference"):
        assert ops.backend_for(torch.zeros(1)) is reference


def test_dispatched_ops_match_reference(gen: torch.Generator) -> None:
    x = torch.randn(3, 8, generator=gen)
    w = torch.randn(8, generator=gen)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
    torch.testing.assert_close(ops.silu_and_mul(x), reference.silu_and_mul(x))
    cache = ops.compute_cos_sin_cache(4, 8, 10000.0, None, torch.float32)
    pos = torch.tensor([1, 2, 3])
    q, k = ops.rotary_embedding(pos, x, x, 4, cache, True)
    rq, rk = reference.rotary_embedding(pos, x, x, 4, cache, True)
    assert torch.equal(q, rq) and torch.equal(k, rk)
