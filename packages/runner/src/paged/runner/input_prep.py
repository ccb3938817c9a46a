"""Turn the persistent batch + this step's token counts into model inputs (vLLM `_prepare_inputs`).

For R requests with q_r scheduled tokens each (T = sum q_r), in batch order:

    req_indices      [0,0,0, 1, 2,2]                 row of each token (np.repeat)
    query_start_loc  [0, 3, 4, 6]                    cumsum with a leading 0
    positions        num_computed[row] + offset      offset = 0..q_r-1 within the request
    input_ids        token_ids[row, position]        one flat gather
    seq_lens         num_computed + q_r
    slot_mapping     block_table[row, pos // B] * B + pos % B

The block table copies (one per KV cache group) are issued first so they
overlap the CPU work after them (on CUDA; on CPU the "copy" is free). Every
group gets its own slot mapping and metadata; the token layout is shared.
A request samples when this step reaches the end of its known tokens; a
partial prefill chunk does not.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

from paged.runner.attention.backends import AttentionMetadataBuilder
from paged.runner.attention.metadata import AttentionMetadata
from paged.runner.buffers import CpuGpuBuffer
from paged.runner.input_batch import InputBatch


@dataclass
class PromptLogprobsSpan:
    """Prompt positions of one request computed this step whose next token is a prompt token."""

    req_id: str
    token_start: int  # index into this step's flat tokens
    count: int
    num_logprobs: int
    target_token_ids: list[int]


@dataclass
class StepInputs:
    """Everything `execute_model` needs to run the model and later sample."""

    input_ids: torch.Tensor  # [T] int64, device
    positions: torch.Tensor  # [T] int64, device
    # One per KV cache group (hybrid models have several): the same token
    # layout, each group's own block table and slot mapping.
    group_metadata: list[AttentionMetadata]
    num_tokens: int
    req_ids: list[str]  # batch order
    sampling_rows: npt.NDArray[np.int64]  # batch rows that sample
    logits_indices: torch.Tensor  # [S] token index (into T) whose hidden state is sampled
    num_scheduled: npt.NDArray[np.int32]
    prompt_logprobs: list[PromptLogprobsSpan] = field(default_factory=list)
    # Speculative decoding: drafted tokens per batch row (None: no drafts this
    # step). A sampling row with k drafts has k + 1 entries in logits_indices.
    num_drafts: npt.NDArray[np.int64] | None = None

    @property
    def attn_metadata(self) -> AttentionMetadata:
        """KV cache group 0's metadata: the whole step's, for single-group models."""
        return self.group_metadata[0]

    @property
    def is_uniform_decode(self) -> bool:
        """Every request computes exactly one token and samples it (CUDA-graph friendly)."""
        n = len(self.req_ids)
        return (
            n > 0
            and self.num_tokens == n
            and len(self.sampling_rows) == n
            and not self.prompt_logprobs
        )


class InputBuffers:
    """Preallocated host/device buffers for one step's flat inputs."""

    def __init__(self, max_num_tokens: int, max_num_reqs: int, device: torch.device) -> None:
        self.input_ids = CpuGpuBuffer(max_num_tokens, dtype=torch.int64, device=device)
        self.positions = CpuGpuBuffer(max_num_tokens, dtype=torch.int64, device=device)
        self.query_start_loc = CpuGpuBuffer(max_num_reqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = CpuGpuBuffer(max_num_reqs, dtype=torch.int32, device=device)
        self.arange = np.arange(max(max_num_tokens, max_num_reqs) + 1, dtype=np.int64)


def prepare_inputs(
    batch: InputBatch,
    num_scheduled_tokens: dict[str, int],
    buffers: InputBuffers,
    builder: AttentionMetadataBuilder,
    num_drafts: npt.NDArray[np.int64] | None = None,
) -> StepInputs:
    """Fill `buffers` for this step and return the device views plus sampling bookkeeping.

    `num_drafts` (speculative decoding): drafted tokens per batch row, already
    written after the row's known tokens; they count as known for this step.
    """
    req_ids = batch.req_ids
    num_reqs = len(req_ids)
    tables = list(batch.block_table.block_tables)  # one per KV cache group
    tables_gpu = [t.commit_block_table(num_reqs) for t in tables]  # overlap the CPU work below

    num_sched = np.fromiter(
        (num_scheduled_tokens[r] for r in req_ids), dtype=np.int32, count=num_reqs
    )
    total = int(num_sched.sum())
    if total > len(buffers.input_ids.np):
        raise ValueError(
            f"scheduler_output: {total} tokens exceed max_num_batched_tokens="
            f"{len(buffers.input_ids.np)}"
        )
    rows = buffers.arange[:num_reqs]
    computed = batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
    seq_lens = computed + num_sched
    known = batch.num_tokens[:num_reqs]
    if num_drafts is not None:
        known = known + num_drafts[:num_reqs]
    if (num_sched <= 0).any() or (seq_lens > known).any():
        bad = int(np.argmax((num_sched <= 0) | (seq_lens > known)))
        raise ValueError(
            f"scheduler_output: request {req_ids[bad]!r} schedules {int(num_sched[bad])} tokens "
            f"from {int(computed[bad])} computed, but only {int(known[bad])} tokens are known"
        )

    cu = np.cumsum(num_sched, dtype=np.int64)
    req_indices = np.repeat(rows, num_sched).astype(np.int32)
    offsets = buffers.arange[:total] - np.repeat(cu - num_sched, num_sched)
    positions = buffers.positions.np[:total]
    np.add(computed[req_indices], offsets, out=positions)
    flat = req_indices.astype(np.int64) * batch.max_model_len + positions
    buffers.input_ids.np[:total] = batch.token_ids_cpu.reshape(-1)[flat]

    slot_mappings = []
    for table in tables:
        table.compute_slot_mapping(req_indices, positions)
        slot_mappings.append(table.commit_slot_mapping(total))
    qsl = buffers.query_start_loc.np
    qsl[0] = 0
    qsl[1 : num_reqs + 1] = cu
    buffers.seq_lens.np[:num_reqs] = seq_lens

    samples = seq_lens == known
    sampling_rows = rows[samples].astype(np.int64)
    last = cu[samples] - 1
    if num_drafts is not None and num_drafts.any():
        # Every drafted position of a sampling row is scored, then the bonus one.
        width = num_drafts[:num_reqs][samples] + 1
        last = np.repeat(last - width + 1, width) + (
            np.arange(int(width.sum())) - np.repeat(np.cumsum(width) - width, width)
        )
    logits_indices = torch.from_numpy(last).to(batch.device, non_blocking=True)
    query_start_loc = buffers.query_start_loc.copy_to_gpu(num_reqs + 1)
    seq_lens_gpu = buffers.seq_lens.copy_to_gpu(num_reqs)
    group_metadata = [
        builder.build(
            num_reqs=num_reqs,
            num_actual_tokens=total,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens_gpu,
            block_table=table_gpu,
            slot_mapping=slot_mapping,
            max_query_len=int(num_sched.max()) if num_reqs else 0,
            max_seq_len=int(seq_lens.max()) if num_reqs else 0,
        )
        for table_gpu, slot_mapping in zip(tables_gpu, slot_mappings, strict=True)
    ]
    return StepInputs(
        input_ids=buffers.input_ids.copy_to_gpu(total),
        positions=buffers.positions.copy_to_gpu(total),
        group_metadata=group_metadata,
        num_tokens=total,
        req_ids=req_ids,
        sampling_rows=sampling_rows,
        logits_indices=logits_indices,
        num_scheduled=num_sched,
        prompt_logprobs=_prompt_logprob_spans(batch, req_ids, computed, num_sched, cu),
        num_drafts=num_drafts[:num_reqs] if num_drafts is not None else None,
    )


def _prompt_logprob_spans(
    batch: InputBatch,
    req_ids: list[str],
    computed: npt.NDArray[np.int64],
    num_sched: npt.NDArray[np.int32],
    cu: npt.NDArray[np.int64],
) -> list[PromptLogprobsSpan]:
    spans: list[PromptLogprobsSpan] = []
    for req_id, k in batch.num_prompt_logprobs.items():
        row = batch.req_id_to_index[req_id]
        n_prompt = int(batch.num_prompt_tokens[row])
        start = int(computed[row])
        # Position p predicts token p + 1; only prompt targets count.
        end = min(start + int(num_sched[row]), n_prompt - 1)
        if end <= start:
            continue
        token_start = int(cu[row] - num_sched[row])
        targets = batch.token_ids_cpu[row, start + 1 : end + 1].tolist()
        spans.append(PromptLogprobsSpan(req_id, token_start, end - start, k, targets))
    return spans
