"""Sampler transforms that `paged.kernels.ops` does not provide (pure torch, any device).

Penalties and top-k/top-p come from `paged.kernels.ops` (dispatched per
device). Every function works on a whole batch `[B, V]`; only seeded rows
loop, one device-side fill each.
"""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below `min_p * max_prob` (per row)."""
    probs = logits.softmax(dim=-1)
    max_prob = probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < min_p.unsqueeze(1) * max_prob, _NEG_INF)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Sample one token per row via the exponential race (`argmax p / q`, q ~ Exp(1)).

    Equivalent to multinomial sampling but needs no CPU sync. Rows with a
    seeded generator draw their noise from it, one `[V]` draw per step, so a
    seeded request's tokens do not depend on which other requests share the
    batch. Other rows use the global generator.
    """
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_()
    # Only seeded rows loop, and each loop body is one device-side fill.
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    return probs.div(q).argmax(dim=-1)
