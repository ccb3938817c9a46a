"""PoolingStep: hidden states kept across prefill chunks, pooled on the last one only."""

from __future__ import annotations

import struct

import msgspec
import numpy as np
import pytest
import torch

from paged.runner.input_prep import StepInputs
from paged.runner.pooling import PoolerConfig, build_pooler, load_pooler_config
from paged.runner.pooling_step import PoolingStep
from paged.scheduler.boundary import NewRequestData, PoolerOutput, SchedulerOutput
from paged.scheduler.pooling_params import PoolingParams
from paged.scheduler.sampling_params import SamplingParams

H = 8
_HF = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}


def _step(pooling: str = "MEAN") -> PoolingStep:
    override = PoolerConfig.from_json({"seq_pooling_type": pooling})
    config = load_pooler_config(None, _HF, override, "embed")
    return PoolingStep(build_pooler(config, H, {}, _HF), H)


def _new(rid: str, n: int, task: str | None = "embed") -> NewRequestData:
    return NewRequestData(
        req_id=rid,
        prompt_token_ids=list(range(1, n + 1)),
        sampling_params=SamplingParams(),
        block_ids=([0],),
        num_computed_tokens=0,
        pooling_params=None if task is None else PoolingParams(task=task, use_activation=True),
    )


def _inputs(req_ids: list[str], num_sched: list[int], sampling_rows: list[int]) -> StepInputs:
    total = sum(num_sched)
    rows = np.array(sampling_rows, dtype=np.int64)
    last = np.cumsum(num_sched)[rows] - 1 if len(rows) else np.zeros(0, dtype=np.int64)
    return StepInputs(
        input_ids=torch.zeros(total, dtype=torch.int64),
        positions=torch.zeros(total, dtype=torch.int64),
        group_metadata=[],
        num_tokens=total,
        req_ids=req_ids,
        sampling_rows=rows,
        logits_indices=torch.from_numpy(np.asarray(last, dtype=np.int64)),
        num_scheduled=np.array(num_sched, dtype=np.int32),
    )


def _vector(out: PoolerOutput) -> torch.Tensor:
    values = struct.unpack(f"<{len(out.data) // 4}f", out.data)
    return torch.tensor(values).reshape(out.shape)


def test_chunked_prefill_pools_once_with_every_chunk_in_place() -> None:
    torch.manual_seed(0)
    hidden = torch.randn(10, H)
    expected = torch.nn.functional.normalize(hidden.mean(dim=0), dim=-1)
    step = _step("MEAN")
    step.update(SchedulerOutput(scheduled_new_reqs=[_new("p", 10)]))
    # Chunk 1: positions 0-3, no sampling row (a partial prefill).
    first = step.split(_inputs(["p"], [4], []))
    assert first.finishing_rows == []
    assert step.collect(first.inputs, hidden[:4], np.array([0]), []) == {}
    # Chunk 2: positions 4-9 next to a generation request "g" (row 0, decoding).
    inputs = _inputs(["g", "p"], [1, 6], [0, 1])
    split = step.split(inputs)
    assert split.finishing_rows == [1]
    assert split.inputs.sampling_rows.tolist() == [0]  # the pooling row does not sample
    assert split.inputs.logits_indices.tolist() == [0]
    step_hidden = torch.cat([torch.zeros(1, H), hidden[4:]])
    pooled = step.collect(split.inputs, step_hidden, np.array([5, 4]), split.finishing_rows)
    assert set(pooled) == {"p"}
    torch.testing.assert_close(_vector(pooled["p"]), expected, atol=1e-6, rtol=0)


def test_recomputed_chunk_overwrites_and_whole_prompt_needs_no_buffer() -> None:
    torch.manual_seed(1)
    hidden = torch.randn(6, H)
    step = _step("MEAN")
    step.update(SchedulerOutput(scheduled_new_reqs=[_new("p", 6)]))
    step.collect(_inputs(["p"], [3], []), torch.full((3, H), 9.0), np.array([0]), [])
    # Preempted and recomputed from 0 in one step: the stale rows are replaced.
    split = step.split(_inputs(["p"], [6], [0]))
    pooled = step.collect(split.inputs, hidden, np.array([0]), split.finishing_rows)
    expected = torch.nn.functional.normalize(hidden.mean(dim=0), dim=-1)
    torch.testing.assert_close(_vector(pooled["p"]), expected, atol=1e-6, rtol=0)


def test_finished_requests_are_forgotten_and_generation_rows_untouched() -> None:
    step = _step("LAST")
    step.update(SchedulerOutput(scheduled_new_reqs=[_new("p", 4), _new("g", 3, task=None)]))
    assert step.is_pooling("p") and not step.is_pooling("g")
    inputs = _inputs(["g"], [1], [0])
    assert step.split(inputs).inputs is inputs
    step.update(SchedulerOutput(finished_req_ids=["p"]))
    assert not step.is_pooling("p")


def test_pooling_request_without_task_is_refused() -> None:
    step = _step()
    with pytest.raises(ValueError, match="without a task"):
        new = msgspec.structs.replace(_new("p", 3), pooling_params=PoolingParams())
        step.update(SchedulerOutput(scheduled_new_reqs=[new]))
