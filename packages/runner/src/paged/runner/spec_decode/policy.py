"""Cost-aware drafting: how many drafts each request gets this step.

Speculation pays when the tokens a verify forward yields grow faster than
its cost. A step over `base_rows` sampling rows (one per decoding request)
plus `D` drafted positions costs `cost(base_rows + D)` in units of a
one-row forward and yields `base_rows + E[accepted]` tokens, so the policy
picks the drafts that maximise

    throughput(D) = (base_rows + sum of the chosen drafts' values) / cost(base_rows + D)

The i-th draft of a request whose per-position acceptance is `a` (the
chance that a drafted token is accepted once the ones before it were) is
accepted with probability `a**i`: that is its value. Values fall along a
request's drafts, so taking drafts in decreasing value and keeping the best
prefix of that order is optimal for a given total D; every prefix is tried,
not only until the first loss, because the cost curve has a step (going from
one row to two costs ~0.9 of a forward on CPU) that only a few drafts
together pay for.

`a` per request (`estimate_acceptance`) blends a prior from the n-gram match
length (a longer match predicts a longer copy) with the request's own
history (accepted positions over tried positions, decayed), so a request
with a long history of full acceptance gets more drafts and one whose drafts
keep failing gets none.

The row-cost curve (`RowCostModel`) is a documented constant per device,
not measured online: step timings on a shared 2-core CPU are noisy (other
processes), and a start-up probe would add seconds to every engine start
for a curve that depends on the model only through its size class. The CPU
figures come from the default model (SmolLM2-135M, fp32, 1 thread): a
forward over 2-8 rows costs ~1.9x a one-row forward (one row is a GEMV, more
go through the GEMM panels; measured on the model: 172 ms vs 315-340 ms),
and past 8 rows each row adds ~0.07 of a one-row forward. That slope is an
estimate, not a direct measurement: it is what makes the measured 1.29x of
copy at 8 streams x 8 positions (64 rows, 6.9 tokens per verification)
consistent with the 1.9x plateau, and it matches the slope of the model's
matmuls timed alone at 16-64 rows. CUDA has not been measured here: its
curve is a guess that keeps speculation cheap (flat up to 64 rows), stated
as such.

vLLM's `disable_by_batch_size` is an explicit override: with that many
requests decoding in the step, nobody drafts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# Prior acceptance for a match of n tokens: 1 - 1 / (n + 2) (n=3: 0.8, n=5:
# 0.857). Weight of the prior, in tried positions, against the history.
_PRIOR_WEIGHT = 2.0
# Each verification multiplies the history's counts by this (recent steps count most).
_HISTORY_DECAY = 0.8


@dataclass(frozen=True, slots=True)
class RowCostModel:
    """Cost of a forward over `rows` query rows, in one-row forwards.

    cost(1) = 1; for rows > 1: step_cost + row_cost * max(0, rows - plateau_rows)
    (a jump from one row to several, a plateau while the weights' reads
    dominate, then a cost per row once the matmuls are compute-bound).
    """

    step_cost: float
    plateau_rows: int
    row_cost: float

    def __post_init__(self) -> None:
        if self.step_cost < 1.0:
            raise ValueError(f"step_cost: must be >= 1, got {self.step_cost}")
        if self.plateau_rows < 1:
            raise ValueError(f"plateau_rows: must be >= 1, got {self.plateau_rows}")
        if self.row_cost < 0:
            raise ValueError(f"row_cost: must be >= 0, got {self.row_cost}")

    def cost(self, rows: int) -> float:
        if rows <= 1:
            return 1.0
        return self.step_cost + self.row_cost * max(0, rows - self.plateau_rows)

    @staticmethod
    def for_device(device_type: str) -> RowCostModel:
        if device_type == "cpu":
            # See the module docstring for where each figure comes from.
            return RowCostModel(step_cost=1.9, plateau_rows=8, row_cost=0.07)
        # Not measured: a GPU forward is memory-bound far beyond a batch of drafts.
        return RowCostModel(step_cost=1.05, plateau_rows=64, row_cost=0.01)


@dataclass(slots=True)
class AcceptanceHistory:
    """Decayed counts of accepted and tried drafted positions of one request.

    A verification of k drafts with `a` accepted tried a + 1 positions (the
    first rejected one included) or k when all were accepted.
    """

    accepted: float = 0.0
    tried: float = 0.0
    full_streak: int = 0

    def record(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts <= 0:
            return
        tried = num_drafts if num_accepted >= num_drafts else num_accepted + 1
        self.accepted = self.accepted * _HISTORY_DECAY + num_accepted
        self.tried = self.tried * _HISTORY_DECAY + tried
        self.full_streak = self.full_streak + 1 if num_accepted >= num_drafts else 0


def match_prior(match_len: int) -> float:
    """Per-position acceptance predicted by an n-gram match of `match_len` tokens."""
    if match_len <= 0:
        return 0.0
    return 1.0 - 1.0 / (match_len + 2)


def estimate_acceptance(match_len: int, history: AcceptanceHistory | None) -> float:
    """Per-position acceptance of a request's next drafts (0: no match, no drafts)."""
    if match_len <= 0:
        return 0.0
    prior = match_prior(match_len)
    if history is None or history.tried == 0:
        return prior
    estimate = (prior * _PRIOR_WEIGHT + history.accepted) / (_PRIOR_WEIGHT + history.tried)
    return min(estimate, 0.99)


def plan_drafts(
    base_rows: int,
    acceptance: Sequence[float],
    max_drafts: Sequence[int],
    cost: RowCostModel,
    disable_by_batch_size: int | None = None,
) -> list[int]:
    """Drafts per request that maximise expected tokens per unit of forward cost.

    `base_rows`: rows the step has without drafts (one per decoding request,
    at least len(acceptance)); `acceptance[r]`, `max_drafts[r]`: request r's
    per-position acceptance and cap (its n-gram followers, k, room).
    """
    if len(acceptance) != len(max_drafts):
        raise ValueError(
            f"acceptance: {len(acceptance)} values but max_drafts has {len(max_drafts)}"
        )
    if base_rows < 1:
        raise ValueError(f"base_rows: must be >= 1, got {base_rows}")
    plan = [0] * len(acceptance)
    if disable_by_batch_size is not None and len(acceptance) >= disable_by_batch_size:
        return plan
    # Every candidate draft with its value, best first.
    candidates: list[tuple[float, int]] = []
    for r, (a, cap) in enumerate(zip(acceptance, max_drafts, strict=True)):
        value = 1.0
        for _ in range(max(cap, 0)):
            value *= a
            if value <= 0.0:
                break
            candidates.append((value, r))
    candidates.sort(key=lambda c: -c[0])
    best_throughput = base_rows / cost.cost(base_rows)
    best_count = 0
    gained = 0.0
    for count, (value, _) in enumerate(candidates, start=1):
        gained += value
        throughput = (base_rows + gained) / cost.cost(base_rows + count)
        if throughput > best_throughput * (1 + 1e-9):
            best_throughput, best_count = throughput, count
    for _, r in candidates[:best_count]:
        plan[r] += 1
    return plan


def expected_speedup(
    base_rows: int, plan: Sequence[int], acceptance: Sequence[float], cost: RowCostModel
) -> float:
    """Throughput of `plan` over plain decoding, by the model (for tests and logs)."""
    gained = sum(sum(a**i for i in range(1, k + 1)) for k, a in zip(plan, acceptance, strict=True))
    drafted = sum(plan)
    plain = base_rows / cost.cost(base_rows)
    return (base_rows + gained) / cost.cost(base_rows + drafted) / plain if plain else math.nan
