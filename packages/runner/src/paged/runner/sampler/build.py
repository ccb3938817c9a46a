"""Build `SamplingMetadata` for chosen rows of an `InputBatch`.

A function beside the batch, not a method of it: the batch holds state, this
module reads it (and the batch does not import the sampler).

Dense parameters are gathered with one numpy fancy-index per field; flags
(`all_greedy`, `top_k` unused, ...) come from vectorised checks over the
gathered values, so the common decode step does no per-request Python work.
Only the sparse features (seeded generators, logit bias, min-tokens,
penalty histories) walk their own small dicts.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from paged.runner.input_batch import InputBatch
from paged.runner.sampler.metadata import SamplingMetadata

_GREEDY_EPS = 1e-5


def _to_device(arr: npt.NDArray[Any], device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(arr)).to(device, non_blocking=True)


def build_sampling_metadata(batch: InputBatch, rows: npt.NDArray[np.int64]) -> SamplingMetadata:
    """Sampling parameters of `rows` (row i of the result = batch row `rows[i]`)."""
    device = batch.device
    num_rows = len(rows)
    temperature = batch.temperature.np[rows]
    greedy = batch.is_greedy[rows]
    # Position of each batch row in `rows` (-1: not sampling this step).
    pos = np.full(batch.max_num_reqs, -1, dtype=np.int64)
    pos[rows] = np.arange(num_rows)
    all_greedy = bool(greedy.all())
    all_random = not bool(greedy.any())
    meta = SamplingMetadata(
        num_rows=num_rows,
        temperature=None if all_greedy else _to_device(temperature, device),
        all_greedy=all_greedy,
        all_random=all_random,
    )
    if not all_greedy and not all_random:
        meta.temperature_is_greedy = _to_device(greedy, device)
    if not all_greedy:
        top_k = batch.top_k.np[rows]
        if (top_k < batch.vocab_size).any():
            meta.top_k = _to_device(top_k, device)
        top_p = batch.top_p.np[rows]
        if (top_p < 1.0).any():
            meta.top_p = _to_device(top_p, device)
        min_p = batch.min_p.np[rows]
        if (min_p > 0.0).any():
            meta.min_p = _to_device(min_p, device)
        meta.generators = {
            int(pos[r]): g
            for r, g in batch.generators.items()
            if pos[r] >= 0 and not greedy[pos[r]]
        }
    _add_penalties(batch, rows, meta)
    _add_sparse_biases(batch, pos, meta)
    wanted = [n for rid, n in batch.num_logprobs.items() if pos[batch.req_id_to_index[rid]] >= 0]
    meta.max_num_logprobs = max(wanted) if wanted else None
    return meta


def _add_penalties(batch: InputBatch, rows: npt.NDArray[np.int64], meta: SamplingMetadata) -> None:
    presence = batch.presence_penalties.np[rows]
    frequency = batch.frequency_penalties.np[rows]
    repetition = batch.repetition_penalties.np[rows]
    if not ((presence != 0).any() or (frequency != 0).any() or (repetition != 1.0).any()):
        return
    device = batch.device
    vocab = batch.vocab_size
    num_tokens = batch.num_tokens[rows].astype(np.int64)
    num_prompt = batch.num_prompt_tokens[rows].astype(np.int64)
    width = int(num_tokens.max())
    tokens = torch.from_numpy(batch.token_ids_cpu[rows, :width].astype(np.int64))
    cols = torch.arange(width).unsqueeze(0)
    is_prompt = cols < torch.from_numpy(num_prompt).unsqueeze(1)
    is_output = ~is_prompt & (cols < torch.from_numpy(num_tokens).unsqueeze(1))
    # Scatter into a vocab+1 wide table; masked-out positions go to the spare column.
    spare = torch.full_like(tokens, vocab)
    prompt_mask = torch.zeros((len(rows), vocab + 1), dtype=torch.bool)
    prompt_mask.scatter_(1, torch.where(is_prompt, tokens, spare), True)
    counts = torch.zeros((len(rows), vocab + 1), dtype=torch.int32)
    counts.scatter_add_(
        1, torch.where(is_output, tokens, spare), torch.ones_like(tokens, dtype=torch.int32)
    )
    meta.no_penalties = False
    meta.prompt_mask = prompt_mask[:, :vocab].to(device, non_blocking=True)
    meta.output_counts = counts[:, :vocab].to(device, non_blocking=True)
    meta.presence_penalties = _to_device(presence, device)
    meta.frequency_penalties = _to_device(frequency, device)
    meta.repetition_penalties = _to_device(repetition, device)


def _add_sparse_biases(
    batch: InputBatch, pos: npt.NDArray[np.int64], meta: SamplingMetadata
) -> None:
    """Logit bias and min-tokens suppression as (row, token) index lists.

    Walks only the rows that use these features (usually none).
    """
    device = batch.device
    bias_rows: list[npt.NDArray[np.int64]] = []
    bias_tokens: list[npt.NDArray[np.int64]] = []
    bias_values: list[npt.NDArray[np.float32]] = []
    for r, (tokens, values) in batch.logit_bias.items():
        if pos[r] >= 0:
            bias_rows.append(np.full(len(tokens), pos[r], dtype=np.int64))
            bias_tokens.append(tokens)
            bias_values.append(values)
    stop_rows: list[int] = []
    stop_tokens: list[int] = []
    for r, (min_tokens, stop_ids) in batch.min_tokens.items():
        num_output = int(batch.num_tokens[r] - batch.num_prompt_tokens[r])
        if pos[r] >= 0 and num_output < min_tokens:
            stop_rows.extend([int(pos[r])] * len(stop_ids))
            stop_tokens.extend(stop_ids)
    if bias_rows:
        meta.logit_bias_rows = _to_device(np.concatenate(bias_rows), device)
        meta.logit_bias_tokens = _to_device(np.concatenate(bias_tokens), device)
        meta.logit_bias_values = _to_device(np.concatenate(bias_values), device)
    if stop_rows:
        meta.min_tokens_rows = torch.tensor(stop_rows, dtype=torch.long, device=device)
        meta.min_tokens_tokens = torch.tensor(stop_tokens, dtype=torch.long, device=device)
