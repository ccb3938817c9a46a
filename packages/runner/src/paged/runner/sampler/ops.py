"""Vectorised logits transforms used by the sampler (pure torch, any device).

Signatures follow `paged.kernels` sampling helpers (`apply_top_k_top_p`,
`apply_penalties`) so a fused kernel can replace them one for one.
Every function works on a whole batch `[B, V]`; none loops over requests.
"""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """Apply OpenAI presence/frequency and HF-style repetition penalties (vLLM semantics).

    Repetition applies to tokens seen in the prompt OR the output: positive
    logits are divided by the penalty, negative ones multiplied. Frequency
    subtracts `count * frequency`, presence subtracts `presence` once, both
    over output tokens only. Returns `logits` (modified in place).
    """
    output_mask = output_counts > 0
    seen = prompt_mask | output_mask
    rep = repetition.unsqueeze(1).expand_as(logits)
    scale = torch.where(logits > 0, 1.0 / rep, rep)
    logits = torch.where(seen, logits * scale, logits)
    logits -= frequency.unsqueeze(1) * output_counts.to(logits.dtype)
    logits -= presence.unsqueeze(1) * output_mask.to(logits.dtype)
    return logits


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask to -inf every token outside the top-k and outside the top-p nucleus.

    `top_k[b]` >= vocab size disables top-k for row b; `top_p[b] == 1.0`
    disables top-p. Top-k is applied first, then top-p renormalises over
    what is left. At least one token (the argmax) always survives.
    """
    if top_k is None and top_p is None:
        return logits
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        # The k-th largest value sits at ascending index V - k.
        kth_index = (vocab - top_k.clamp(1, vocab).to(torch.long)).unsqueeze(1)
        kth_value = sorted_logits.gather(1, kth_index)
        sorted_logits.masked_fill_(sorted_logits < kth_value, _NEG_INF)
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        cum = probs.cumsum(dim=-1)
        # Drop the low tail whose total mass stays within 1 - p; keep the last (max) token.
        drop = cum <= (1.0 - top_p.unsqueeze(1))
        drop[:, -1] = False
        sorted_logits.masked_fill_(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


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
