"""The offline replay of speculation (spec_decode/replay.py): costs by hand, invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged.runner.spec_decode.ngram import NgramProposer
from paged.runner.spec_decode.policy import AcceptanceHistory, RowCostModel, plan_request_drafts
from paged.runner.spec_decode.replay import (
    REPLAY_POLICIES,
    ReplaySequence,
    ceiling_report,
    full_batch_ceiling,
    observed_ceiling,
    replay,
    scaled_curve,
)

FLAT = RowCostModel(((1, 1.0),))  # every step costs one row: speedup = plain steps / steps
CURVE = RowCostModel(((1, 1.0), (8, 2.0), (64, 8.0)))


def test_full_batch_ceiling_by_hand() -> None:
    # 8 streams x (7 + 1) rows = 64 rows: 8 tokens a request for 8.0 against 2.0 a token.
    assert full_batch_ceiling(CURVE, 8, 7) == pytest.approx(8 * 2.0 / 8.0)
    assert full_batch_ceiling(CURVE, 8, 0) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="streams"):
        full_batch_ceiling(CURVE, 0, 3)


def test_observed_ceiling_uses_the_mean_accepted_length() -> None:
    # 4 drafts of 2 tokens: 4 and 2 accepted at positions 0 and 1 -> 2.5 tokens a step.
    expected = 2.5 * CURVE.cost(1) / CURVE.cost(3)
    assert observed_ceiling(CURVE, 1, [4, 2], 4) == pytest.approx(expected)
    with pytest.raises(ValueError, match="num_drafts"):
        observed_ceiling(CURVE, 1, [0, 0], 0)


def test_fixed_replay_of_a_copy_by_hand() -> None:
    # The output copies the prompt. Prefill gives output[0] = 1; the 1-gram "1" matched at
    # the prompt's start drafts 2 3 4 (all accepted) + bonus 5; then "5" drafts 6 7 (capped
    # by max_tokens: 8 - 5 known - 1), accepted + bonus 8: 2 steps against 7 plain steps.
    seq = ReplaySequence((1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 5, 6, 7, 8), max_tokens=8)
    r = replay([seq], FLAT, NgramProposer(1, 1), k=3, policy="fixed")
    assert (r.plain_cost, r.spec_cost, r.steps) == (7.0, 2.0, 2)
    assert r.speedup == pytest.approx(3.5)
    assert (r.num_drafts, r.num_draft_tokens, r.num_accepted_tokens) == (2, 5, 5)
    assert r.accepted_per_pos == (2, 2, 1)
    assert r.mean_accepted_length == pytest.approx(3.5)


def test_rejected_drafts_cost_rows_and_yield_only_the_bonus() -> None:
    # "5" drafts the prompt's 6 7, the output says 8; no later token recurs: one rejected draft.
    seq = ReplaySequence((5, 6, 7), (5, 8, 9, 4), max_tokens=16)
    fixed = replay([seq], CURVE, NgramProposer(1, 1), k=2, policy="fixed")
    assert fixed.num_accepted_tokens == 0
    assert fixed.steps == 3  # one token a step, as plain
    assert fixed.spec_cost > fixed.plain_cost
    oracle = replay([seq], CURVE, NgramProposer(1, 1), k=2, policy="oracle")
    assert oracle.num_drafts == 0 and oracle.speedup == pytest.approx(1.0)


@st.composite
def batches(draw: st.DrawFn) -> list[ReplaySequence]:
    """Short sequences over a tiny vocabulary, so n-grams recur and drafts get accepted."""
    out: list[ReplaySequence] = []
    for _ in range(draw(st.integers(1, 4))):
        prompt = draw(st.lists(st.integers(0, 3), min_size=1, max_size=12))
        output = draw(st.lists(st.integers(0, 3), min_size=1, max_size=20))
        extra = draw(st.integers(0, 3))
        out.append(ReplaySequence(tuple(prompt), tuple(output), len(output) + extra))
    return out


@settings(max_examples=60, deadline=None)
@given(batches(), st.integers(1, 4), st.integers(1, 3))
def test_replay_invariants(seqs: list[ReplaySequence], k: int, n: int) -> None:
    proposer = NgramProposer(1, n)
    plain_steps = max(len(s.output) for s in seqs) - 1
    flat = {p: replay(seqs, FLAT, proposer, k, p) for p in REPLAY_POLICIES}
    for r in flat.values():
        assert r.plain_cost == plain_steps
        assert r.steps <= plain_steps
        assert r.num_accepted_tokens <= r.num_draft_tokens
        assert list(r.accepted_per_pos) == sorted(r.accepted_per_pos, reverse=True)
        assert sum(r.accepted_per_pos) == r.num_accepted_tokens
    # On a flat curve nothing beats drafting k, all accepted; and the oracle takes every
    # accepted draft that saves a step, so it advances exactly as `fixed` does.
    assert all(flat["perfect"].steps <= r.steps for r in flat.values())
    assert flat["oracle"].steps == flat["fixed"].steps
    # On a rising curve the oracle's drafts are all accepted, and it is never below plain.
    oracle = replay(seqs, CURVE, proposer, k, "oracle")
    assert oracle.num_accepted_tokens == oracle.num_draft_tokens
    assert oracle.speedup >= 1.0 - 1e-9


def test_scaled_curves() -> None:
    marginal = scaled_curve(CURVE, 2.0, "marginal")
    assert marginal.points == ((1, 1.0), (8, 1.5), (64, 4.5))
    many = scaled_curve(RowCostModel(((1, 1.0), (8, 2.0), (16, 3.0), (64, 8.0))), 2.0, "many")
    assert many.points == ((1, 1.0), (8, 2.0), (16, 2.0), (64, 4.0))  # 16 rows floored at 8's
    with pytest.raises(ValueError, match="factor"):
        scaled_curve(CURVE, 0.0, "marginal")


def test_replay_rejects_bad_arguments() -> None:
    seq = ReplaySequence((1, 2), (1, 2), max_tokens=4)
    with pytest.raises(ValueError, match="k"):
        replay([seq], CURVE, NgramProposer(1, 1), 0, "fixed")
    with pytest.raises(ValueError, match="policy"):
        replay([seq], CURVE, NgramProposer(1, 1), 2, "best")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sequences"):
        replay([], CURVE, NgramProposer(1, 1), 2, "fixed")
    with pytest.raises(ValueError, match="max_tokens"):
        ReplaySequence((1,), (1, 2, 3), max_tokens=2)
    with pytest.raises(ValueError, match="prompt"):
        ReplaySequence((), (1,), max_tokens=2)


def test_ceiling_report_is_json_ready() -> None:
    seq = ReplaySequence((1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 5, 6, 7, 8), max_tokens=8)
    report = ceiling_report(CURVE, [seq, seq], NgramProposer(1, 1), 3)
    assert set(report["replay"]) == set(REPLAY_POLICIES)
    assert report["all_accepted_full_batch"]["1"] == round(full_batch_ceiling(CURVE, 2, 1), 3)


def test_plan_request_drafts_plans_alone_requests_on_their_own() -> None:
    # A request planned alone gets what a one-request batch would give it, whoever else drafts.
    history = AcceptanceHistory()
    history.record(4, 4)
    alone = plan_request_drafts(
        3, [5, 5, 5], [4, 4, 4], [history, None, None], [True, False, False], CURVE
    )
    solo = plan_request_drafts(1, [5], [4], [history], [False], CURVE)
    assert alone[0] == solo[0]
    with pytest.raises(ValueError, match="match_len"):
        plan_request_drafts(1, [5], [4, 4], [None], [False], CURVE)
