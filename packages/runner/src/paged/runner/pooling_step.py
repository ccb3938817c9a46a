"""`PoolingStep`: the pooling requests of a decoder model's step loop (held by `ModelRunner`).

vLLM 0.33's GPU runner pools in `_pool` (vllm/v1/worker/gpu_model_runner.py)
from the step's hidden states; a pooling request whose prefill is chunked
gets its pooled output only on the last chunk. paged does the same with a
small component so the runner stays one class:

    update(scheduler_output)   learn new pooling requests, forget finished ones
    split(inputs)              the step's inputs with pooling rows taken out of
                               sampling (they never sample), and the rows whose
                               prefill ends this step
    collect(inputs, hidden)    copy this step's final hidden states (after the
                               model's final norm, before the LM head) of every
                               pooling request into its prompt-length buffer;
                               pool the requests whose prefill ended; their
                               results as `PoolerOutput` (float32 bytes + shape)

Chunked prefill: each chunk's rows land at their prompt positions, so a
request preempted and recomputed simply overwrites them. Prompt positions a
prefix-cache hit skipped stay zero: vLLM only reads the prefix cache for
pooling types that look at the last token alone (LAST pooling; ALL/STEP and
token tasks set `skip_reading_prefix_cache`, MEAN/CLS models disable prefix
caching, vllm/config/model.py:2239-2280), and the engine applies that rule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from paged.runner.input_prep import StepInputs
from paged.runner.pooling import Pooler, PoolingInput
from paged.scheduler.boundary import PoolerOutput, SchedulerOutput
from paged.scheduler.pooling_params import PoolingParams


@dataclass
class _PoolingRequest:
    params: PoolingParams
    prompt_token_ids: list[int]
    # [n_prompt, hidden] float32 on CPU, filled chunk by chunk; None until the
    # first chunk runs (a one-chunk prefill never allocates it).
    hidden: torch.Tensor | None = None


@dataclass(frozen=True)
class PoolingSplit:
    """`split`'s answer: inputs without pooling rows in sampling, and who pools now."""

    inputs: StepInputs
    finishing_rows: list[int]  # batch rows whose prefill ends this step (pooled now)


def to_pooler_output(tensor: torch.Tensor) -> PoolerOutput:
    """A pooled tensor as the msgspec-safe float32 bytes + shape the scheduler carries."""
    array = tensor.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
    return PoolerOutput(data=array.astype("<f4", copy=False).tobytes(), shape=list(array.shape))


class PoolingStep:
    """Pooling requests of one runner (see the module docstring)."""

    def __init__(self, pooler: Pooler, hidden_size: int) -> None:
        self.pooler = pooler
        self.hidden_size = hidden_size
        self.requests: dict[str, _PoolingRequest] = {}

    def update(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            if new.pooling_params is None:
                continue
            if new.pooling_params.task is None:
                raise ValueError(
                    f"scheduler_output: pooling request {new.req_id!r} reached the runner "
                    "without a task"
                )
            self.requests[new.req_id] = _PoolingRequest(
                new.pooling_params, list(new.prompt_token_ids)
            )

    def is_pooling(self, req_id: str) -> bool:
        return req_id in self.requests

    def split(self, inputs: StepInputs) -> PoolingSplit:
        """Take pooling rows out of sampling; they pool instead (their last chunk)."""
        if not self.requests or len(inputs.sampling_rows) == 0:
            return PoolingSplit(inputs, [])
        if inputs.num_drafts is not None:
            raise ValueError("pooling requests cannot run with speculative decoding")
        rows = inputs.sampling_rows
        pooling = np.fromiter(
            (inputs.req_ids[int(r)] in self.requests for r in rows), dtype=bool, count=len(rows)
        )
        if not pooling.any():
            return PoolingSplit(inputs, [])
        keep: npt.NDArray[np.bool_] = ~pooling
        kept = dataclasses.replace(
            inputs,
            sampling_rows=rows[keep],
            logits_indices=inputs.logits_indices[
                torch.from_numpy(keep).to(inputs.logits_indices.device)
            ],
        )
        return PoolingSplit(kept, [int(r) for r in rows[pooling]])

    def collect(
        self,
        inputs: StepInputs,
        hidden: torch.Tensor,
        computed_before: npt.NDArray[np.int32] | Sequence[int],
        finishing_rows: list[int],
    ) -> dict[str, PoolerOutput]:
        """Keep this step's hidden rows of pooling requests; pool those that finish.

        `computed_before[row]`: the request's computed tokens before this step
        (the first prompt position this step computes).
        """
        if not self.requests:
            return {}
        finishing = set(finishing_rows)
        starts = np.cumsum(inputs.num_scheduled, dtype=np.int64) - inputs.num_scheduled
        to_pool: list[tuple[str, PoolingInput]] = []
        for row, req_id in enumerate(inputs.req_ids):
            req = self.requests.get(req_id)
            if req is None:
                continue
            n = int(inputs.num_scheduled[row])
            token_start = int(starts[row])
            position = int(computed_before[row])
            rows = hidden[token_start : token_start + n]
            n_prompt = len(req.prompt_token_ids)
            if position == 0 and n == n_prompt and req.hidden is None:
                states = rows.to(device="cpu", dtype=torch.float32)  # the whole prompt at once
            else:
                if req.hidden is None:
                    req.hidden = torch.zeros(n_prompt, self.hidden_size, dtype=torch.float32)
                req.hidden[position : position + n] = rows.to(device="cpu", dtype=torch.float32)
                states = req.hidden
            if row in finishing:
                to_pool.append((req_id, self._pooling_input(req, states)))
        if not to_pool:
            return {}
        pooled = self.pooler([inp for _, inp in to_pool])
        out: dict[str, PoolerOutput] = {}
        for (req_id, _), tensor in zip(to_pool, pooled, strict=True):
            out[req_id] = to_pooler_output(tensor)
            self.requests[req_id].hidden = None  # done; the buffer is not needed again
        return out

    @staticmethod
    def _pooling_input(req: _PoolingRequest, states: torch.Tensor) -> PoolingInput:
        params = req.params
        assert params.task is not None  # checked in update()
        return PoolingInput(
            hidden_states=states,
            prompt_token_ids=req.prompt_token_ids,
            task=params.task,
            dimensions=params.dimensions,
            use_activation=params.use_activation,
            step_tag_id=params.step_tag_id,
            returned_token_ids=params.returned_token_ids,
        )
