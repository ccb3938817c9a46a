"""The torch backend's pure-decode fast path and its per-step mask cache."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from paged.kernels import reference
from paged.runner.attention import torch_attention


def test_decode_mask_reused_only_for_the_same_seq_lens() -> None:
    """The per-step decode mask cache must notice a new or in-place-changed seq_lens."""
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(8, 4, 2, 8, generator=gen) for _ in range(2)]
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    starts = torch.tensor([0, 1, 2], dtype=torch.int32)
    q = torch.randn(2, 4, 8, generator=gen)
    seq_lens = torch.tensor([9, 5], dtype=torch.int32)
    for new_lens in ([9, 5], [9, 5], [3, 12], [12, 12]):
        seq_lens.copy_(torch.tensor(new_lens))  # same tensor object, new version
        for window in (None, 4):
            args = (table, starts, seq_lens, 8**-0.5)
            kwargs: dict[str, Any] = {"max_query_len": 1, "max_seq_len": 12}
            kwargs["sliding_window"] = window
            expected = reference.paged_attention(q, caches[0], caches[1], *args, **kwargs)
            got = torch_attention.paged_attention(q, caches[0], caches[1], *args, **kwargs)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_decode_mask_cache_sees_writes_that_bypass_torch() -> None:
    """A seq_lens tensor refilled through numpy keeps its identity and version."""
    gen = torch.Generator().manual_seed(1)
    caches = [torch.randn(8, 4, 2, 8, generator=gen) for _ in range(2)]
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    starts = torch.tensor([0, 1, 2], dtype=torch.int32)
    q = torch.randn(2, 4, 8, generator=gen)
    host = np.array([9, 5], dtype=np.int32)
    seq_lens = torch.from_numpy(host)
    for new_lens in ([9, 5], [3, 12], [12, 2]):
        version = seq_lens._version
        host[:] = new_lens
        assert seq_lens._version == version
        for window in (None, 4):
            args = (table, starts, seq_lens, 8**-0.5)
            kwargs: dict[str, Any] = {"max_query_len": 1, "max_seq_len": 12}
            kwargs["sliding_window"] = window
            expected = reference.paged_attention(q, caches[0], caches[1], *args, **kwargs)
            got = torch_attention.paged_attention(q, caches[0], caches[1], *args, **kwargs)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
