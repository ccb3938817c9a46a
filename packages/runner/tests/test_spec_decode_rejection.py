"""The rejection sampler keeps the target distribution (fixed-seed statistical tests).

On a toy vocabulary, many independent requests each verify drafted tokens
against the same target logits. The first emitted token of every request
must follow the target distribution p0 (processed: temperature, top-k), and
the second (present when the first draft was accepted) p1, whatever the
proposer's distribution q, within a total-variation bound far above the
sampling noise of 40k samples (~0.01) and far below any real bias (a sampler
that always accepted a q-draft would be off by TV(p, q) ~ 0.3 here).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paged.runner.sampler.metadata import SamplingMetadata
from paged.runner.spec_decode.rejection_sampler import rejection_sample, row_argmax

V = 6
N = 40_000
TV_BOUND = 0.02


def _meta(n: int, temperature: float, top_k: int | None = None) -> SamplingMetadata:
    return SamplingMetadata(
        num_rows=n,
        temperature=torch.full((n,), temperature),
        all_greedy=False,
        all_random=True,
        top_k=torch.full((n,), top_k, dtype=torch.int32) if top_k is not None else None,
    )


def _tv(samples: np.ndarray, p: torch.Tensor) -> float:
    counts = np.bincount(samples, minlength=V) / len(samples)
    return 0.5 * float(np.abs(counts - p.numpy()).sum())


def _target(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, V, generator=g) * 1.5  # logits of positions 0 and 1


@pytest.mark.parametrize("with_q", [True, False])
@pytest.mark.parametrize(("temperature", "top_k"), [(1.0, None), (0.7, 4)])
def test_output_distribution_equals_target(
    with_q: bool, temperature: float, top_k: int | None
) -> None:
    torch.manual_seed(0)
    logits2 = _target(1)
    scaled = logits2 / temperature
    if top_k is not None:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    p = scaled.softmax(dim=-1)
    # One draft per request: drafted from q (random proposer) or always token 0
    # (a deterministic proposer, q one-hot).
    g = torch.Generator().manual_seed(2)
    q = torch.softmax(torch.randn(V, generator=g) * 2.0, dim=-1)
    if with_q:
        drafts = torch.multinomial(q, N, replacement=True, generator=g)
        draft_probs = q.expand(N, V).contiguous()
    else:
        drafts = torch.zeros(N, dtype=torch.int64)
        draft_probs = None
    logits = logits2.repeat(N, 1)  # request i: rows 2i (position 0), 2i+1 (bonus)
    out = rejection_sample(
        logits,
        np.ones(N, dtype=np.int64),
        [[int(d)] for d in drafts],
        _meta(N, temperature, top_k),
        draft_probs,
    )
    first = np.array([t[0] for t in out.token_ids])
    assert _tv(first, p[0]) < TV_BOUND
    second = np.array([t[1] for t in out.token_ids if len(t) == 2])
    assert len(second) > N // 10
    assert _tv(second, p[1]) < TV_BOUND
    # The acceptance rate is sum_x min(p, q) (one-hot q: p(0)).
    expected = float(torch.minimum(p[0], q).sum()) if with_q else float(p[0, 0])
    assert abs(np.mean(out.num_accepted) - expected) < 0.02


def test_greedy_accepts_while_equal_then_takes_the_argmax() -> None:
    logits = torch.tensor(
        [[0.0, 5.0, 1.0], [4.0, 0.0, 1.0], [0.0, 0.0, 9.0], [1.0, 2.0, 0.0]]
    )  # argmax per position: 1, 0, 2, 1
    meta = SamplingMetadata(num_rows=2, temperature=None, all_greedy=True, all_random=False)
    # Request 0 drafts [1, 0] (both right) -> bonus argmax 2. Request 1 drafts nothing.
    out = rejection_sample(logits, np.array([2, 0]), [[1, 0], []], meta)
    assert out.token_ids == [[1, 0, 2], [1]]
    assert out.num_accepted == [2, 0]
    out = rejection_sample(logits[:3], np.array([2]), [[1, 2]], _greedy(1))
    assert out.token_ids == [[1, 0]]  # second draft wrong: the target's token replaces it


def _greedy(n: int) -> SamplingMetadata:
    return SamplingMetadata(num_rows=n, temperature=None, all_greedy=True, all_random=False)


def test_seeded_requests_do_not_depend_on_the_batch() -> None:
    logits = _target(3).repeat(3, 1)
    gens = {i: torch.Generator().manual_seed(99) for i in range(3)}
    meta = _meta(3, 1.0)
    meta.generators = gens
    batch = rejection_sample(logits, np.ones(3, dtype=np.int64), [[1], [1], [1]], meta)
    alone_meta = _meta(1, 1.0)
    alone_meta.generators = {0: torch.Generator().manual_seed(99)}
    alone = rejection_sample(logits[:2], np.ones(1, dtype=np.int64), [[1]], alone_meta)
    assert batch.token_ids == [alone.token_ids[0]] * 3


def test_grammar_rows_mask_each_drafted_position() -> None:
    """Row n of a request masks its n-th position; a forbidden draft is rejected."""
    from paged.runner.spec_decode.decoder import apply_grammar_rows
    from paged.scheduler.boundary import GrammarOutput

    logits = torch.zeros(4, 8)
    logits[:, 7] = 5.0  # unconstrained, every position would pick 7
    grammar = GrammarOutput(
        structured_output_request_ids=["a", "a", "a"],
        grammar_bitmask=[[1 << 3], [1 << 4], [1 << 5]],  # position 0: {3}, 1: {4}, 2: {5}
    )
    masked = apply_grammar_rows(logits.clone(), ["a", "a", "a", "b"], grammar)
    assert masked[:3].argmax(dim=-1).tolist() == [3, 4, 5]
    assert masked[3].argmax().item() == 7  # "b" has no grammar
    # Drafts [3, 6]: 3 is allowed and accepted, 6 is forbidden at position 1 -> 4 instead.
    out = rejection_sample(masked[:3], np.array([2]), [[3, 6]], _greedy(1))
    assert out.token_ids == [[3, 4]]
    rand = rejection_sample(masked[:3], np.array([2]), [[3, 6]], _meta(1, 1.0))
    assert rand.token_ids == [[3, 4]]  # the only allowed tokens, whatever the draws


def test_row_argmax_matches_torch_on_ties_and_nans() -> None:
    x = torch.randn(64, 1000)
    x[3, 10] = x[3, 500] = 50.0  # a tie: the first index wins
    x[5, 7] = float("nan")
    x[6] = float("-inf")
    x[7, 20:30] = float("inf")
    strided = torch.randn(1000, 64).t()  # not contiguous
    for t in (x, strided, x.to(torch.bfloat16).float()):
        assert torch.equal(row_argmax(t), t.argmax(dim=-1))
    assert row_argmax(x)[3] == 10 and row_argmax(x)[5] == 7
