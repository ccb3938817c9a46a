"""Triton cache, rotary, norm and activation kernels against the reference.

These kernels load bf16, compute in float32 and store bf16, which the interpreter
handles correctly, so bf16 is tested here too (only bf16 ``tl.dot`` is wrong there).
"""

from __future__ import annotations

import pytest
import torch

from paged.kernels import PAD_SLOT_ID, RopeScaling, compute_cos_sin_cache, ops, reference

triton_ops = pytest.importorskip("paged.kernels.triton_ops")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)


# ---------------------------------------------------------------- cache writes and copies
@pytest.mark.parametrize("dtype", DTYPES)  # a pure copy: bf16 is exact even when interpreted
def test_reshape_and_cache(triton_device: str, dtype: torch.dtype, gen: torch.Generator) -> None:
    n, b, h, d = 5, 4, 2, 24
    qkv = _randn(gen, 7, (4 + 2 * h) * d, dtype=dtype, device=triton_device)
    # key/value as strided views of a fused qkv projection, like the models produce.
    key = qkv[:, 4 * d : (4 + h) * d].view(7, h, d)
    value = qkv[:, (4 + h) * d :].view(7, h, d)
    slots = torch.tensor([17, PAD_SLOT_ID, 0, 3, 19, PAD_SLOT_ID], device=triton_device)
    caches = [torch.zeros(n, b, h, d, dtype=dtype, device=triton_device) for _ in range(4)]
    triton_ops.reshape_and_cache(key, value, caches[0], caches[1], slots)
    reference.reshape_and_cache(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].abs().sum() > 0


def test_reshape_and_cache_skips_out_of_range_slots(triton_device: str) -> None:
    kc = torch.zeros(2, 2, 1, 16, device=triton_device)
    vc = torch.zeros_like(kc)
    key = torch.ones(2, 1, 16, device=triton_device)
    triton_ops.reshape_and_cache(key, key, kc, vc, torch.tensor([4, 1], device=triton_device))
    assert kc.reshape(4, 16).sum(dim=1).tolist() == [0.0, 16.0, 0.0, 0.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_blocks(triton_device: str, dtype: torch.dtype, gen: torch.Generator) -> None:
    kv = _randn(gen, 2, 6, 4, 2, 8, dtype=dtype, device=triton_device)
    src = kv[1]  # the V half of a combined cache: blocks are contiguous, dim 0 strided
    dst = torch.zeros(3, 4, 2, 8, dtype=dtype, device=triton_device)
    want = dst.clone()
    ids_src, ids_dst = torch.tensor([5, 0, 3]), torch.tensor([2, 0, 1])
    triton_ops.copy_blocks(src, dst, ids_src, ids_dst)
    reference.copy_blocks(src, want, ids_src, ids_dst)
    assert torch.equal(dst, want)
    with pytest.raises(ValueError, match="dst_block_ids must be in"):
        triton_ops.copy_blocks(src, dst, torch.tensor([0]), torch.tensor([3]))
    with pytest.raises(ValueError, match="contiguous within each block"):
        triton_ops.copy_blocks(src.transpose(1, 2), dst.transpose(1, 2), ids_src, ids_dst)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_copy_blocks_between_devices() -> None:
    gpu = torch.randn(4, 3, 8, device="cuda")
    cpu = torch.zeros(5, 3, 8)
    triton_ops.copy_blocks(gpu, cpu, torch.tensor([3, 1]), torch.tensor([0, 4]))
    assert torch.equal(cpu[0], gpu[3].cpu()) and torch.equal(cpu[4], gpu[1].cpu())
    back = torch.zeros_like(gpu)
    triton_ops.copy_blocks(cpu, back, torch.tensor([0]), torch.tensor([2]))
    assert torch.equal(back[2], gpu[3])


# ---------------------------------------------------------------- rotary
@pytest.mark.parametrize(
    ("is_neox", "rotary_dim", "scaling", "dtype"),
    [
        (True, 32, None, torch.float32),
        (False, 32, RopeScaling("linear", factor=2.0), torch.float32),
        (True, 16, RopeScaling("llama3", factor=8.0, original_max_position_embeddings=16),
         torch.float16),
        (False, 32, None, torch.bfloat16),
    ],
)  # fmt: skip
def test_rotary_embedding(
    triton_device: str,
    is_neox: bool,
    rotary_dim: int,
    scaling: RopeScaling | None,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> None:
    d, hq, hkv = 32, 3, 1
    cache = compute_cos_sin_cache(rotary_dim, 64, 10000.0, scaling, torch.float32)
    cache = cache.to(triton_device)
    positions = torch.tensor([0, 5, 63, 2, 17], device=triton_device)
    q = _randn(gen, 5, hq * d, dtype=dtype, device=triton_device)
    k = _randn(gen, 5, hkv * d, dtype=dtype, device=triton_device)
    q0 = q.clone()
    got = triton_ops.rotary_embedding(positions, q, k, d, cache, is_neox)
    want = reference.rotary_embedding(positions, q, k, d, cache, is_neox)
    assert torch.equal(q, q0)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.float(), w.float(), atol=TOL[dtype], rtol=TOL[dtype])


# ---------------------------------------------------------------- norms and activations
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gemma_style", [False, True])
def test_rms_norm(
    triton_device: str,
    dtype: torch.dtype,
    gemma_style: bool,
    gen: torch.Generator,
) -> None:
    wide = _randn(gen, 4, 2 * 48, dtype=dtype, device=triton_device)
    x = wide[:, :48]  # row-strided view
    res = _randn(gen, 4, 48, dtype=dtype, device=triton_device)
    w = _randn(gen, 48, dtype=dtype, device=triton_device)
    tol = TOL[dtype]
    got = triton_ops.rms_norm(x, w, 1e-6, gemma_style=gemma_style)
    want = reference.rms_norm(x, w, 1e-6, gemma_style=gemma_style)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    got2 = triton_ops.fused_add_rms_norm(x, res, w, 1e-6, gemma_style=gemma_style)
    want2 = reference.fused_add_rms_norm(x, res, w, 1e-6, gemma_style=gemma_style)
    for g, wt in zip(got2, want2, strict=True):
        torch.testing.assert_close(g.float(), wt.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_activations(triton_device: str, dtype: torch.dtype, gen: torch.Generator) -> None:
    x = _randn(gen, 3, 2 * 40, dtype=dtype, device=triton_device) * 4
    tol = TOL[dtype]
    for name in ("silu_and_mul", "gelu_tanh_and_mul"):
        got = getattr(triton_ops, name)(x)
        want = getattr(reference, name)(x)
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_wrappers_reject_bad_input(triton_device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(4, 8, device=triton_device)
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        triton_ops.silu_and_mul(x.t())
    with pytest.raises(ValueError, match="weight must be"):
        triton_ops.rms_norm(x, torch.ones(7, device=triton_device), 1e-6)
    if triton_device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            triton_ops.rms_norm(x, torch.ones(8), 1e-6)


def test_ops_triton_backend_dispatches_to_triton(triton_device: str) -> None:
    x = torch.randn(2, 16, device=triton_device)
    with ops.use_backend("triton"):
        assert ops.backend_for(x) is triton_ops
        torch.testing.assert_close(ops.silu_and_mul(x), reference.silu_and_mul(x))
    if triton_device == "cuda":
        assert ops.backend_for(x) is triton_ops  # auto picks Triton on CUDA
