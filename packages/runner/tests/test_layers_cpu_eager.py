"""The CPU eager fast paths compute exactly what paged.kernels.reference computes."""

from __future__ import annotations

import pytest
import torch

from paged.kernels import ops, reference
from paged.runner.layers import cpu_eager
from paged.runner.layers.activation import GeluTanhAndMul, SiluAndMul
from paged.runner.layers.layernorm import GemmaRMSNorm, RMSNorm
from paged.runner.layers.rotary import RotaryEmbedding, _adjacent_columns

DTYPES = [torch.float32, torch.bfloat16]


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7])
def test_rms_norm_modules_equal_reference_and_leave_inputs_alone(
    dtype: torch.dtype, rows: int
) -> None:
    norm = RMSNorm(48, 1e-6, dtype=dtype)
    norm.load_weight("weight", _randn(48, dtype=dtype, seed=1), None)
    x, res = _randn(rows, 48, dtype=dtype, seed=2), _randn(rows, 48, dtype=dtype, seed=3)
    x0, res0 = x.clone(), res.clone()
    assert cpu_eager.cpu_fast_path(x)
    assert torch.equal(norm(x), reference.rms_norm(x, norm.weight, 1e-6))
    got = norm.forward_with_residual(x, res)
    want = reference.fused_add_rms_norm(x, res, norm.weight, 1e-6)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[0].dtype == dtype and got[1].dtype == dtype
    assert torch.equal(x, x0) and torch.equal(res, res0)  # inputs untouched (float32 too)
    # A reload changes the cached float32 weight with it.
    norm.load_weight("weight", _randn(48, dtype=dtype, seed=4), None)
    assert torch.equal(norm(x), reference.rms_norm(x, norm.weight, 1e-6))
    with pytest.raises(ValueError, match="residual"):
        norm.forward_with_residual(x, res[:, :24])


def test_gemma_norm_fast_path_uses_one_plus_w() -> None:
    norm = GemmaRMSNorm(32, 1e-6, dtype=torch.bfloat16)
    w = _randn(32, dtype=torch.float32, seed=5)
    norm.load_weight("weight", w, None)
    x = _randn(3, 32, dtype=torch.bfloat16, seed=6)
    want = reference.rms_norm(x, (w + 1.0).to(torch.bfloat16), 1e-6)
    assert torch.equal(norm(x), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_activations_equal_reference(dtype: torch.dtype) -> None:
    x = _randn(5, 64, dtype=dtype, seed=7)
    assert torch.equal(SiluAndMul()(x), reference.silu_and_mul(x))
    assert torch.equal(GeluTanhAndMul()(x), reference.gelu_tanh_and_mul(x))


def test_fast_path_off_when_another_backend_is_forced() -> None:
    x = torch.zeros(2, 8)
    with ops.use_backend("reference"):
        assert cpu_eager.cpu_fast_path(x)
    assert not cpu_eager.cpu_fast_path(x.to("meta"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_rotates_adjacent_and_separate_q_k_the_same(dtype: torch.dtype) -> None:
    rope = RotaryEmbedding(16, 16, 64, 10000.0, None)
    qkv = _randn(4, 16 * 8, dtype=dtype, seed=8)
    q, k = qkv[:, :64], qkv[:, 64:96]
    positions = torch.tensor([0, 5, 9, 63])
    joint = rope(positions, q, k)
    separate = rope(positions, q.clone(), k.clone())  # not adjacent: two rotations
    assert torch.equal(joint[0], separate[0]) and torch.equal(joint[1], separate[1])
    want = reference.rotary_embedding(positions, q, k, 16, rope.cos_sin_cache, True)
    assert torch.equal(joint[0], want[0]) and torch.equal(joint[1], want[1])
    assert torch.equal(qkv, _randn(4, 16 * 8, dtype=dtype, seed=8))  # qkv not written


def test_adjacent_columns_only_for_true_neighbours() -> None:
    t = torch.arange(40.0).view(4, 10)
    view = _adjacent_columns(t[:, :4], t[:, 4:7])
    assert view is not None and torch.equal(view, t[:, :7])
    assert _adjacent_columns(t[:, :4], t[:, 5:7]) is None  # a gap
    assert _adjacent_columns(t[:, 4:7], t[:, :4]) is None  # wrong order
    assert _adjacent_columns(t[:, :4], t.clone()[:, 4:7]) is None  # other storage
    assert _adjacent_columns(t[:2, :4], t[:2, 4:7].clone()) is None
    assert _adjacent_columns(t[:, :4], t[:, 4:7].to(torch.float64)) is None
