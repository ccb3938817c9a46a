"""Post-forward helpers: grammar masks, prompt logprobs, and the `ModelRunnerOutput`.

Everything leaving the runner is plain Python lists (never tensors), so the
output crosses process boundaries as compact msgpack.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from paged.runner.input_batch import InputBatch
from paged.runner.input_prep import PromptLogprobsSpan, StepInputs
from paged.runner.models.interface import CausalLM
from paged.runner.sampler import LogprobsTensors, SamplerOutput, compute_logprobs_tensors
from paged.scheduler.boundary import GrammarOutput, LogprobsLists, ModelRunnerOutput


def packed_mask_bytes(masks: Sequence[Sequence[int]]) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """Rows of int32 mask words -> their little-endian bytes, [rows, 4 * words] uint8.

    Byte k of word w then holds tokens 32w+8k .. 32w+8k+7, lowest bit first,
    whatever the host's byte order.
    """
    try:
        words = np.asarray(masks, dtype="<i4")  # the layout's signed words
    except OverflowError:  # words written as unsigned (bit 31 as 2**31): same bits
        words = np.asarray(masks, dtype=np.int64).astype("<i4")
    return words.view(np.uint8).reshape(len(words), -1)


def unpack_bitmask(mask_bytes: torch.Tensor, vocab: int) -> torch.Tensor:
    """`packed_mask_bytes` output (as a tensor) -> [rows, vocab] bool, True = allowed.

    One shift-and over uint8 on the tensor's device (CPU or CUDA): 4x less
    memory than shifting int32 words by 0..31.
    """
    rows = mask_bytes.shape[0]
    as_bytes = mask_bytes.view(rows, -1)
    shifts = torch.arange(8, dtype=torch.uint8, device=mask_bytes.device)
    bits = ((as_bytes.unsqueeze(-1) >> shifts) & 1).view(rows, -1)
    if bits.shape[1] < vocab:
        raise ValueError(
            f"grammar_output: bitmask covers {bits.shape[1]} tokens, vocabulary has {vocab}"
        )
    return bits[:, :vocab].bool()


def apply_grammar_bitmask(
    logits: torch.Tensor, sampling_req_ids: Sequence[str], grammar_output: GrammarOutput
) -> torch.Tensor:
    """Mask to -inf, in place, every token a request's packed bitmask disallows.

    Bit j of word w allows token 32w+j. Only the first row per request is used
    (no draft tokens are sampled here). `logits` are this step's, owned by the
    caller, so they are overwritten rather than copied (vLLM masks in place too).
    """
    ids = grammar_output.structured_output_request_ids
    if len(ids) != len(grammar_output.grammar_bitmask):
        raise ValueError(
            f"grammar_output: {len(ids)} request ids but {len(grammar_output.grammar_bitmask)} "
            "bitmask rows"
        )
    position = {req_id: i for i, req_id in enumerate(sampling_req_ids)}
    rows: list[int] = []
    masks: list[list[int]] = []
    seen: set[int] = set()
    for req_id, mask in zip(ids, grammar_output.grammar_bitmask, strict=True):
        row = position.get(req_id)
        if row is not None and row not in seen:  # first row: no drafts here
            seen.add(row)
            rows.append(row)
            masks.append(mask)
    if not rows:
        return logits
    mask_bytes = torch.from_numpy(packed_mask_bytes(masks)).to(logits.device)
    disallowed = ~unpack_bitmask(mask_bytes, logits.shape[-1])
    if rows == list(range(logits.shape[0])):  # every row constrained, in order
        return logits.masked_fill_(disallowed, float("-inf"))
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits[index] = logits[index].masked_fill(disallowed, float("-inf"))
    return logits


def _to_lists(t: LogprobsTensors, start: int, end: int, width: int) -> LogprobsLists:
    return LogprobsLists(
        token_ids=t.token_ids[start:end, :width].tolist(),
        logprobs=t.logprobs[start:end, :width].tolist(),
        ranks=t.ranks[start:end].tolist(),
    )


def prompt_logprobs(
    model: CausalLM, hidden: torch.Tensor, spans: list[PromptLogprobsSpan]
) -> dict[str, LogprobsLists]:
    """Logprobs of the prompt tokens this step predicts, one `LogprobsLists` per request."""
    if not spans:
        return {}
    index = torch.cat([torch.arange(s.token_start, s.token_start + s.count) for s in spans]).to(
        hidden.device
    )
    logprobs = model.compute_logits(hidden[index]).to(torch.float32).log_softmax(dim=-1)
    targets = torch.tensor(
        [t for s in spans for t in s.target_token_ids], dtype=torch.long, device=hidden.device
    )
    top = max(s.num_logprobs for s in spans)
    tensors = compute_logprobs_tensors(logprobs, top, targets)
    out: dict[str, LogprobsLists] = {}
    start = 0
    for s in spans:
        out[s.req_id] = _to_lists(tensors, start, start + s.count, 1 + s.num_logprobs)
        start += s.count
    return out


def build_output(
    inputs: StepInputs,
    sampled: list[int],
    sampler_output: SamplerOutput | None,
    batch: InputBatch,
    prompt_lps: dict[str, LogprobsLists],
) -> ModelRunnerOutput:
    """Assemble the step's output in batch order (partial prefills get no token)."""
    sampled_per_req: list[list[int]] = [[] for _ in inputs.req_ids]
    logprobs: dict[str, LogprobsLists] = {}
    nans: dict[str, int] = {}
    if sampler_output is not None:
        num_nans = sampler_output.num_nans.tolist()
        for i, (row, token) in enumerate(zip(inputs.sampling_rows.tolist(), sampled, strict=True)):
            req_id = inputs.req_ids[row]
            sampled_per_req[row] = [token]
            if num_nans[i]:
                nans[req_id] = int(num_nans[i])
            k = batch.num_logprobs.get(req_id)
            if k is not None and sampler_output.logprobs is not None:
                logprobs[req_id] = _to_lists(sampler_output.logprobs, i, i + 1, 1 + k)
    return ModelRunnerOutput(
        req_ids=list(inputs.req_ids),
        sampled_token_ids=sampled_per_req,
        logprobs=logprobs,
        prompt_logprobs=prompt_lps,
        num_nans_in_logits=nans,
    )
