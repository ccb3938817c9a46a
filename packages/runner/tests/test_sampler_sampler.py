"""Sampler: greedy, temperature, top-k/p, min-p, seeds, penalties, bias, min-tokens, logprobs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from paged.kernels.ops import apply_top_k_top_p
from paged.runner.input_batch import CachedRequestState, InputBatch
from paged.runner.sampler import Sampler, SamplingMetadata
from paged.runner.sampler.build import build_sampling_metadata
from paged.runner.sampler.sampler import count_nans
from paged.scheduler.sampling_params import SamplingParams

VOCAB = 16
EOS = 2


def state(
    i: int, prompt: list[int] | None = None, output: list[int] | None = None, **sp: object
) -> CachedRequestState:
    params = SamplingParams(**sp)  # type: ignore[arg-type]
    gen = None if params.seed is None else torch.Generator().manual_seed(params.seed)
    prompt = prompt if prompt is not None else [3, 4, 5]
    return CachedRequestState(
        f"r{i}", prompt, params, ([0, 1],), len(prompt), list(output or []), gen
    )


def batch_of(*states: CachedRequestState) -> InputBatch:
    b = InputBatch(8, 64, 64, "cpu", VOCAB, block_sizes=[16], eos_token_ids=[EOS])
    for s in states:
        b.add_request(s)
    return b


def sample(b: InputBatch, logits: torch.Tensor) -> torch.Tensor:
    meta = build_sampling_metadata(b, np.arange(b.num_reqs))
    return Sampler()(logits, meta).sampled_token_ids


def test_greedy_is_argmax_and_nans_counted() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    logits[1, :4] = float("nan")
    b = batch_of(*(state(i, temperature=0.0) for i in range(3)))
    out = Sampler()(logits, build_sampling_metadata(b, np.arange(3)))
    assert out.sampled_token_ids[[0, 2]].tolist() == logits[[0, 2]].argmax(-1).tolist()
    assert out.num_nans.tolist() == [0, 4, 0]


def test_nan_count_is_exact_with_infinities() -> None:
    # +inf and -inf in one row sum to NaN without any NaN logit; a row with
    # both and a NaN counts just the NaN.
    logits = torch.zeros(4, VOCAB)
    logits[0, 0], logits[0, 1] = float("inf"), float("-inf")
    logits[1, 0], logits[1, 1], logits[1, 2] = float("inf"), float("-inf"), float("nan")
    logits[3, 5:8] = float("nan")
    assert count_nans(logits).tolist() == [0, 1, 0, 3]
    assert count_nans(torch.zeros(0, VOCAB)).tolist() == []


def test_temperature_distribution_matches_softmax() -> None:
    n = 4000
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0] + [-30.0] * (VOCAB - 4)]).repeat(n, 1)
    meta = SamplingMetadata(
        num_rows=n, temperature=torch.full((n,), 0.5), all_greedy=False, all_random=True
    )
    torch.manual_seed(1)
    counts = torch.bincount(Sampler()(logits, meta).sampled_token_ids, minlength=VOCAB).float()
    expected = (logits[0] / 0.5).softmax(-1) * n
    # Chi-square over the 4 live tokens, 3 dof: 99.9% quantile is 16.3.
    chi2 = float((((counts[:4] - expected[:4]) ** 2) / expected[:4]).sum())
    assert chi2 < 16.3
    assert counts[4:].sum() == 0


def test_top_k_top_p_min_p_restrict_support() -> None:
    torch.manual_seed(2)
    logits = torch.randn(1, VOCAB).repeat(3, 1)
    probs = logits[0].softmax(-1)
    order = probs.argsort(descending=True)
    b = batch_of(state(0, top_k=3), state(1, top_p=0.6), state(2, min_p=0.5))
    seen: list[set[int]] = [set(), set(), set()]
    for _ in range(300):
        for row, tok in enumerate(sample(b, logits.clone()).tolist()):
            seen[row].add(tok)
    assert seen[0] <= set(order[:3].tolist())
    cum = probs[order].cumsum(0)
    nucleus = int((cum < 0.6).sum()) + 1  # smallest prefix with mass >= 0.6
    assert seen[1] <= set(order[:nucleus].tolist())
    assert seen[1] == set(order[:nucleus].tolist())  # 300 draws hit every nucleus token
    allowed = set(torch.nonzero(probs >= 0.5 * probs.max()).flatten().tolist())
    assert seen[2] <= allowed


def test_top_p_kept_mass() -> None:
    torch.manual_seed(3)
    logits = torch.randn(64, VOCAB)
    top_p = torch.rand(64) * 0.9 + 0.05
    masked = apply_top_k_top_p(logits.clone(), None, top_p)
    probs = logits.softmax(-1)
    kept = torch.isfinite(masked)
    mass = (probs * kept).sum(-1)
    assert bool((mass >= top_p - 1e-6).all())
    # Minimal: removing the least likely kept token drops below p.
    least = torch.where(kept, probs, torch.full_like(probs, 2.0)).amin(-1)
    assert bool((mass - least < top_p + 1e-6).all())


def test_seeded_rows_reproducible_across_batch_composition() -> None:
    torch.manual_seed(4)
    logits = torch.randn(5, VOCAB)

    def run(states: list[CachedRequestState], row: int, steps: int = 6) -> list[int]:
        b = batch_of(*states)
        return [
            int(
                sample(b, logits[: b.num_reqs].clone() if b.num_reqs > 1 else logits[[0]].clone())[
                    row
                ]
            )
            for _ in range(steps)
        ]

    alone = run([state(0, seed=42)], 0)
    # Same logits row for the seeded request, other rows random and unseeded.
    torch.manual_seed(5)
    logits2 = torch.randn(5, VOCAB)
    logits2[3] = logits[0]
    b = batch_of(*(state(i, seed=42 if i == 3 else None) for i in range(5)))
    mixed = [int(sample(b, logits2.clone())[3]) for _ in range(6)]
    assert alone == mixed
    assert len(set(alone)) > 1  # it really samples


def test_penalties_match_naive_reference() -> None:
    torch.manual_seed(6)
    logits = torch.randn(2, VOCAB)
    s0 = state(
        0,
        prompt=[1, 3],
        output=[3, 5, 5],
        temperature=0.0,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=1.5,
    )
    s1 = state(1, prompt=[7], output=[], temperature=0.0)
    b = batch_of(s0, s1)
    meta = build_sampling_metadata(b, np.arange(2))
    from paged.kernels.ops import apply_penalties

    assert meta.prompt_mask is not None and meta.output_counts is not None
    assert meta.presence_penalties is not None and meta.frequency_penalties is not None
    assert meta.repetition_penalties is not None
    got = apply_penalties(
        logits.clone(),
        meta.prompt_mask,
        meta.output_counts,
        meta.presence_penalties,
        meta.frequency_penalties,
        meta.repetition_penalties,
    )
    want = logits.clone()
    for tok in {1, 3, 5}:
        v = want[0, tok]
        want[0, tok] = v / 1.5 if v > 0 else v * 1.5
    for tok, count in {3: 1, 5: 2}.items():
        want[0, tok] -= 0.25 * count + 0.5
    assert torch.allclose(got, want, atol=1e-6), (got, want)


def test_logit_bias_and_min_tokens() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, EOS] = 10.0
    b = batch_of(
        state(0, temperature=0.0, logit_bias={9: 20.0}),
        state(1, temperature=0.0, min_tokens=2, output=[4], stop_token_ids=[11]),
    )
    logits[1, 11] = 9.0
    assert sample(b, logits.clone()).tolist()[0] == 9
    tok = sample(b, logits.clone()).tolist()[1]
    assert tok not in (EOS, 11)
    b.append_token_ids(1, [tok])  # now 2 outputs: the stop ids are allowed again
    assert sample(b, logits.clone()).tolist()[1] == EOS


def test_logprobs_are_raw_with_rank() -> None:
    torch.manual_seed(7)
    logits = torch.randn(2, VOCAB)
    b = batch_of(
        state(0, temperature=0.0, logprobs=3, presence_penalty=1.0, output=[0]),
        state(1, temperature=1.0, logprobs=1),
    )
    out = Sampler()(logits.clone(), build_sampling_metadata(b, np.arange(2)))
    assert out.logprobs is not None
    lp = logits.log_softmax(-1)
    assert out.logprobs.token_ids.shape == (2, 4)
    for row in range(2):
        tok = int(out.sampled_token_ids[row])
        assert out.logprobs.token_ids[row, 0] == tok
        assert out.logprobs.logprobs[row, 0].item() == pytest.approx(lp[row, tok].item())
        assert int(out.logprobs.ranks[row]) == int((lp[row] >= lp[row, tok]).sum())
        top = lp[row].topk(3)
        assert out.logprobs.token_ids[row, 1:].tolist() == top.indices.tolist()
        assert math.isclose(
            float(out.logprobs.logprobs[row, 1]), float(top.values[0]), rel_tol=1e-6
        )


def test_bad_logits_shape() -> None:
    b = batch_of(state(0))
    with pytest.raises(ValueError, match="logits must be"):
        Sampler()(torch.zeros(2, VOCAB), build_sampling_metadata(b, np.array([0])))


def test_sampler_does_not_mutate_logits() -> None:
    torch.manual_seed(8)
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    b = batch_of(
        state(0, temperature=0.7, top_k=4, top_p=0.8, output=[1, 1]),
        state(1, temperature=0.0, repetition_penalty=1.3, logit_bias={3: 2.0}),
        state(2, temperature=1.0, min_p=0.1, min_tokens=3),
    )
    Sampler()(logits, build_sampling_metadata(b, np.arange(3)))
    assert torch.equal(logits, before)
