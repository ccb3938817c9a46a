"""`Sampler`: logits [B, V] + `SamplingMetadata` -> sampled tokens and logprobs.

Order of operations (vLLM v1):

    raw logprobs (log_softmax of the unprocessed logits, when asked)
    logit bias, min-tokens stop suppression          (change the argmax)
    presence / frequency / repetition penalties
    greedy argmax                                    (all-greedy batches stop here)
    temperature, min-p, top-k / top-p                (random rows)
    exponential-race sample with per-row generators
    where(greedy row, argmax, sample)

Logprobs are always those of the raw model distribution, and the chosen
token's rank is its rank there (1 = most likely).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged.kernels.ops import apply_penalties, apply_top_k_top_p
from paged.runner.sampler.metadata import SamplingMetadata
from paged.runner.sampler.ops import apply_min_p, random_sample

_NEG_INF = float("-inf")


@dataclass
class LogprobsTensors:
    """Top-N logprobs for B rows: column 0 is the chosen token, 1..N the top-N."""

    token_ids: torch.Tensor  # [B, N+1] int64
    logprobs: torch.Tensor  # [B, N+1] float32
    ranks: torch.Tensor  # [B] int64, rank of the chosen token (1 = best)


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None
    num_nans: torch.Tensor  # [B] int64: NaN logits per row (before any processing)


def compute_logprobs_tensors(
    logprobs: torch.Tensor, num_logprobs: int, chosen: torch.Tensor
) -> LogprobsTensors:
    """Gather the chosen token's logprob and rank plus the top `num_logprobs` per row."""
    chosen = chosen.to(torch.long).unsqueeze(1)
    chosen_lp = logprobs.gather(1, chosen)
    # Rank = how many tokens are at least as likely as the chosen one (ties share the worse rank).
    ranks = (logprobs >= chosen_lp).sum(dim=-1)
    if num_logprobs > 0:
        top_lp, top_ids = logprobs.topk(num_logprobs, dim=-1)
        token_ids = torch.cat([chosen, top_ids], dim=1)
        values = torch.cat([chosen_lp, top_lp], dim=1)
    else:
        token_ids, values = chosen, chosen_lp
    return LogprobsTensors(token_ids=token_ids, logprobs=values, ranks=ranks)


def count_nans(logits: torch.Tensor) -> torch.Tensor:
    """NaNs per row, [S] int64.

    A row sum is NaN whenever the row holds a NaN (or both infinities), so one
    cheap reduction clears the common case; only suspicious rows are counted.
    """
    counts = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
    suspicious = torch.isnan(logits.sum(dim=-1))
    if bool(suspicious.any()):
        counts[suspicious] = torch.isnan(logits[suspicious]).sum(dim=-1)
    return counts


class Sampler:
    """Stateless: all per-request state lives in `SamplingMetadata`; never mutates `logits`."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        return self.forward(logits, metadata)

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != metadata.num_rows:
            raise ValueError(
                f"logits must be [num_rows={metadata.num_rows}, vocab], got {tuple(logits.shape)}"
            )
        logits = logits.to(torch.float32)
        num_nans = count_nans(logits)
        raw_logprobs = logits.log_softmax(dim=-1) if metadata.max_num_logprobs is not None else None
        if (
            not metadata.no_penalties
            or metadata.logit_bias_rows is not None
            or (metadata.min_tokens_rows is not None)
        ):
            logits = logits.clone()  # the transforms below work in place
        self._apply_biases(logits, metadata)
        if not metadata.no_penalties:
            assert metadata.prompt_mask is not None and metadata.output_counts is not None
            assert metadata.presence_penalties is not None
            assert metadata.frequency_penalties is not None
            assert metadata.repetition_penalties is not None
            logits = apply_penalties(
                logits,
                metadata.prompt_mask,
                metadata.output_counts,
                metadata.presence_penalties,
                metadata.frequency_penalties,
                metadata.repetition_penalties,
            )
        sampled = self.sample(logits, metadata)
        logprobs = None
        if raw_logprobs is not None:
            assert metadata.max_num_logprobs is not None
            logprobs = compute_logprobs_tensors(raw_logprobs, metadata.max_num_logprobs, sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs, num_nans=num_nans)

    @staticmethod
    def _apply_biases(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
        """Logit bias and min-tokens suppression, in place."""
        if metadata.logit_bias_rows is not None:
            assert metadata.logit_bias_tokens is not None
            assert metadata.logit_bias_values is not None
            logits.index_put_(
                (metadata.logit_bias_rows, metadata.logit_bias_tokens),
                metadata.logit_bias_values,
                accumulate=True,
            )
        if metadata.min_tokens_rows is not None:
            assert metadata.min_tokens_tokens is not None
            logits[metadata.min_tokens_rows, metadata.min_tokens_tokens] = _NEG_INF

    @staticmethod
    def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Greedy argmax and/or random sampling of processed logits, per row."""
        greedy = None if metadata.all_random else logits.argmax(dim=-1)
        if metadata.all_greedy:
            assert greedy is not None
            return greedy
        assert metadata.temperature is not None
        logits = logits / metadata.temperature.unsqueeze(1)  # a new tensor: safe to mask in place
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        probs = logits.softmax(dim=-1)
        sampled = random_sample(probs, metadata.generators)
        if greedy is None:
            return sampled
        assert metadata.temperature_is_greedy is not None
        return torch.where(metadata.temperature_is_greedy, greedy, sampled)
