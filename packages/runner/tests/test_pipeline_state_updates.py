"""update_states on pipeline stages: who takes the scheduler's step tokens (vLLM's PP rule)."""

from __future__ import annotations

import pytest

from paged.runner.input_batch import CachedRequestState, InputBatch
from paged.runner.pipeline.stage import PipelineStage
from paged.runner.state_updates import update_states
from paged.scheduler.boundary import CachedRequestData, NewRequestData, SchedulerOutput
from paged.scheduler.sampling_params import SamplingParams

PROMPT = [10, 11, 12, 13, 14]


def _cached(tokens: list[int], computed: int, outputs: int) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData(
            ["a"], [False], [tokens], [None], [computed], [outputs]
        ),
        num_scheduled_tokens={"a": len(tokens)},
        total_num_scheduled_tokens=len(tokens),
    )


@pytest.mark.parametrize("pp_rank", [0, 1])
def test_first_stage_learns_sampled_tokens_last_stage_keeps_its_own(pp_rank: int) -> None:
    stage = PipelineStage(pp_rank=pp_rank, pp_size=2)
    batch = InputBatch(4, 32, 16, "cpu", 128, block_sizes=[4])
    requests: dict[str, CachedRequestState] = {}
    new = NewRequestData("a", PROMPT, SamplingParams(temperature=0.0), ([1, 2],), 0)
    first = SchedulerOutput(
        scheduled_new_reqs=[new],
        num_scheduled_tokens={"a": 3},
        total_num_scheduled_tokens=3,
    )
    update_states(requests, batch, first, batch.device, stage=stage)
    # Second chunk: the step tokens are prompt tokens both stages already hold.
    update_states(requests, batch, _cached([13, 14], 3, 0), batch.device, stage=stage)
    assert requests["a"].output_token_ids == []
    if stage.is_last:
        requests["a"].output_token_ids.append(77)  # what sample_tokens does on this stage
        batch.append_token_ids(batch.req_id_to_index["a"], [77])
    # Decode: the step token is the one the last stage sampled.
    update_states(requests, batch, _cached([77], 5, 1), batch.device, stage=stage)
    assert requests["a"].output_token_ids == [77]
    row = batch.req_id_to_index["a"]
    assert batch.token_ids_cpu[row, : batch.num_tokens[row]].tolist() == [*PROMPT, 77]
    batch.check_integrity()
