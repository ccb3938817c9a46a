"""Exact rejection sampling of drafted tokens against the target's distribution.

Request i drafted k_i tokens d_1..d_k; the target scored k_i + 1 positions in
one forward (position j predicts the token after d_j; position 0 the token
after the last known one). Its flat logits rows, request by request:

    request 0 (k=2)     request 1 (k=0)   request 2 (k=3)
    [p0 p1 p2]          [p0]              [p0 p1 p2 p3]
     d1 d2 bonus         bonus             d1 d2 d3 bonus

Greedy requests accept while d_j equals the target's argmax at position j-1
and then take the argmax where they stopped (the bonus if all matched), so
the tokens equal non-speculative greedy decoding exactly.

Random requests use the standard rule (Leviathan et al. / Chen et al.):
accept d_j with probability min(1, p(d_j) / q(d_j)); at the first rejection
sample from norm(max(p - q, 0)); if all are accepted sample the bonus from
the last position's p. With a deterministic proposer (n-gram, a greedy
draft) q is one-hot at d_j: accept with probability p(d_j), and on rejection
sample p with d_j removed. The output token's distribution is exactly p.

p is the *processed* distribution the plain sampler would sample from:
logit bias, penalties, min-tokens, temperature, min-p, top-k/top-p, all per
position. Penalties and min-tokens depend on the tokens before each position,
so the proposer never drafts for requests that use them (their k is 0, and
their single position is processed exactly as the plain sampler does).

Seeded requests draw their uniforms (k_i of them) and their one sample's
noise from their own generator, so their tokens do not depend on the batch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from paged.kernels.ops import apply_penalties, apply_top_k_top_p
from paged.runner.sampler.metadata import SamplingMetadata
from paged.runner.sampler.ops import apply_min_p, random_sample
from paged.runner.sampler.sampler import LogprobsTensors, compute_logprobs_tensors, count_nans

_NEG_INF = float("-inf")


@dataclass
class RejectionOutput:
    """Per request (in the order given): the accepted drafts plus one sampled token."""

    token_ids: list[list[int]]
    num_accepted: list[int]  # accepted drafts (token_ids[i] has num_accepted[i] + 1 tokens)
    position_start: list[int]  # first flat position of each request
    logprobs: LogprobsTensors | None  # per flat position; rows past a request's tokens unused
    num_nans: list[int]  # NaN logits per request, over all its positions


def _expand_entries(
    rows: torch.Tensor,
    values: list[torch.Tensor],
    start: npt.NDArray[np.int64],
    width: npt.NDArray[np.int64],
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(request row, ...) index entries -> the same entries at every position of that request."""
    r = rows.cpu().numpy().astype(np.int64)
    counts = width[r]
    total = int(counts.sum())
    offsets = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    positions = np.repeat(start[r], counts) + offsets
    repeat = torch.from_numpy(counts).to(rows.device)
    out = [v.repeat_interleave(repeat, dim=0) for v in values]
    return torch.from_numpy(positions).to(rows.device), out


def processed_logits(
    logits: torch.Tensor,
    meta: SamplingMetadata,
    pos_to_req: torch.Tensor,
    start: npt.NDArray[np.int64],
    width: npt.NDArray[np.int64],
) -> torch.Tensor:
    """Bias, min-tokens suppression and penalties, each request's applied at all its positions.

    Never mutates `logits`; returns it unchanged (no copy) when nothing applies.
    """
    if meta.logit_bias_rows is None and meta.min_tokens_rows is None and meta.no_penalties:
        return logits
    out = logits.clone()
    if meta.logit_bias_rows is not None:
        assert meta.logit_bias_tokens is not None and meta.logit_bias_values is not None
        pos, (tokens, values) = _expand_entries(
            meta.logit_bias_rows, [meta.logit_bias_tokens, meta.logit_bias_values], start, width
        )
        out.index_put_((pos, tokens), values, accumulate=True)
    if meta.min_tokens_rows is not None:
        assert meta.min_tokens_tokens is not None
        pos, (tokens,) = _expand_entries(
            meta.min_tokens_rows, [meta.min_tokens_tokens], start, width
        )
        out[pos, tokens] = _NEG_INF
    if not meta.no_penalties:
        assert meta.prompt_mask is not None and meta.output_counts is not None
        assert meta.presence_penalties is not None and meta.frequency_penalties is not None
        assert meta.repetition_penalties is not None
        out = apply_penalties(
            out,
            meta.prompt_mask[pos_to_req],
            meta.output_counts[pos_to_req],
            meta.presence_penalties[pos_to_req],
            meta.frequency_penalties[pos_to_req],
            meta.repetition_penalties[pos_to_req],
        )
    return out


def target_probs(
    logits: torch.Tensor, meta: SamplingMetadata, pos_to_req: torch.Tensor
) -> torch.Tensor:
    """Temperature, min-p, top-k/top-p per position, then softmax: what the sampler samples."""
    assert meta.temperature is not None
    scaled = logits / meta.temperature[pos_to_req].unsqueeze(1)
    if meta.min_p is not None:
        scaled = apply_min_p(scaled, meta.min_p[pos_to_req])
    top_k = meta.top_k[pos_to_req] if meta.top_k is not None else None
    top_p = meta.top_p[pos_to_req] if meta.top_p is not None else None
    return apply_top_k_top_p(scaled, top_k, top_p).softmax(dim=-1)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` (the first maximum, NaN counting as one), faster on CPU.

    torch's CPU argmax is scalar code: 5.5 ms for 64 x 49,152 float32 logits (one
    thread) against 0.7 ms for numpy's SIMD argmax, same indices.
    """
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2:
        return torch.from_numpy(np.argmax(x.numpy(), axis=-1).astype(np.int64))
    return x.argmax(dim=-1)


def rejection_sample(
    logits: torch.Tensor,
    num_drafts: npt.NDArray[np.int64],
    draft_token_ids: list[list[int]],
    meta: SamplingMetadata,
    draft_probs: torch.Tensor | None = None,
) -> RejectionOutput:
    """Verify the drafts of `meta.num_rows` requests against `logits` [sum(k_i + 1), V].

    `draft_probs` [sum k_i, V] is the proposer's distribution q per drafted
    token (None: a deterministic proposer, q one-hot at the draft).
    """
    num_reqs = meta.num_rows
    if len(num_drafts) != num_reqs or len(draft_token_ids) != num_reqs:
        raise ValueError(f"num_drafts and draft_token_ids need {num_reqs} entries")
    width = num_drafts.astype(np.int64) + 1
    start = np.cumsum(width) - width
    num_positions = int(width.sum())
    if logits.dim() != 2 or logits.shape[0] != num_positions:
        raise ValueError(
            f"logits must be [{num_positions} positions, vocab], got {tuple(logits.shape)}"
        )
    device = logits.device
    logits = logits.to(torch.float32)
    nans_per_pos = count_nans(logits)
    raw_logprobs = logits.log_softmax(dim=-1) if meta.max_num_logprobs is not None else None
    pos_to_req = torch.from_numpy(np.repeat(np.arange(num_reqs), width)).to(device)
    processed = processed_logits(logits, meta, pos_to_req, start, width)

    max_k = int(num_drafts.max()) if num_reqs else 0
    # [R, max_k] drafts, zero-padded: a row-major mask fills request i's first k_i columns.
    drafts_np = np.zeros((num_reqs, max(max_k, 1)), dtype=np.int64)
    if max_k:
        filled = np.arange(drafts_np.shape[1])[None, :] < num_drafts[:, None]
        drafts_np[filled] = np.fromiter(
            itertools.chain.from_iterable(draft_token_ids), np.int64, int(num_drafts.sum())
        )
    drafts = torch.from_numpy(drafts_np).to(device)
    col = torch.arange(drafts.shape[1], device=device)
    k_dev = torch.from_numpy(num_drafts.astype(np.int64)).to(device)
    valid = col.unsqueeze(0) < k_dev.unsqueeze(1)
    start_dev = torch.from_numpy(start).to(device)
    # Flat position scoring draft j of request i: start_i + j (clamped for padding).
    draft_pos = torch.minimum(start_dev.unsqueeze(1) + col, start_dev.unsqueeze(1) + k_dev[:, None])

    greedy_tok = None if meta.all_random else row_argmax(processed)
    probs = None if meta.all_greedy else target_probs(processed, meta, pos_to_req)
    accept = torch.zeros_like(valid)
    if greedy_tok is not None:
        accept_greedy = drafts == greedy_tok[draft_pos]
        accept = accept_greedy
    if probs is not None:
        uniform = _uniforms(num_reqs, drafts.shape[1], num_drafts, meta, device)
        p_draft = probs[draft_pos, drafts]
        if draft_probs is None:
            accept_random = uniform < p_draft
        else:
            draft_rows = torch.from_numpy(np.cumsum(num_drafts) - num_drafts).to(device)
            q_index = (draft_rows.unsqueeze(1) + col).clamp(max=max(len(draft_probs) - 1, 0))
            q_draft = draft_probs[q_index, drafts]
            accept_random = uniform * q_draft < p_draft
        if greedy_tok is None:
            accept = accept_random
        else:
            assert meta.temperature_is_greedy is not None
            accept = torch.where(
                meta.temperature_is_greedy.unsqueeze(1), accept_greedy, accept_random
            )
    accept &= valid
    num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)
    final_pos = start_dev + num_accepted
    final = _final_tokens(
        probs, greedy_tok, meta, final_pos, num_accepted, k_dev, drafts, draft_probs, num_drafts
    )

    accepted = num_accepted.tolist()
    final_list = final.tolist()
    tokens = [[*draft_token_ids[i][: accepted[i]], final_list[i]] for i in range(num_reqs)]
    logprobs = None
    if raw_logprobs is not None:
        assert meta.max_num_logprobs is not None
        # Each request's tokens at its first positions (the rest of its rows unused).
        chosen = np.zeros(num_positions, dtype=np.int64)
        lengths = np.asarray(accepted, dtype=np.int64) + 1
        flat = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        chosen[np.repeat(start, lengths) + flat] = np.fromiter(
            itertools.chain.from_iterable(tokens), np.int64, int(lengths.sum())
        )
        logprobs = compute_logprobs_tensors(
            raw_logprobs, meta.max_num_logprobs, torch.from_numpy(chosen).to(device)
        )
    nans = nans_per_pos.cpu().numpy()
    nan_per_req = np.add.reduceat(nans, start).tolist() if num_reqs else []
    return RejectionOutput(
        token_ids=tokens,
        num_accepted=accepted,
        position_start=start.tolist(),
        logprobs=logprobs,
        num_nans=[int(n) for n in nan_per_req],
    )


def _uniforms(
    num_reqs: int,
    width: int,
    num_drafts: npt.NDArray[np.int64],
    meta: SamplingMetadata,
    device: torch.device,
) -> torch.Tensor:
    """U(0,1) per draft; a seeded request draws exactly its k_i from its own generator."""
    u = torch.rand((num_reqs, width), device=device)
    for row, generator in meta.generators.items():
        k = int(num_drafts[row])
        if k:
            u[row, :k] = torch.rand(k, device=device, generator=generator)
    return u


def _final_tokens(
    probs: torch.Tensor | None,
    greedy_tok: torch.Tensor | None,
    meta: SamplingMetadata,
    final_pos: torch.Tensor,
    num_accepted: torch.Tensor,
    k_dev: torch.Tensor,
    drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    num_drafts: npt.NDArray[np.int64],
) -> torch.Tensor:
    """The token at each request's stopping position: argmax, residual sample or bonus sample."""
    greedy_final = greedy_tok[final_pos] if greedy_tok is not None else None
    if probs is None:
        assert greedy_final is not None
        return greedy_final
    p = probs[final_pos]  # [S, V], a copy
    rejected = num_accepted < k_dev
    if bool(rejected.any()):
        rows = torch.nonzero(rejected).squeeze(1)
        rejected_draft = drafts[rows, num_accepted[rows]]
        if draft_probs is None:
            residual = p[rows].clone()
            residual[torch.arange(len(rows), device=p.device), rejected_draft] = 0.0
        else:
            first = torch.from_numpy(np.cumsum(num_drafts) - num_drafts).to(p.device)
            q = draft_probs[first[rows] + num_accepted[rows]]
            residual = (p[rows] - q).clamp(min=0.0)
        # p == q leaves nothing (then no draft is ever rejected): keep p as a guard.
        empty = residual.sum(dim=-1) <= 0
        residual = torch.where(empty.unsqueeze(1), p[rows], residual)
        p[rows] = residual
    sampled = random_sample(p, meta.generators)
    if greedy_final is None:
        return sampled
    assert meta.temperature_is_greedy is not None
    return torch.where(meta.temperature_is_greedy, greedy_final, sampled)
