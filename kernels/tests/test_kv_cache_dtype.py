"""KV caches in another dtype than the activations: fp8 with per-tensor scales, fp16/bf16.

The reference defines the storage (kv_quant); the Triton kernels must store the
same bits and read back the same values (interpreter on CPU, CUDA when present).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from paged.kernels import ops, reference
from paged.kernels.kv_quant import dequantize_kv, fp8_max, quantize_kv
from paged.kernels.testing import PagedBatch, make_paged_batch

triton_ops = pytest.importorskip("paged.kernels.triton_ops")

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# Half the spacing of the format's values relative to the value: the most a
# round-to-nearest store may change a normal number by.
REL_ERR = {torch.float8_e4m3fn: 2.0**-4, torch.float8_e5m2: 2.0**-3}


def _kv(gen: torch.Generator, t: int, h: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    key = torch.randn(t, h, d, generator=gen) * 3
    value = torch.randn(t, h, d, generator=gen) * 3
    # Values whose rounding carries into the next exponent, tiny ones (subnormal
    # in fp8) and out-of-range ones (saturated, never NaN).
    key[0, 0, :6] = torch.tensor([1.9407, 1.97, -3.9, 2.0**-8, -(2.0**-17), 1e6])
    return key, value


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.05, 0.37)])
def test_reference_fp8_round_trip_within_format_error(
    cache_dtype: torch.dtype, k_scale: float, v_scale: float, gen: torch.Generator
) -> None:
    n, b, h, d = 4, 4, 2, 8
    key, value = _kv(gen, 6, h, d)
    key_cache = torch.zeros(n, b, h, d, dtype=cache_dtype)
    value_cache = torch.zeros(n, b, h, d, dtype=cache_dtype)
    slots = torch.tensor([5, 0, 15, 7, -1, 9])
    reference.reshape_and_cache(
        key, value, key_cache, value_cache, slots, k_scale=k_scale, v_scale=v_scale
    )
    for x, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        flat = cache.view(-1, h, d)
        got = dequantize_kv(flat[slots[slots >= 0]], torch.float32, scale)
        want = x[slots >= 0]
        limit = fp8_max(cache_dtype) * scale
        clipped = want.clamp(-limit, limit)
        # Normal numbers: relative error; subnormal ones: half the smallest step.
        smallest = torch.finfo(cache_dtype).smallest_normal * scale
        tol = clipped.abs() * REL_ERR[cache_dtype] + smallest
        assert bool(((got - clipped).abs() <= tol).all())
        assert bool(got.isfinite().all())
    saturated = key_cache.view(-1, h, d)[5, 0, 5]
    assert float(saturated) == fp8_max(cache_dtype)


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.05, 0.37)])
def test_triton_fp8_cache_write_matches_reference_bits(
    triton_device: str,
    cache_dtype: torch.dtype,
    k_scale: float,
    v_scale: float,
    gen: torch.Generator,
) -> None:
    n, b, h, d = 4, 4, 2, 8
    key, value = _kv(gen, 6, h, d)
    key, value = key.to(triton_device), value.to(triton_device)
    slots = torch.tensor([5, 0, 15, 7, -1, 9], device=triton_device)
    caches = [torch.zeros(n, b, h, d, dtype=cache_dtype, device=triton_device) for _ in range(4)]
    triton_ops.reshape_and_cache(
        key, value, caches[0], caches[1], slots, k_scale=k_scale, v_scale=v_scale
    )
    reference.reshape_and_cache(
        key, value, caches[2], caches[3], slots, k_scale=k_scale, v_scale=v_scale
    )
    for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_float_cache_of_another_dtype_is_a_cast(
    triton_device: str,
    cache_dtype: torch.dtype,
    gen: torch.Generator,
    xfail_bf16_interp: Callable[[str, torch.dtype], None],
) -> None:
    # The interpreter truncates float32 -> bfloat16 instead of rounding to nearest.
    xfail_bf16_interp(triton_device, cache_dtype)
    key = (torch.randn(6, 2, 8, generator=gen) * 3).to(triton_device)
    value = (torch.randn(6, 2, 8, generator=gen) * 3).to(triton_device)
    slots = torch.tensor([5, 0, 15, 7, -1, 9], device=triton_device)
    caches = [torch.zeros(4, 4, 2, 8, dtype=cache_dtype, device=triton_device) for _ in range(4)]
    triton_ops.reshape_and_cache(key, value, caches[0], caches[1], slots)
    reference.reshape_and_cache(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert torch.equal(caches[2].view(-1, 2, 8)[5], key[0].to(cache_dtype))


def _fp8_batch(
    cache_dtype: torch.dtype, k_scale: float, v_scale: float, device: str, gen: torch.Generator
) -> tuple[PagedBatch, torch.Tensor, torch.Tensor]:
    batch = make_paged_batch(
        [3, 1, 1], [7, 12, 5], num_heads=4, num_kv_heads=2, head_size=16, block_size=4,
        device=device, generator=gen,
    )  # fmt: skip
    return (
        batch,
        quantize_kv(batch.key_cache, cache_dtype, k_scale),
        quantize_kv(batch.value_cache, cache_dtype, v_scale),
    )


def _attend(
    fn: Callable[..., torch.Tensor],
    batch: PagedBatch,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    **scales: float,
) -> torch.Tensor:
    return fn(
        batch.query, key_cache, value_cache, batch.block_table, batch.query_start_loc,
        batch.seq_lens, batch.query.shape[-1] ** -0.5, max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len, **scales,
    )  # fmt: skip


@pytest.mark.parametrize("cache_dtype", FP8)
def test_fp8_attention_triton_matches_reference_and_stays_near_fp32(
    triton_device: str, cache_dtype: torch.dtype, gen: torch.Generator
) -> None:
    k_scale, v_scale = 0.02, 0.03
    batch, kc, vc = _fp8_batch(cache_dtype, k_scale, v_scale, triton_device, gen)
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    want = _attend(reference.paged_attention, batch, kc, vc, **scales)
    got = _attend(triton_ops.paged_attention, batch, kc, vc, **scales)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    # Against the unquantised cache: off by the format's rounding only.
    exact = _attend(reference.paged_attention, batch, batch.key_cache, batch.value_cache)
    err = (want - exact).abs().max().item()
    assert err < {torch.float8_e4m3fn: 0.15, torch.float8_e5m2: 0.3}[cache_dtype]
    # Without its scales the same cache reads back as nonsense: the scales are used.
    unscaled = _attend(reference.paged_attention, batch, kc, vc)
    assert (unscaled - exact).abs().max().item() > 10 * err


def test_float16_cache_with_float32_queries(triton_device: str, gen: torch.Generator) -> None:
    batch = make_paged_batch(
        [3, 1], [7, 9], num_heads=4, num_kv_heads=2, head_size=16, block_size=4,
        device=triton_device, generator=gen,
    )  # fmt: skip
    kc, vc = batch.key_cache.half(), batch.value_cache.half()
    want = _attend(reference.paged_attention, batch, kc, vc)
    got = _attend(triton_ops.paged_attention, batch, kc, vc)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    with ops.use_backend("reference"):
        via_ops = _attend(ops.paged_attention, batch, kc, vc)
    torch.testing.assert_close(via_ops, want)


def test_cache_dtype_and_scale_checks() -> None:
    key = torch.zeros(2, 1, 4)
    slots = torch.tensor([0, 1])
    fp8 = torch.zeros(2, 2, 1, 4, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="k_scale must be a positive finite float"):
        reference.reshape_and_cache(key, key, fp8, fp8.clone(), slots, k_scale=0.0)
    with pytest.raises(ValueError, match="v_scale"):
        reference.reshape_and_cache(key, key, fp8, fp8.clone(), slots, v_scale=float("nan"))
    with pytest.raises(ValueError, match="value_cache dtype"):
        reference.reshape_and_cache(key, key, fp8, fp8.to(torch.float8_e5m2), slots)
    with pytest.raises(ValueError, match="key_cache dtype must be one of"):
        ints = torch.zeros(2, 2, 1, 4, dtype=torch.int8)
        reference.reshape_and_cache(key, key, ints, ints.clone(), slots)


@pytest.mark.parametrize("cache_dtype", FP8)
def test_copy_blocks_of_fp8_caches(
    triton_device: str, cache_dtype: torch.dtype, gen: torch.Generator
) -> None:
    # Offloading and swapping move fp8 blocks as they are (torch has no CPU
    # index_copy_ for fp8, so the reference copies their bytes).
    src = quantize_kv(torch.randn(6, 4, 2, 8, generator=gen), cache_dtype, 1.0).to(triton_device)
    ids = torch.tensor([4, 1], device=triton_device), torch.tensor([0, 3], device=triton_device)
    for backend in (reference, triton_ops):
        dst = torch.zeros(5, 4, 2, 8, dtype=cache_dtype, device=triton_device)
        backend.copy_blocks(src, dst, *ids)
        assert torch.equal(dst[0].view(torch.uint8), src[4].view(torch.uint8))
        assert torch.equal(dst[3].view(torch.uint8), src[1].view(torch.uint8))
        assert not bool(dst[1].view(torch.uint8).any())


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_cpu_dequantize_matches_torch_conversion_on_every_code(
    cache_dtype: torch.dtype, dtype: torch.dtype, scale: float
) -> None:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(cache_dtype)
    want = (codes.float() * scale).to(dtype)
    got = dequantize_kv(codes, dtype, scale)
    finite = want.isfinite() & codes.float().isfinite()  # NaN/inf codes are never stored
    assert got.dtype == dtype
    assert torch.equal(got[finite], want[finite])
    assert torch.equal(torch.signbit(got[finite]), torch.signbit(want[finite]))
