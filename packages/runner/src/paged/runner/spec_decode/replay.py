"""Offline replay of n-gram speculation over known greedy outputs, priced by a row-cost curve.

Greedy output with speculation equals greedy output without it (tested), so
a plain run's tokens say exactly what every draft would have yielded: a
draft is accepted while it equals the plain output. Replaying the steps of a
batch with a `RowCostModel` then gives the cost of speculation against plain
decoding without running the model, for any curve and any drafting policy:

    plain     every decode step costs cost(requests still running)
    spec      every step costs cost(sum over running requests of 1 + drafts);
              a request advances by its accepted drafts + 1 (the bonus token)

Policies (`ReplayPolicy`):

    perfect   every request drafts min(k, room) tokens and all are accepted:
              the ceiling of any proposer on this curve and these lengths
    oracle    the n-gram proposer's drafts, each cut to its accepted prefix,
              and per step the number of those that maximises tokens per cost
              (knows the future: the ceiling of this proposer, step by step)
    fixed     every match drafts all its followers up to k (draft_policy "fixed")
    cost      the shipped policy (`plan_request_drafts`, `AdaptiveDrafting`),
              as the runner applies it

Not modelled: the cost outside the runner's step (scheduler, detokenisation:
a few percent at 8 streams, the same for every step) and prefill (excluded
from spec_bench's decode figures too). `benchmarks/spec_ceiling.py` feeds it
the default model's outputs on spec_bench's prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from paged.runner.spec_decode.adaptive import AdaptiveDrafting
from paged.runner.spec_decode.ngram import NgramProposer
from paged.runner.spec_decode.policy import AcceptanceHistory, RowCostModel, plan_request_drafts

ReplayPolicy = Literal["perfect", "oracle", "fixed", "cost"]
REPLAY_POLICIES: tuple[ReplayPolicy, ...] = ("perfect", "oracle", "fixed", "cost")


@dataclass(frozen=True, slots=True)
class ReplaySequence:
    """One request: its prompt, its plain greedy output, its max_tokens (the draft cap)."""

    prompt: tuple[int, ...]
    output: tuple[int, ...]
    max_tokens: int

    def __post_init__(self) -> None:
        if not self.prompt or not self.output:
            raise ValueError("sequences: every request needs a prompt and an output token")
        if self.max_tokens < len(self.output):
            raise ValueError(
                f"sequences: max_tokens {self.max_tokens} < output length {len(self.output)}"
            )


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """Cost of a replayed batch, spec against plain, and vLLM's spec counters."""

    speedup: float  # plain cost / spec cost (1.0 for a batch with nothing to decode)
    plain_cost: float  # in one-row steps
    spec_cost: float
    steps: int
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: tuple[int, ...]  # drafts whose position j was accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / max(self.num_draft_tokens, 1)

    @property
    def mean_accepted_length(self) -> float:
        return 1 + self.num_accepted_tokens / max(self.num_drafts, 1)


def full_batch_ceiling(cost: RowCostModel, streams: int, k: int) -> float:
    """Speedup of `streams` requests that all draft k tokens, all accepted, every step."""
    if streams < 1 or k < 0:
        raise ValueError(f"streams, k: need streams >= 1 and k >= 0, got {streams}, {k}")
    return (k + 1) * cost.cost(streams) / cost.cost(streams * (k + 1))


def observed_ceiling(
    cost: RowCostModel, streams: int, accepted_per_pos: Sequence[int], num_drafts: int
) -> float:
    """`full_batch_ceiling` with the observed per-position acceptance instead of all accepted.

    Every request drafts k = len(accepted_per_pos) tokens every step and yields
    1 + sum_j accepted_per_pos[j] / num_drafts tokens (the metrics' mean accepted length).
    """
    if num_drafts < 1:
        raise ValueError(f"num_drafts: must be >= 1, got {num_drafts}")
    k = len(accepted_per_pos)
    tokens = 1 + sum(accepted_per_pos) / num_drafts
    return tokens * cost.cost(streams) / cost.cost(streams * (k + 1))


def scaled_curve(
    cost: RowCostModel, factor: float, mode: Literal["marginal", "many"]
) -> RowCostModel:
    """A curve whose many-row steps are `factor` times cheaper (what faster kernels may bring).

    `marginal`: everything a step costs beyond one row shrinks by `factor`
    (8 rows too); `many`: points of 16 rows and more shrink by `factor`, floored
    at the 8-row point (a one-row and 8-row step cost what they cost today).
    """
    if factor <= 0:
        raise ValueError(f"factor: must be > 0, got {factor}")
    if mode == "marginal":
        return RowCostModel(tuple((r, 1 + (c - 1) / factor) for r, c in cost.points))
    floor = cost.cost(8)
    return RowCostModel(
        tuple((r, max(floor, c / factor) if r >= 16 else c) for r, c in cost.points)
    )


def _accepted(output: tuple[int, ...], start: int, drafts: Sequence[int]) -> int:
    n = 0
    for d in drafts:
        if start + n < len(output) and output[start + n] == d:
            n += 1
        else:
            break
    return n


def _oracle_plan(num_rows: int, accepted: Sequence[int], cost: RowCostModel) -> list[int]:
    """The accepted drafts to verify this step: the count that maximises tokens per cost."""
    total = sum(accepted)
    extra = np.arange(total + 1)
    throughput = (num_rows + extra) / cost.costs(num_rows + extra)
    budget = int(np.argmax(throughput))
    plan = [0] * len(accepted)
    for i in sorted(range(len(accepted)), key=lambda i: -accepted[i]):
        plan[i] = min(accepted[i], budget)
        budget -= plan[i]
    return plan


def replay(
    sequences: Sequence[ReplaySequence],
    cost: RowCostModel,
    proposer: NgramProposer,
    k: int,
    policy: ReplayPolicy,
    acceptance_rate_threshold: float = 0.2,
    acceptance_backoff_steps: int = 16,
) -> ReplayResult:
    """Replay one batch (all requests start together after their prefill) under `policy`."""
    if k < 1:
        raise ValueError(f"k: must be >= 1, got {k}")
    if policy not in REPLAY_POLICIES:
        raise ValueError(f"policy: {policy!r}; use one of {', '.join(REPLAY_POLICIES)}")
    if not sequences:
        raise ValueError("sequences: empty batch")
    lengths = [len(s.output) for s in sequences]
    plain = sum(
        cost.cost(sum(1 for n in lengths if n - 1 >= step)) for step in range(1, max(lengths))
    )
    adaptive = AdaptiveDrafting(acceptance_rate_threshold, acceptance_backoff_steps)
    histories: dict[int, AcceptanceHistory] = {}
    done = [1] * len(sequences)  # output tokens known (the first from the prefill)
    spec = 0.0
    steps = drafts_n = drafted = accepted_n = 0
    per_pos = [0] * k
    while True:
        active = [i for i, n in enumerate(lengths) if done[i] < n]
        if not active:
            break
        caps = [min(k, sequences[i].max_tokens - done[i] - 1) for i in active]
        if policy == "perfect":
            room = [min(c, lengths[i] - done[i] - 1) for i, c in zip(active, caps, strict=True)]
            plan, hits = room, room
        else:
            if policy == "cost":  # the runner asks the off-switch only where a draft could go
                caps = [
                    c if c > 0 and adaptive.should_draft(str(i)) else 0
                    for i, c in zip(active, caps, strict=True)
                ]
            drafts, match_len = _propose(sequences, active, done, caps, proposer)
            full = [
                _accepted(sequences[i].output, done[i], d)
                for i, d in zip(active, drafts, strict=True)
            ]
            if policy == "oracle":
                # (An accepted draft at the request's last token saves nothing: the bonus
                # token would have given it.)
                useful = [
                    min(a, lengths[i] - done[i] - 1) for i, a in zip(active, full, strict=True)
                ]
                plan = _oracle_plan(len(active), useful, cost)
            elif policy == "fixed":
                plan = [len(d) for d in drafts]
            else:
                plan = plan_request_drafts(
                    len(active),
                    match_len,
                    [len(d) for d in drafts],
                    [histories.get(i) for i in active],
                    [False] * len(active),
                    cost,
                )
            hits = [min(a, p) for a, p in zip(full, plan, strict=True)]
        for i, n_drafts, n_accepted in zip(active, plan, hits, strict=True):
            if n_drafts:
                drafts_n += 1
                drafted += n_drafts
                accepted_n += n_accepted
                for j in range(n_accepted):
                    per_pos[j] += 1
                adaptive.record(str(i), n_drafts, n_accepted)
                histories.setdefault(i, AcceptanceHistory()).record(n_drafts, n_accepted)
            done[i] = min(done[i] + n_accepted + 1, lengths[i])
        spec += cost.cost(len(active) + sum(plan))
        steps += 1
    return ReplayResult(
        speedup=plain / spec if spec else 1.0,  # (nothing to decode: no step at all)
        plain_cost=plain,
        spec_cost=spec,
        steps=steps,
        num_drafts=drafts_n,
        num_draft_tokens=drafted,
        num_accepted_tokens=accepted_n,
        accepted_per_pos=tuple(per_pos),
    )


def _propose(
    sequences: Sequence[ReplaySequence],
    active: Sequence[int],
    done: Sequence[int],
    caps: Sequence[int],
    proposer: NgramProposer,
) -> tuple[list[list[int]], list[int]]:
    """The proposer's drafts for the running requests, as the runner calls it (one batch)."""
    known = [list(sequences[i].prompt) + list(sequences[i].output[: done[i]]) for i in active]
    num_tokens = np.array([len(t) for t in known], dtype=np.int64)
    tokens = np.zeros((len(known), int(num_tokens.max())), dtype=np.int64)
    for r, t in enumerate(known):
        tokens[r, : len(t)] = t
    max_drafts = np.maximum(np.array(caps, dtype=np.int64), 0)
    return proposer.propose_with_match_len(tokens, num_tokens, max_drafts)


def ceiling_report(
    cost: RowCostModel,
    sequences: Sequence[ReplaySequence],
    proposer: NgramProposer,
    k: int,
) -> dict[str, Any]:
    """One batch on one curve: the full-batch ceilings and every policy's replay (JSON-ready).

    `all_accepted_full_batch[j]`: `full_batch_ceiling` for j = 1..8 drafts at this
    batch size; `observed_full_batch`: `observed_ceiling` with the per-position
    acceptance of the `fixed` replay (None when nothing drafted).
    """
    streams = len(sequences)
    results = {p: replay(sequences, cost, proposer, k, p) for p in REPLAY_POLICIES}
    fixed = results["fixed"]
    return {
        "points": [list(p) for p in cost.points],
        "all_accepted_full_batch": {
            str(j): round(full_batch_ceiling(cost, streams, j), 3) for j in range(1, 9)
        },
        "observed_full_batch": round(
            observed_ceiling(cost, streams, fixed.accepted_per_pos, fixed.num_drafts), 3
        )
        if fixed.num_drafts
        else None,
        "fixed_accepted_per_pos": [
            round(a / max(fixed.num_drafts, 1), 3) for a in fixed.accepted_per_pos
        ],
        "replay": {
            p: {
                "speedup": round(r.speedup, 3),
                "steps": r.steps,
                "num_drafts": r.num_drafts,
                "acceptance_rate": round(r.acceptance_rate, 3),
                "mean_accepted_length": round(r.mean_accepted_length, 3),
            }
            for p, r in results.items()
        },
    }
