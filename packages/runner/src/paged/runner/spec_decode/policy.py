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
one row to two costs 0.3-0.9 of a forward on CPU, by path) that only a few
drafts together pay for.

`a` per request (`estimate_acceptance`) blends a prior from the n-gram match
length (a longer match predicts a longer copy) with the request's own
history (accepted positions over tried positions, decayed), so a request
with a long history of full acceptance gets more drafts and one whose drafts
keep failing gets none.

The row-cost curve (`RowCostModel`) is a table of measured points per
compute path, not an online measurement: step timings on a shared 2-core CPU
are noisy (other processes), and a start-up probe would add seconds to every
engine start. The curve differs by path far more than by machine, so the
table is keyed by what the runner runs: `benchmarks/verify_cost.py` times a
verification step over M rows (1 request, M - 1 drafts, the logits of every
row, the rejection sampler and the proposer) against a one-row decode step
and prints the points. `speculative_config.row_costs` replaces the table
(e.g. after a kernel change or on another machine); see `RowCostModel.for_path`
for each default's origin.

vLLM's `disable_by_batch_size` is an explicit override: with that many
requests decoding in the step, nobody drafts.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

# Prior acceptance for a match of n tokens: 1 - 1 / (n + 2) (n=3: 0.8, n=5:
# 0.857). Weight of the prior, in tried positions, against the history.
_PRIOR_WEIGHT = 2.0
# Each verification multiplies the history's counts by this (recent steps count most).
_HISTORY_DECAY = 0.8


# Measured with benchmarks/verify_cost.py (rows -> cost in one-row steps, CPU-time
# medians). CPU, quantised GGUF (bf16 activations, 1 thread), SmolLM2-135M, with
# paged's C kernel (cpu_kernels/, the default where it compiles), the fused
# decoder layers, the C attention of decode/verification rows and the multi-row
# kernel round: one run of 5 rounds at load average 0.08-0.44 (13.75 ms CPU for
# one row). Up to 16 rows the shape is one request with M - 1 drafts; 32 and 64
# rows are 8 requests x 4 / 8 rows (80 / 145 ms), the shape drafting takes at 8
# streams (one request of 32 / 64 rows costs 75 / 139 ms, a shape no default k
# produces). The multi-row kernel round flattened the curve below 16 rows (it was
# 1.17 / 1.47 / 2.25 at 2 / 4 / 8 rows), so drafting is cheaper to try than the
# previous curve said; the second round's curve (8 rows 1.76, 64 rows 6.1) was
# steeper still at many rows, which over-drafted free text at 8 streams.
_CPU_QGEMM_POINTS: tuple[tuple[int, float], ...] = (
    (1, 1.0),
    (2, 1.03),
    (4, 1.15),
    (8, 1.56),
    (16, 2.75),
    (32, 5.79),
    (64, 10.51),
)
# Without it (no compiler, PAGED_QGEMM_ISA=off: torch's int4 kernel, a GEMV per
# row, the tied Q8_0 LM head as two int4 passes, a bf16 copy from 64 rows): the
# mean of two runs of 3 and 5 rounds at load 0.7-1.4, nearly linear past 4 rows.
_CPU_QUANTIZED_POINTS: tuple[tuple[int, float], ...] = (
    (1, 1.0),
    (2, 1.27),
    (4, 1.4),
    (8, 2.09),
    (16, 3.7),
    (32, 6.57),
    (64, 9.97),
)
# CPU, float32 (dequantised), SmolLM2-135M, 1 thread, one run of 5 rounds at load
# 1.4-3.5: one row is a GEMV over the plain weights (80 ms CPU), 2+ rows go
# through the GEMM panels (a step up, then a slow climb once compute-bound).
_CPU_FLOAT_POINTS: tuple[tuple[int, float], ...] = (
    (1, 1.0),
    (2, 1.68),
    (8, 1.9),
    (16, 2.64),
    (32, 3.83),
    (64, 5.65),
)
# Not measured: a GPU forward is memory-bound far beyond a batch of drafts.
_CUDA_POINTS: tuple[tuple[int, float], ...] = ((1, 1.0), (2, 1.05), (64, 1.05), (128, 1.69))


@dataclass(frozen=True, slots=True)
class RowCostModel:
    """Cost of a step over `rows` query rows, in one-row steps: a piecewise-linear curve.

    `points` are (rows, cost) pairs with strictly increasing rows, starting at
    (1, 1.0); costs between two points are interpolated linearly, past the
    last point the last segment's slope continues (a single point: flat).
    """

    points: tuple[tuple[int, float], ...]
    # Extra cost of each request that verifies drafts (several query rows of one
    # request go through the chunk attention path, one SDPA per request and layer):
    # benchmarks/verify_cost.py's 8-request shapes against 1-request ones.
    request_cost: float = 0.0

    def __post_init__(self) -> None:
        if self.request_cost < 0:
            raise ValueError(f"request_cost: must be >= 0, got {self.request_cost}")
        pts = self.points
        if not pts or pts[0] != (1, 1.0):
            raise ValueError(f"row_costs: must start with [1, 1.0], got {list(pts)[:1]}")
        for (r0, c0), (r1, c1) in itertools.pairwise(pts):
            if r1 <= r0:
                raise ValueError(f"row_costs: rows must increase, got {r0} then {r1}")
            if c1 < c0:
                raise ValueError(
                    f"row_costs: cost must not fall with rows ({r0}: {c0}, {r1}: {c1})"
                )

    @staticmethod
    def from_pairs(pairs: object) -> RowCostModel:
        """`[[rows, cost], ...]` (the `row_costs` config key) -> a validated curve."""
        if not isinstance(pairs, (list, tuple)):
            raise ValueError(f"row_costs: must be a list of [rows, cost] pairs, got {pairs!r}")
        points: list[tuple[int, float]] = []
        for pair in pairs:
            if (
                not isinstance(pair, (list, tuple))
                or len(pair) != 2
                or isinstance(pair[0], bool)
                or not isinstance(pair[0], int)
                or isinstance(pair[1], bool)
                or not isinstance(pair[1], (int, float))
            ):
                raise ValueError(f"row_costs: each entry must be [rows, cost], got {pair!r}")
            points.append((pair[0], float(pair[1])))
        return RowCostModel(tuple(points))

    def cost(self, rows: int) -> float:
        pts = self.points
        if rows <= 1:
            return 1.0
        if len(pts) == 1:
            return 1.0
        for (r0, c0), (r1, c1) in itertools.pairwise(pts):
            if rows <= r1:
                return c0 + (c1 - c0) * (rows - r0) / (r1 - r0)
        (r0, c0), (r1, c1) = pts[-2], pts[-1]
        return c1 + (c1 - c0) * (rows - r1) / (r1 - r0)

    def costs(self, rows: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]:
        """`cost` of every entry of `rows` (same curve, one numpy call)."""
        xs = np.array([r for r, _ in self.points], dtype=np.float64)
        ys = np.array([c for _, c in self.points], dtype=np.float64)
        out = np.interp(rows.astype(np.float64), xs, ys)
        if len(xs) > 1:
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            beyond = rows > xs[-1]
            out[beyond] = ys[-1] + slope * (rows[beyond] - xs[-1])
        return np.where(rows <= 1, 1.0, out)

    @staticmethod
    def for_path(device_type: str, quantized: bool, c_kernel: bool | None = None) -> RowCostModel:
        """The measured default curve of a compute path (see the module docstring).

        `c_kernel`: whether quantised CPU layers run paged's C kernel (None: whether
        it loads here, as the quantised layers decide).
        """
        if device_type != "cpu":
            return RowCostModel(_CUDA_POINTS)
        if not quantized:
            return RowCostModel(_CPU_FLOAT_POINTS, request_cost=0.02)
        if c_kernel is None:
            from paged.runner.cpu_kernels import load_qgemm

            c_kernel = load_qgemm() is not None
        if c_kernel:
            # Verification rows of all requests share one C attention call per layer:
            # 8 requests x 8 rows cost less than 1 request x 64 rows (164 vs 183 ms).
            return RowCostModel(_CPU_QGEMM_POINTS, request_cost=0.0)
        # torch's chunk attention runs per request: 8 requests x 2 rows cost 3-6 ms per
        # request more than 1 request x 16 rows.
        return RowCostModel(_CPU_QUANTIZED_POINTS, request_cost=0.1)

    @staticmethod
    def for_device(device_type: str) -> RowCostModel:
        """The unquantised path's curve of a device (float32 on CPU)."""
        return RowCostModel.for_path(device_type, quantized=False)


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
    caps = np.maximum(np.asarray(max_drafts, dtype=np.int64), 0)
    width = int(caps.max()) if len(caps) else 0
    if width == 0:
        return plan
    # Every candidate draft with its value a**i ([R, width], row-major: request, then
    # draft), best first; the sort is stable, so equal values keep that order.
    i = np.arange(1, width + 1)
    values = np.asarray(acceptance, dtype=np.float64)[:, None] ** i[None, :]
    valid = (i[None, :] <= caps[:, None]) & (values > 0.0)
    owner = np.nonzero(valid)[0]
    order = np.argsort(-values[valid], kind="stable")
    if len(order) == 0:
        return plan
    gained = np.cumsum(values[valid][order])
    counts = np.arange(1, len(order) + 1)
    # Requests with at least one draft among the first c candidates (each adds request_cost).
    owners_sorted = owner[order]
    first_seen = np.zeros(len(order), dtype=bool)
    first_seen[np.unique(owners_sorted, return_index=True)[1]] = True
    drafting = np.cumsum(first_seen)
    step_cost = cost.costs(base_rows + counts) + cost.request_cost * drafting
    throughput = (base_rows + gained) / step_cost
    best = int(np.argmax(throughput))
    if throughput[best] <= base_rows / cost.cost(base_rows) * (1 + 1e-9):
        return plan
    chosen = np.bincount(owner[order[: best + 1]], minlength=len(plan))
    return [int(k) for k in chosen]


def plan_request_drafts(
    num_rows: int,
    match_len: Sequence[int],
    caps: Sequence[int],
    histories: Sequence[AcceptanceHistory | None],
    alone: Sequence[bool],
    cost: RowCostModel,
) -> list[int]:
    """Drafts per request of one step: each request's acceptance estimate, then the plan.

    `num_rows`: the step's rows without drafts (one per sampling request);
    `match_len[r]`, `caps[r]`, `histories[r]`: request r's n-gram match, how many
    drafts its match offers (at most k), its verification history. A request
    with `alone[r]` (a seeded one, whose tokens must not depend on the batch) is
    planned as if it were the only one; the others share one batch plan.
    """
    n = len(match_len)
    if not len(caps) == len(histories) == len(alone) == n:
        raise ValueError(
            f"match_len: {n} requests but caps, histories, alone have "
            f"{len(caps)}, {len(histories)}, {len(alone)}"
        )
    acceptance = [estimate_acceptance(m, h) for m, h in zip(match_len, histories, strict=True)]
    plan = [0] * n
    shared = [i for i in range(n) if not alone[i]]
    if shared:
        shared_plan = plan_drafts(
            num_rows, [acceptance[i] for i in shared], [caps[i] for i in shared], cost
        )
        for i, k in zip(shared, shared_plan, strict=True):
            plan[i] = k
    for i in range(n):
        if alone[i]:
            plan[i] = plan_drafts(1, [acceptance[i]], [caps[i]], cost)[0]
    return plan


def expected_speedup(
    base_rows: int, plan: Sequence[int], acceptance: Sequence[float], cost: RowCostModel
) -> float:
    """Throughput of `plan` over plain decoding, by the model (for tests and logs)."""
    gained = sum(sum(a**i for i in range(1, k + 1)) for k, a in zip(plan, acceptance, strict=True))
    drafted = sum(plan)
    plain = base_rows / cost.cost(base_rows)
    step = cost.cost(base_rows + drafted) + cost.request_cost * sum(1 for k in plan if k)
    return (base_rows + gained) / step / plain if plain else math.nan
