"""Reference sampling helpers: top-k/top-p masking and penalties, in place on logits.

These are also what the Triton backend uses: a Triton version is only worth
having if it is measured faster on a GPU, which has not been done.
"""

from __future__ import annotations

import torch

from paged.kernels.validation import check_penalties, check_top_k_top_p

__all__ = ["apply_penalties", "apply_top_k_top_p"]


def apply_top_k_top_p(
    logits: torch.Tensor,  # [B, V] float, modified in place
    top_k: torch.Tensor | None,  # [B] int; <= 0 or >= V means no top-k for that row
    top_p: torch.Tensor | None,  # [B] float in (0, 1]; 1.0 means no top-p for that row
) -> torch.Tensor:
    """Set logits outside each row's top-k / nucleus to ``-inf``; returns ``logits``.

    Top-k keeps every logit ``>=`` the k-th largest (ties at the boundary are kept).
    Top-p then keeps the smallest set of highest-probability tokens (after top-k)
    whose probability mass reaches ``p``; the most likely token is always kept.
    """
    check_top_k_top_p(logits, top_k, top_p)
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)  # ascending
    if top_k is not None:
        k = top_k.to(torch.int64)
        k = torch.where((k <= 0) | (k > vocab), torch.full_like(k, vocab), k)
        kth_largest = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth_largest, float("-inf"))
    if top_p is not None:
        if top_p.numel() and (bool((top_p <= 0).any()) or bool((top_p > 1).any())):
            raise ValueError("top_p values must be in (0, 1]")
        probs = sorted_logits.float().softmax(dim=-1)
        cumulative = probs.cumsum(dim=-1)
        # Ascending order: drop the low tail whose mass is <= 1 - p.
        drop = cumulative <= 1 - top_p.float().unsqueeze(1)
        drop[:, -1] = False
        sorted_logits.masked_fill_(drop, float("-inf"))
    logits.scatter_(1, order, sorted_logits)
    return logits


def apply_penalties(
    logits: torch.Tensor,  # [B, V] float, modified in place
    prompt_mask: torch.Tensor,  # [B, V] bool: token occurs in the prompt
    output_counts: torch.Tensor,  # [B, V] int: occurrences in the generated output
    presence: torch.Tensor,  # [B] float, 0 = off
    frequency: torch.Tensor,  # [B] float, 0 = off
    repetition: torch.Tensor,  # [B] float, 1 = off
) -> torch.Tensor:
    """OpenAI presence/frequency and CTRL-style repetition penalties; returns ``logits``.

    Repetition applies to tokens seen in prompt or output: positive logits are divided
    by it, negative ones multiplied. Then ``logits -= frequency * count`` and
    ``logits -= presence * (count > 0)`` over the output tokens only.
    """
    check_penalties(logits, prompt_mask, output_counts, presence, frequency, repetition)
    seen_in_output = output_counts > 0
    rep = repetition.to(logits.dtype).unsqueeze(1)
    seen = prompt_mask | seen_in_output
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits.copy_(torch.where(seen, penalised, logits))
    logits -= frequency.to(logits.dtype).unsqueeze(1) * output_counts.to(logits.dtype)
    logits -= presence.to(logits.dtype).unsqueeze(1) * seen_in_output.to(logits.dtype)
    return logits
