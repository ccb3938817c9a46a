"""The fused C ops of the CPU decode step (paged.runner.cpu_step) against paged.kernels.reference.

Norms and rotary are bit-identical to the reference; the gated activations are
float32 maths rounded once to bfloat16, bounded here by one bfloat16 rounding
step (the attention is tested in test_cpu_attention.py). Also: bad inputs raise
ValueError before any C code runs, and everything falls back to torch when the
library is off.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paged.kernels import ops as kernel_ops
from paged.kernels import reference
from paged.runner.cpu_step import attention_ops, build, ops
from paged.runner.layers.layernorm import RMSNorm
from paged.runner.layers.rotary import RotaryEmbedding

BF16 = torch.bfloat16

pytestmark = pytest.mark.skipif(not ops.available(), reason="no C compiler: torch ops only")


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _within_one_bf16_step(got: torch.Tensor, want: torch.Tensor) -> bool:
    """|got - want| <= one bfloat16 rounding step of want (2^-7 relative) + a tiny floor."""
    diff = (got.float() - want.float()).abs()
    return bool((diff <= want.float().abs() * 2**-7 + 1e-6).all())


@pytest.mark.parametrize("hidden", [8, 48, 576, 577, 1000, 2048, 5120])
@pytest.mark.parametrize("scale", [1.0, 40.0])
def test_rms_norm_is_torch_rms_norm_bit_for_bit(hidden: int, scale: float) -> None:
    x = _randn(17, hidden, seed=hidden, scale=scale)
    x[:, 3] *= 50  # an outlier channel, as real residual streams have
    w = _randn(hidden, seed=1).abs()
    want = F.rms_norm(x, (hidden,), w, 1e-5).to(BF16)
    assert torch.equal(ops.rms_norm(x, w, 1e-5), want)  # float32 in
    xb = x.to(BF16)
    want_b = F.rms_norm(xb.float(), (hidden,), w, 1e-5).to(BF16)
    assert torch.equal(ops.rms_norm(xb, w, 1e-5), want_b)
    wide = torch.cat([x, x], dim=1)
    assert torch.equal(ops.rms_norm(wide[:, hidden:], w, 1e-5), want)  # strided rows


def test_add_rms_norm_updates_the_stream_in_place_like_the_reference() -> None:
    x, w = _randn(9, 576, seed=2).to(BF16), _randn(576, seed=4)
    res = _randn(9, 576, seed=3, scale=20)
    want_normed, want_res = reference.fused_add_rms_norm(x.float(), res, w, 1e-6)
    stream = res.clone()
    normed = ops.add_rms_norm_(x, stream, w, 1e-6)
    assert torch.equal(stream, want_res)  # float32 sum, exactly x + residual
    assert torch.equal(normed, want_normed.to(BF16))


def test_rms_norm_module_keeps_a_float32_stream_on_cpu() -> None:
    norm = RMSNorm(64, 1e-6, dtype=BF16)
    norm.load_weight("weight", _randn(64, seed=5), None)
    x = _randn(3, 64, seed=6).to(BF16)
    normed, stream = norm.start_residual(x)
    assert stream.dtype == torch.float32 and torch.equal(stream, x.float())
    assert stream.data_ptr() != x.data_ptr()  # the stream's own copy: x is never written
    assert torch.equal(normed, reference.rms_norm(x, norm.weight, 1e-6))
    delta = _randn(3, 64, seed=7).to(BF16)
    want = reference.fused_add_rms_norm(delta.float(), stream.clone(), norm.weight.float(), 1e-6)
    normed2, stream2 = norm.add_residual_norm_(delta, stream)
    assert stream2 is stream and torch.equal(stream, want[1])
    assert torch.equal(normed2, want[0].to(BF16))


@pytest.mark.parametrize("kind", [ops.SILU, ops.GELU_TANH])
def test_gated_activations_within_one_rounding_of_the_reference(kind: int) -> None:
    x = _randn(6, 2 * 1536, seed=8, scale=3).to(BF16)
    want = reference.silu_and_mul(x) if kind == ops.SILU else reference.gelu_tanh_and_mul(x)
    got = ops.gated_act(x, kind)
    assert got.shape == (6, 1536) and got.dtype == BF16
    assert _within_one_bf16_step(got, want)
    # The C exp (Cephes polynomial) against torch's: silu measured bit-identical on
    # 196k values; gelu (as x * sigmoid(2y), not torch's tanh) 7% one bf16 step apart.
    assert (got != want).float().mean() < (1e-3 if kind == ops.SILU else 0.1)


def test_rotary_is_the_reference_bit_for_bit_on_strided_qkv_views() -> None:
    cache = kernel_ops.compute_cos_sin_cache(64, 4096, 10000.0, None, torch.float32)
    qkv = _randn(5, 64 * (9 + 3 + 3), seed=9).to(BF16)
    q, k = qkv[:, : 9 * 64], qkv[:, 9 * 64 : 12 * 64]
    positions = torch.tensor([0, 3, 100, 4095, 7])
    got = ops.rotary_neox(positions, q, k, 64, cache)
    want = reference.rotary_embedding(positions, q, k, 64, cache, True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="positions"):
        ops.rotary_neox(torch.tensor([0, 1, 2, 3, 4096]), q, k, 64, cache)
    rope = RotaryEmbedding(64, 64, 4096, 10000.0, None)  # the module takes the same call
    got_module = rope(positions.to(torch.int32), q, k)
    assert torch.equal(got_module[0], want[0]) and torch.equal(got_module[1], want[1])


def test_everything_falls_back_to_torch_when_the_library_is_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(build.ENABLE_ENV, "off")
    build.forget()
    monkeypatch.setattr(build, "_default", [])  # read again, and restored afterwards
    assert not ops.available()
    norm = RMSNorm(32, 1e-6, dtype=BF16)
    norm.load_weight("weight", _randn(32, seed=11), None)
    x = _randn(2, 32, seed=12).to(BF16)
    assert torch.equal(norm(x), reference.rms_norm(x, norm.weight, 1e-6))
    assert not attention_ops.available()  # the attention library is off with them
    monkeypatch.setenv(build.ENABLE_ENV, "maybe")
    with pytest.raises(ValueError, match=build.ENABLE_ENV):
        build.enabled()


def test_a_missing_compiler_logs_and_returns_none(caplog: pytest.LogCaptureFixture) -> None:
    assert build.load_step_ops(compiler="/nonexistent/cc") is None
    assert "unavailable" in caplog.text
