"""The torch backend's decode fast path, its per-step mask cache and its window-only reads."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged.kernels import reference
from paged.runner.attention import torch_attention


def _check(
    q: torch.Tensor,
    caches: list[torch.Tensor],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    poison: list[tuple[int, int]] | None = None,
) -> None:
    """torch_attention equals the reference; `poison` (row, blocks) NaNs a row's first
    blocks after computing the expected output (blocks the backend must not read)."""
    expected = reference.paged_attention(q, caches[0], caches[1], *args, **kwargs)
    table = args[0]
    for row, num_blocks in poison or []:
        for b in range(num_blocks):
            for cache in caches:
                cache[table[row, b]] = float("nan")
    got = torch_attention.paged_attention(q, caches[0], caches[1], *args, **kwargs)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def _two_request_decode(seed: int) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """q [2, 4, 8], K/V caches of 8 blocks of 4 tokens, a 2 x 3 block table."""
    gen = torch.Generator().manual_seed(seed)
    caches = [torch.randn(8, 4, 2, 8, generator=gen) for _ in range(2)]
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    return torch.randn(2, 4, 8, generator=gen), caches, table


def _decode_kwargs(window: int | None) -> dict[str, Any]:
    return {"max_query_len": 1, "max_seq_len": 12, "sliding_window": window}


def test_decode_mask_reused_only_for_the_same_seq_lens() -> None:
    """The per-step decode mask cache must notice a new or in-place-changed seq_lens."""
    q, caches, table = _two_request_decode(0)
    starts = torch.tensor([0, 1, 2], dtype=torch.int32)
    seq_lens = torch.tensor([9, 5], dtype=torch.int32)
    for new_lens in ([9, 5], [9, 5], [3, 12], [12, 12]):
        seq_lens.copy_(torch.tensor(new_lens))  # same tensor object, new version
        for window in (None, 4):
            _check(q, caches, (table, starts, seq_lens, 8**-0.5), _decode_kwargs(window))


def test_decode_mask_cache_sees_writes_that_bypass_torch() -> None:
    """A seq_lens tensor refilled through numpy keeps its identity and version."""
    q, caches, table = _two_request_decode(1)
    starts = torch.tensor([0, 1, 2], dtype=torch.int32)
    host = np.array([9, 5], dtype=np.int32)
    seq_lens = torch.from_numpy(host)
    for new_lens in ([9, 5], [3, 12], [12, 2]):
        version = seq_lens._version
        host[:] = new_lens
        assert seq_lens._version == version
        for window in (None, 4):
            _check(q, caches, (table, starts, seq_lens, 8**-0.5), _decode_kwargs(window))


def _random_batch(
    reqs: list[tuple[int, int]], block_size: int, seed: int
) -> tuple[torch.Tensor, list[torch.Tensor], tuple[Any, ...]]:
    """(seq_len, q_len) per request -> q, caches, (table, starts, seq_lens, scale)."""
    gen = torch.Generator().manual_seed(seed)
    lens = [n for n, _ in reqs]
    q_lens = [q for _, q in reqs]
    width = -(-max(lens) // block_size)
    num_blocks = len(lens) * width + 1
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    table = perm[: len(lens) * width].view(len(lens), width).to(torch.int32)
    caches = [torch.randn(num_blocks, block_size, 2, 8, generator=gen) for _ in range(2)]
    q = torch.randn(sum(q_lens), 4, 8, generator=gen)
    starts = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32)
    return q, caches, (table, starts, torch.tensor(lens, dtype=torch.int32), 8**-0.5)


def _blocks_before_window(
    reqs: list[tuple[int, int]], window: int, block_size: int
) -> list[tuple[int, int]]:
    """(row, n): the first n blocks of each row lie wholly before its first query's window."""
    return [(r, max(0, n - q - window + 1) // block_size) for r, (n, q) in enumerate(reqs)]


@settings(max_examples=30, deadline=None)
@given(
    lens=st.lists(st.integers(1, 60), min_size=1, max_size=5),
    window=st.integers(1, 20),
    block_size=st.sampled_from([1, 4, 8]),
    seed=st.integers(0, 2**16),
)
def test_windowed_decode_gathers_only_the_window(
    lens: list[int], window: int, block_size: int, seed: int
) -> None:
    """Decode with a window shorter than the context equals the reference, even when
    the blocks before each window hold garbage (freed and reused by other requests)."""
    reqs = [(n, 1) for n in lens]
    q, caches, args = _random_batch(reqs, block_size, seed)
    kwargs = {"max_query_len": 1, "max_seq_len": max(lens), "sliding_window": window}
    _check(q, caches, args, kwargs, _blocks_before_window(reqs, window, block_size))


@settings(max_examples=30, deadline=None)
@given(
    reqs=st.lists(
        st.tuples(st.integers(1, 60), st.integers(1, 6)).map(lambda t: (t[0], min(t[0], t[1]))),
        min_size=1,
        max_size=5,
    ),
    window=st.integers(1, 20),
    block_size=st.sampled_from([1, 4, 8]),
    seed=st.integers(0, 2**16),
)
def test_windowed_mixed_batch_skips_blocks_before_the_window(
    reqs: list[tuple[int, int]], window: int, block_size: int, seed: int
) -> None:
    """Prefill chunks and decodes together: blocks wholly before a request's first
    query's window are never read (poisoned with NaN here), results equal the reference."""
    q, caches, args = _random_batch(reqs, block_size, seed)
    kwargs = {
        "max_query_len": max(q for _, q in reqs),
        "max_seq_len": max(n for n, _ in reqs),
        "sliding_window": window,
    }
    _check(q, caches, args, kwargs, _blocks_before_window(reqs, window, block_size))
