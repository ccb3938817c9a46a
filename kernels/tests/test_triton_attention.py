"""Triton paged attention against the reference (interpreter on CPU, CUDA when present)."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged.kernels import reference
from paged.kernels.testing import PagedBatch, make_paged_batch

triton_ops = pytest.importorskip("paged.kernels.triton_ops")

XfailBf16 = Callable[[str, torch.dtype], None]
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _run(
    batch: PagedBatch,
    fn: Callable[..., torch.Tensor],
    window: int | None = None,
    cap: float | None = None,
    **extra: object,
) -> torch.Tensor:
    return fn(
        batch.query, batch.key_cache, batch.value_cache, batch.block_table,
        batch.query_start_loc, batch.seq_lens, batch.query.shape[-1] ** -0.5,
        max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len,
        sliding_window=window, soft_cap=cap, **extra,
    )  # fmt: skip


def _check(batch: PagedBatch, window: int | None = None, cap: float | None = None,
           **extra: object) -> None:  # fmt: skip
    got = _run(batch, triton_ops.paged_attention_split_kv, window, cap, **extra)
    want = _run(batch, reference.paged_attention, window, cap)
    tol = TOL[batch.query.dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_mixed_prefill_and_decode(
    triton_device: str, dtype: torch.dtype, xfail_bf16_interp: XfailBf16
) -> None:
    xfail_bf16_interp(triton_device, dtype)
    batch = make_paged_batch(
        [6, 1, 3, 0, 1], [6, 9, 11, 4, 33], num_heads=4, num_kv_heads=2, head_size=16,
        block_size=4, dtype=dtype, device=triton_device, padding_tokens=3,
    )  # fmt: skip
    _check(batch, num_segments=None)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (8, 2), (4, 1), (7, 1), (12, 4)])
def test_gqa_ratios(triton_device: str, num_heads: int, num_kv_heads: int) -> None:
    batch = make_paged_batch(
        [5, 1, 2], [9, 20, 2], num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=16,
        block_size=8, device=triton_device,
    )  # fmt: skip
    _check(batch)


@pytest.mark.parametrize("head_size", [64, 80, 128, 256])
def test_head_sizes(triton_device: str, head_size: int) -> None:
    batch = make_paged_batch(
        [3, 1], [7, 18], num_heads=2, num_kv_heads=1, head_size=head_size, block_size=16,
        device=triton_device,
    )  # fmt: skip
    _check(batch)


@pytest.mark.parametrize("block_size", [48, 528])
def test_large_and_odd_block_sizes(triton_device: str, block_size: int) -> None:
    # Why the runner never splits allocation blocks into kernel blocks (vLLM
    # does for hybrid models' large attention blocks): any block size works,
    # 528 being vLLM's kind of page-aligned hybrid block, 48 no power of two.
    batch = make_paged_batch(
        [7, 1, 2], [block_size + 9, 2 * block_size + 1, 5], num_heads=4, num_kv_heads=2,
        head_size=16, block_size=block_size, device=triton_device,
    )  # fmt: skip
    _check(batch)


@pytest.mark.parametrize(("window", "cap"), [(4, None), (None, 2.5), (7, 30.0)])
def test_sliding_window_and_soft_cap(
    triton_device: str, window: int | None, cap: float | None
) -> None:
    batch = make_paged_batch(
        [9, 1, 4], [12, 30, 4], num_heads=4, num_kv_heads=2, head_size=16, block_size=4,
        device=triton_device,
    )  # fmt: skip
    _check(batch, window, cap)


def test_long_prefill_uses_large_tiles(triton_device: str) -> None:
    # max_query_len * group >= 64: 64-row query tiles, several key tiles per request.
    batch = make_paged_batch(
        [70, 1], [90, 5], num_heads=2, num_kv_heads=2, head_size=16, block_size=16,
        device=triton_device,
    )  # fmt: skip
    launch = triton_ops.choose_launch(
        2, 2, 16, torch.float32, 70, 90, 71, 2, torch.device(triton_device)
    )
    assert (launch.block_m, launch.num_warps) == (64, 8)
    _check(batch)


@pytest.mark.parametrize("num_segments", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_kv_decode(triton_device: str, num_segments: int, dtype: torch.dtype) -> None:
    batch = make_paged_batch(
        [1, 1, 1, 1], [200, 3, 64, 130], num_heads=4, num_kv_heads=1, head_size=32,
        block_size=16, dtype=dtype, device=triton_device, padding_tokens=1,
    )  # fmt: skip
    _check(batch, num_segments=num_segments)
    _check(batch, 50, 5.0, num_segments=num_segments)  # windows leave segments empty


def test_split_kv_also_handles_prefill_rows(triton_device: str) -> None:
    batch = make_paged_batch(
        [5, 1], [40, 77], num_heads=2, num_kv_heads=1, head_size=16, block_size=8,
        device=triton_device,
    )  # fmt: skip
    _check(batch, num_segments=4)


def test_writes_into_out_and_leaves_padding(triton_device: str) -> None:
    batch = make_paged_batch(
        [2, 1], [3, 5], num_heads=2, num_kv_heads=1, head_size=16, block_size=2,
        device=triton_device, padding_tokens=2,
    )  # fmt: skip
    out = torch.full_like(batch.query, 7.0)
    got = _run(batch, triton_ops.paged_attention, out=out)
    assert got is out
    want = _run(batch, reference.paged_attention)
    torch.testing.assert_close(out[:3], want[:3])
    assert bool((out[3:] == 7.0).all())


def test_rejects_bad_arguments(triton_device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    batch = make_paged_batch(
        [2], [3], num_heads=2, num_kv_heads=1, head_size=16, block_size=2, device=triton_device
    )
    with pytest.raises(ValueError, match="must be contiguous in its last dimension"):
        q = batch.query.transpose(1, 2).contiguous().transpose(1, 2)
        triton_ops.paged_attention(
            q, batch.key_cache, batch.value_cache, batch.block_table, batch.query_start_loc,
            batch.seq_lens, 1.0, max_query_len=2, max_seq_len=3,
        )  # fmt: skip
    with pytest.raises(ValueError, match="num_segments must be a power of two"):
        _run(batch, triton_ops.paged_attention_split_kv, num_segments=3)
    if triton_device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            _run(batch, triton_ops.paged_attention)


@settings(max_examples=8, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 40)), min_size=1, max_size=4),
    group=st.sampled_from([1, 2, 3]),
    block_size=st.sampled_from([1, 4, 16]),
    window=st.one_of(st.none(), st.integers(1, 20)),
    segments=st.sampled_from([None, 2]),
    seed=st.integers(0, 2**16),
)
def test_random_batches_match_reference(
    lens: list[tuple[int, int]],
    group: int,
    block_size: int,
    window: int | None,
    segments: int | None,
    seed: int,
) -> None:
    """Random ragged batches (idle requests, q_len == seq_len, single-token blocks)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1")
    q_lens = [min(q, s) for q, s in lens]
    seq_lens = [s for _, s in lens]
    batch = make_paged_batch(
        q_lens, seq_lens, num_heads=2 * group, num_kv_heads=2, head_size=16,
        block_size=block_size, device=device, generator=torch.Generator().manual_seed(seed),
    )  # fmt: skip
    _check(batch, window, None, num_segments=segments)
