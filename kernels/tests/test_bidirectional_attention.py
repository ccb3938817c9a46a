"""Bidirectional spans (Gemma3 image tokens) in paged attention: reference vs a dense mask,
Triton vs reference (interpreter on CPU), and the split-span error."""

from __future__ import annotations

import pytest
import torch

from paged.kernels import reference
from paged.kernels.testing import PagedBatch, make_paged_batch


def _ranges(batch: PagedBatch, spans: list[list[tuple[int, int]]]) -> torch.Tensor:
    """[T, 2]: for each query token, the span (absolute positions) it sits in, else (0, 0)."""
    starts = batch.query_start_loc.tolist()
    out = torch.zeros(batch.query.shape[0], 2, dtype=torch.int32)
    for r, req_spans in enumerate(spans):
        q_len = starts[r + 1] - starts[r]
        first = int(batch.seq_lens[r]) - q_len
        for i in range(q_len):
            for s, e in req_spans:
                if s <= first + i < e:
                    out[starts[r] + i] = torch.tensor([s, e])
    return out


def _dense(
    batch: PagedBatch, spans: list[list[tuple[int, int]]], window: int | None
) -> torch.Tensor:
    """Independent definition: one masked softmax per request over its dense keys."""
    starts = batch.query_start_loc.tolist()
    out = torch.zeros_like(batch.query)
    scale = batch.query.shape[-1] ** -0.5
    for r, (k, v) in enumerate(zip(batch.dense_keys, batch.dense_values, strict=True)):
        q = batch.query[starts[r] : starts[r + 1]]
        q_len, seq_len = q.shape[0], k.shape[0]
        if q_len == 0:
            continue
        group = q.shape[1] // k.shape[1]
        kk = k.repeat_interleave(group, dim=1)
        vv = v.repeat_interleave(group, dim=1)
        allowed = torch.zeros(q_len, seq_len, dtype=torch.bool)
        for i in range(q_len):
            qp = seq_len - q_len + i
            for kp in range(seq_len):
                ok = kp <= qp or any(s <= qp < e and s <= kp < e for s, e in spans[r])
                if window is not None:
                    ok = ok and qp - kp < window
                allowed[i, kp] = ok
        scores = torch.einsum("qhd,khd->hqk", q.float(), kk.float()) * scale
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[starts[r] : starts[r + 1]] = torch.einsum("hqk,khd->qhd", probs, vv.float())
    return out


CASES = [
    # (query_lens, seq_lens, spans per request)
    ([12, 1, 7], [12, 20, 15], [[(2, 7), (8, 11)], [(3, 9)], [(9, 14)]]),
    ([40], [40], [[(1, 33)]]),  # one span wider than a query tile
    ([9, 5], [30, 5], [[(25, 29)], [(0, 5)]]),  # chunk after a cached prefix; span at 0
]


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_reference_matches_dense_mask(case: int, window: int | None) -> None:
    q_lens, s_lens, spans = CASES[case]
    batch = make_paged_batch(
        q_lens, s_lens, num_heads=4, num_kv_heads=2, head_size=16, block_size=4,
        generator=torch.Generator().manual_seed(case),
    )  # fmt: skip
    got = reference.paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.block_table,
        batch.query_start_loc, batch.seq_lens, batch.query.shape[-1] ** -0.5,
        max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len,
        sliding_window=window, bidirectional_ranges=_ranges(batch, spans),
    )  # fmt: skip
    torch.testing.assert_close(got, _dense(batch, spans, window), atol=1e-5, rtol=1e-5)
    causal = reference.paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.block_table,
        batch.query_start_loc, batch.seq_lens, batch.query.shape[-1] ** -0.5,
        max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len,
        sliding_window=window,
    )  # fmt: skip
    assert not torch.allclose(got, causal, atol=1e-4)  # the spans do change the result


def test_split_span_is_rejected() -> None:
    batch = make_paged_batch([4], [4], num_heads=2, num_kv_heads=2, head_size=16, block_size=4)
    ranges = torch.tensor([[0, 0], [1, 6], [1, 6], [1, 6]], dtype=torch.int32)  # ends past 4
    with pytest.raises(ValueError, match="split across steps"):
        reference.paged_attention(
            batch.query, batch.key_cache, batch.value_cache, batch.block_table,
            batch.query_start_loc, batch.seq_lens, 0.25, max_query_len=4, max_seq_len=4,
            bidirectional_ranges=ranges,
        )  # fmt: skip
    with pytest.raises(ValueError, match="num_tokens, 2"):
        reference.paged_attention(
            batch.query, batch.key_cache, batch.value_cache, batch.block_table,
            batch.query_start_loc, batch.seq_lens, 0.25, max_query_len=4, max_seq_len=4,
            bidirectional_ranges=ranges[:2],
        )  # fmt: skip


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("segments", [None, 2])
def test_triton_matches_reference(
    triton_device: str, case: int, window: int | None, segments: int | None
) -> None:
    triton_ops = pytest.importorskip("paged.kernels.triton_ops")
    q_lens, s_lens, spans = CASES[case]
    batch = make_paged_batch(
        q_lens, s_lens, num_heads=4, num_kv_heads=2, head_size=16, block_size=4,
        device=triton_device, generator=torch.Generator().manual_seed(case),
    )  # fmt: skip
    ranges = _ranges(batch, spans).to(triton_device)
    args = (
        batch.query, batch.key_cache, batch.value_cache, batch.block_table,
        batch.query_start_loc, batch.seq_lens, batch.query.shape[-1] ** -0.5,
    )  # fmt: skip
    q_max, s_max = batch.max_query_len, batch.max_seq_len
    got = triton_ops.paged_attention_split_kv(
        *args, max_query_len=q_max, max_seq_len=s_max, sliding_window=window,
        bidirectional_ranges=ranges, num_segments=segments,
    )  # fmt: skip
    want = reference.paged_attention(
        *args, max_query_len=q_max, max_seq_len=s_max, sliding_window=window,
        bidirectional_ranges=ranges,
    )  # fmt: skip
    torch.testing.assert_close(got.float(), want.float(), atol=2e-5, rtol=2e-5)
