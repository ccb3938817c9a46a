"""`SamplingMetadata`: the batch's sampling parameters as device tensors.

Built by `build_sampling_metadata(batch, rows)` (build.py) for the rows that sample
this step (a partial prefill chunk samples nothing, so its row is left out
and its seeded generator does not advance). Row i of every tensor belongs to
the i-th sampling request. Fields that no request uses are `None` (or empty)
so the sampler skips their work entirely.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingMetadata:
    """Per-row sampling parameters for one step.

    `temperature` is None when every row is greedy; greedy rows hold 1.0 so
    dividing by it is harmless (their token is the argmax regardless).
    `top_k` is None when no row uses top-k (rows without it hold vocab_size);
    `top_p` None when no row uses it (rows without it hold 1.0); `min_p` None
    when no row uses it. `generators` maps a row to its seeded generator.
    Penalty tensors are None when `no_penalties`. `logit_bias_*` and
    `min_tokens_*` are parallel (row, token) index tensors, empty when unused.
    """

    num_rows: int
    temperature: torch.Tensor | None
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    max_num_logprobs: int | None = None
    no_penalties: bool = True
    prompt_mask: torch.Tensor | None = None  # [B, V] bool: token appears in the prompt
    output_counts: torch.Tensor | None = None  # [B, V] int: occurrences in the output
    presence_penalties: torch.Tensor | None = None
    frequency_penalties: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    logit_bias_rows: torch.Tensor | None = None
    logit_bias_tokens: torch.Tensor | None = None
    logit_bias_values: torch.Tensor | None = None
    min_tokens_rows: torch.Tensor | None = None
    min_tokens_tokens: torch.Tensor | None = None
    # Set by the builder when the batch mixes greedy and random rows.
    temperature_is_greedy: torch.Tensor | None = None
