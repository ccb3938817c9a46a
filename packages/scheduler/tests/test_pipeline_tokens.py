"""Pipeline parallelism: running requests' step tokens travel in new_token_ids (vLLM's use_pp)."""

from __future__ import annotations

import pytest

from paged.scheduler.boundary import ModelRunnerOutput, SchedulerOutput
from paged.scheduler.testing import make_request, make_scheduler


def _sample(so: SchedulerOutput, token: int) -> ModelRunnerOutput:
    ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=[[token] for _ in ids])


@pytest.mark.parametrize("pp", [1, 2])
def test_step_tokens_sent_only_with_pipeline_parallelism(pp: int) -> None:
    sched = make_scheduler(max_num_batched_tokens=6, pipeline_parallel_size=pp)
    sched.add_request(make_request("a", [10, 11, 12, 13, 14, 15, 16, 17], max_tokens=4))
    first = sched.schedule()  # chunk [0, 6)
    assert first.num_scheduled_tokens == {"a": 6}
    sched.update_from_output(first, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[]]))
    second = sched.schedule()  # chunk [6, 8), samples
    cached = second.scheduled_cached_reqs
    assert cached.req_ids == ["a"] and cached.num_computed_tokens == [6]
    assert cached.new_token_ids == ([[16, 17]] if pp > 1 else [[]])
    sched.update_from_output(second, _sample(second, 99))
    third = sched.schedule()  # decode of the sampled token
    assert third.scheduled_cached_reqs.new_token_ids == ([[99]] if pp > 1 else [[]])
    assert third.scheduled_cached_reqs.num_computed_tokens == [8]


def test_request_in_flight_is_not_scheduled_again() -> None:
    # With micro-batches in flight, a decode waits for its sampled token.
    sched = make_scheduler(max_num_batched_tokens=16, pipeline_parallel_size=2)
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=4))
    first = sched.schedule()
    assert first.num_scheduled_tokens == {"a": 3}
    assert sched.schedule().total_num_scheduled_tokens == 0  # "a" is in flight
    sched.add_request(make_request("b", [4, 5], max_tokens=4))
    assert sched.schedule().num_scheduled_tokens == {"b": 2}  # another request fills the stage


def test_pipeline_parallel_size_is_validated() -> None:
    with pytest.raises(ValueError, match="pipeline_parallel_size must be >= 1"):
        make_scheduler(pipeline_parallel_size=0)
