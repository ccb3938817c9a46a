"""The cost-aware drafting policy's decisions, as pure functions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged.runner.attention.backends import select_attention_backend
from paged.runner.spec_decode.config import parse_speculative_config
from paged.runner.spec_decode.decoder import SpecDecoder
from paged.runner.spec_decode.ngram import NgramProposer
from paged.runner.spec_decode.policy import (
    AcceptanceHistory,
    RowCostModel,
    estimate_acceptance,
    expected_speedup,
    match_prior,
    plan_drafts,
)

CPU = RowCostModel.for_device("cpu")


# torch's int4 kernel (the fallback when paged's C kernel does not load).
CPU_QUANTIZED = RowCostModel.for_path("cpu", quantized=True, c_kernel=False)
CPU_QGEMM = RowCostModel.for_path("cpu", quantized=True, c_kernel=True)


def test_cpu_cost_curve_has_a_step_then_a_plateau_then_grows_linearly() -> None:
    assert CPU.cost(1) == 1.0
    assert CPU.cost(2) == pytest.approx(1.68)
    assert CPU.cost(8) == pytest.approx(1.9)
    assert CPU.cost(64) == pytest.approx(5.65)
    # Past the last point the last segment's slope continues.
    assert CPU.cost(96) == pytest.approx(5.65 + 32 * (5.65 - 3.83) / 32)


def test_curve_interpolates_between_points() -> None:
    curve = RowCostModel(((1, 1.0), (4, 2.0), (8, 4.0)))
    assert curve.cost(0) == 1.0
    assert curve.cost(2) == pytest.approx(1 + 1 / 3)
    assert curve.cost(6) == pytest.approx(3.0)
    assert curve.cost(10) == pytest.approx(5.0)
    assert RowCostModel(((1, 1.0),)).cost(64) == 1.0


def test_quantized_cpu_curve_is_its_own_and_makes_wide_steps_pay_less() -> None:
    assert CPU_QUANTIZED != CPU and CPU_QGEMM != CPU_QUANTIZED
    # Costs are in one-row steps of each path. The C path's one-row step is the cheapest
    # (fused layers), so its wide steps cost the most of them; its verification rows share
    # one attention call across requests, so it charges nothing per drafting request.
    assert CPU_QGEMM.cost(64) > CPU_QUANTIZED.cost(64) > CPU.cost(64)
    assert CPU_QGEMM.request_cost == 0.0 < CPU_QUANTIZED.request_cost
    # One stream at 0.8: 4 drafts (3.4 tokens for 5 rows, cost 1.6) beat 7 (4.2 for 2.1).
    assert plan_drafts(1, [0.8], [7], CPU_QUANTIZED) == [4]
    assert expected_speedup(1, [4], [0.8], CPU_QUANTIZED) > expected_speedup(
        1, [7], [0.8], CPU_QUANTIZED
    )
    # 8 streams: every row costs about as much as a token, so only near-certain drafts go.
    assert sum(plan_drafts(8, [0.6] * 8, [7] * 8, CPU_QUANTIZED)) < sum(
        plan_drafts(8, [0.6] * 8, [7] * 8, CPU)
    )


def test_row_costs_config_key_replaces_the_curve() -> None:
    cfg = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 4, "row_costs": [[1, 1], [8, 1.5]]}'
    )
    assert cfg.row_costs == ((1, 1.0), (8, 1.5))
    for bad, match in (
        ("[[2, 1.0]]", "must start with"),
        ("[[1, 1.0], [1, 2.0]]", "rows must increase"),
        ("[[1, 1.0], [4, 0.5]]", "cost must not fall"),
        ("[[1, 1.0], [4]]", "each entry"),
        ('"fast"', "must be a list of"),
    ):
        with pytest.raises(ValueError, match=f"speculative_config.row_costs: {match}"):
            parse_speculative_config(
                f'{{"method": "ngram", "num_speculative_tokens": 4, "row_costs": {bad}}}'
            )


def test_single_stream_drafts_only_when_the_step_is_paid_for() -> None:
    # One row: any draft costs 0.9 of a forward; 7 drafts at 0.8 are worth 3.2 tokens.
    assert plan_drafts(1, [0.8], [7], CPU) == [7]
    # At 0.3 per position the drafts are worth 0.43 tokens: less than the step.
    assert plan_drafts(1, [0.3], [7], CPU) == [0]


def test_longer_drafts_are_cut_where_their_value_no_longer_pays() -> None:
    # 8 streams: the step is paid already; past 8 rows each row costs 0.07 of a
    # forward, worth it while a**i > ~0.07 * throughput (~0.3 at first).
    plan = plan_drafts(8, [0.6] * 8, [7] * 8, CPU)
    assert 8 <= sum(plan) < 56
    assert all(1 <= k <= 3 for k in plan)
    # Fully repeating text: drafts are worth nearly a token each, all kept.
    assert plan_drafts(8, [0.99] * 8, [7] * 8, CPU) == [7] * 8
    assert plan_drafts(1, [0.99], [7], CPU) == [7]


def test_better_requests_get_more_drafts() -> None:
    plan = plan_drafts(4, [0.95, 0.5, 0.0, 0.8], [7, 7, 7, 7], CPU)
    assert plan[2] == 0
    assert plan[0] >= plan[3] >= plan[1]


def test_caps_are_respected_and_disable_by_batch_size_overrides() -> None:
    assert plan_drafts(2, [0.99, 0.99], [3, 0], CPU) == [3, 0]
    assert plan_drafts(2, [0.99, 0.99], [3, 3], CPU, disable_by_batch_size=2) == [0, 0]
    assert plan_drafts(2, [0.99, 0.99], [3, 3], CPU, disable_by_batch_size=3) == [3, 3]


def test_plan_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="acceptance"):
        plan_drafts(1, [0.5], [1, 2], CPU)
    with pytest.raises(ValueError, match="base_rows"):
        plan_drafts(0, [], [], CPU)
    with pytest.raises(ValueError, match="row_costs"):
        RowCostModel(((1, 0.5), (4, 1.0)))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0.0, 0.99), st.integers(0, 8)),
        min_size=1,
        max_size=12,
    ),
    st.integers(0, 8),
)
def test_plan_is_never_worse_than_plain_or_than_drafting_everything(
    requests: list[tuple[float, int]], extra_rows: int
) -> None:
    acceptance = [a for a, _ in requests]
    caps = [c for _, c in requests]
    base = len(requests) + extra_rows
    plan = plan_drafts(base, acceptance, caps, CPU)
    assert all(0 <= k <= c for k, c in zip(plan, caps, strict=True))
    mine = expected_speedup(base, plan, acceptance, CPU)
    assert mine >= 1.0 - 1e-9
    assert mine >= expected_speedup(base, caps, acceptance, CPU) - 1e-9


def test_acceptance_estimate_follows_match_length_and_history() -> None:
    assert estimate_acceptance(0, None) == 0.0
    assert match_prior(5) > match_prior(3) > match_prior(1)
    good = AcceptanceHistory()
    bad = AcceptanceHistory()
    for _ in range(5):
        good.record(7, 7)
        bad.record(7, 0)
    assert good.full_streak == 5 and bad.full_streak == 0
    assert estimate_acceptance(3, good) > match_prior(3) > estimate_acceptance(3, bad)
    assert estimate_acceptance(3, bad) < 0.3
    # One stream: the prior pays for the step, the failing history does not.
    assert plan_drafts(1, [estimate_acceptance(3, None)], [7], CPU) == [7]
    assert plan_drafts(1, [estimate_acceptance(3, bad)], [7], CPU) == [0]
    # 8 streams, where rows past the plateau cost something: a history of full
    # acceptance buys drafts that the bare prior does not, a longer match too.
    k_prior = plan_drafts(8, [estimate_acceptance(3, None)] * 8, [7] * 8, CPU)
    k_good = plan_drafts(8, [estimate_acceptance(3, good)] * 8, [7] * 8, CPU)
    k_short = plan_drafts(8, [estimate_acceptance(1, None)] * 8, [7] * 8, CPU)
    assert sum(k_short) < sum(k_prior) < sum(k_good) == 56


def test_history_counts_the_first_rejected_position_as_tried() -> None:
    h = AcceptanceHistory()
    h.record(7, 2)
    assert (h.accepted, h.tried) == (2, 3)
    h.record(0, 0)  # no drafts: nothing learned
    assert (h.accepted, h.tried) == (2, 3)


def test_ngram_reports_the_winning_match_length() -> None:
    proposer = NgramProposer(1, 3)
    rows = np.array([[1, 2, 3, 9, 1, 2, 3], [5, 6, 7, 8, 4, 4, 4]])
    drafts, match_len = proposer.propose_with_match_len(rows, np.array([7, 5]), np.array([4, 4]))
    assert drafts == [[9, 1, 2, 3], []]
    assert match_len == [3, 0]


def test_config_keys_parse_and_validate() -> None:
    cfg = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 8,'
        ' "draft_policy": "fixed"}'
    )
    assert cfg.disable_by_batch_size == 8 and cfg.draft_policy == "fixed"
    assert (
        parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4}').draft_policy
        == "cost"
    )
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        parse_speculative_config(
            '{"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 0}'
        )
    with pytest.raises(ValueError, match="draft_policy"):
        parse_speculative_config(
            '{"method": "ngram", "num_speculative_tokens": 4, "draft_policy": "fast"}'
        )


def _reference_plan(
    base_rows: int, acceptance: list[float], caps: list[int], cost: RowCostModel
) -> list[int]:
    """The policy in plain Python: sorted candidates, every prefix priced one by one."""
    candidates: list[tuple[float, int]] = []
    for r, (a, cap) in enumerate(zip(acceptance, caps, strict=True)):
        value = 1.0
        for _ in range(max(cap, 0)):
            value *= a
            if value <= 0.0:
                break
            candidates.append((value, r))
    candidates.sort(key=lambda c: -c[0])
    best, best_count, gained = base_rows / cost.cost(base_rows), 0, 0.0
    seen: set[int] = set()
    for count, (value, r) in enumerate(candidates, start=1):
        gained += value
        seen.add(r)
        step = cost.cost(base_rows + count) + cost.request_cost * len(seen)
        throughput = (base_rows + gained) / step
        if throughput > best * (1 + 1e-9):
            best, best_count = throughput, count
    plan = [0] * len(acceptance)
    for _, r in candidates[:best_count]:
        plan[r] += 1
    return plan


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0.0, 0.99), st.integers(0, 8)), min_size=1, max_size=12),
    st.integers(0, 8),
    st.sampled_from(["cpu-float", "cpu-quantized", "cuda"]),
)
def test_vectorised_plan_matches_the_python_reference(
    requests: list[tuple[float, int]], extra_rows: int, path: str
) -> None:
    curve = {"cpu-float": CPU, "cpu-quantized": CPU_QUANTIZED}.get(
        path, RowCostModel.for_device("cuda")
    )
    acceptance = [a for a, _ in requests]
    caps = [c for _, c in requests]
    base = len(requests) + extra_rows
    mine = plan_drafts(base, acceptance, caps, curve)
    ref = _reference_plan(base, acceptance, caps, curve)
    # Equal, up to near-ties (1e-9) that the two may break differently.
    assert expected_speedup(base, mine, acceptance, curve) == pytest.approx(
        expected_speedup(base, ref, acceptance, curve), rel=1e-9
    )
    rows = np.arange(0, 200)
    assert np.allclose(curve.costs(rows), [curve.cost(int(r)) for r in rows])


def test_spec_decoder_takes_the_curve_of_its_path_or_the_configured_one() -> None:
    device = torch.device("cpu")
    builder = select_attention_backend(device, "auto").get_builder()
    plain = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4}')
    here = RowCostModel.for_path("cpu", quantized=True)  # whether the C kernel loads here
    assert here in (CPU_QGEMM, CPU_QUANTIZED)
    assert SpecDecoder(plain, device, builder, 64, 4, quantized=True).cost_model == here
    assert SpecDecoder(plain, device, builder, 64, 4, quantized=False).cost_model == CPU
    configured = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 4, "row_costs": [[1, 1.0], [64, 1.2]]}'
    )
    decoder = SpecDecoder(configured, device, builder, 64, 4, quantized=True)
    assert decoder.cost_model == RowCostModel(((1, 1.0), (64, 1.2)))
