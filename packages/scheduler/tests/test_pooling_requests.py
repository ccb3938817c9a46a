"""Pooling requests through the scheduler: prefill only, STOP, blocks freed, chunking, cache."""

from __future__ import annotations

import struct

import msgspec

from paged.scheduler import EngineCoreRequest, FinishReason, PoolingParams
from paged.scheduler.boundary import ModelRunnerOutput, PoolerOutput, SchedulerOutput
from paged.scheduler.testing import (
    FakeRunner,
    free_blocks,
    make_request,
    make_scheduler,
    run_to_completion,
    tokens_of,
)


def _pooling(rid: str, prompt: list[int] | int, task: str = "embed") -> EngineCoreRequest:
    params = PoolingParams(task=task, skip_reading_prefix_cache=task.startswith("token_"))
    return msgspec.structs.replace(make_request(rid, prompt), pooling_params=params)


def test_pooling_request_finishes_after_prefill_with_stop_and_frees_blocks() -> None:
    sched = make_scheduler(num_blocks=32)
    before = free_blocks(sched)
    sched.add_request(_pooling("p", 10))
    outs = run_to_completion(sched)["p"]
    assert len(outs) == 1  # one final output, no decode steps
    final = outs[0]
    assert final.finish_reason is FinishReason.STOP
    assert final.new_token_ids == []
    assert final.pooling_output is not None
    assert struct.unpack("<f", final.pooling_output.data)[0] == float(sum(range(1, 11)))
    assert free_blocks(sched) == before
    assert not sched.has_requests()


def test_pooling_prefill_is_chunked_under_the_token_budget() -> None:
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=8, max_model_len=64)
    runner = FakeRunner()
    sched.add_request(_pooling("p", 20))
    steps: list[int] = []
    outs = run_to_completion(
        sched, runner, on_step=lambda _s, so: steps.append(so.num_scheduled_tokens.get("p", 0))
    )
    assert [n for n in steps if n] == [8, 8, 4]
    assert runner.pooled_positions["p"] == list(range(20))
    assert outs["p"][-1].finish_reason is FinishReason.STOP
    # No output before the last chunk: partial chunks report nothing.
    assert len(outs["p"]) == 1


def test_pooling_and_generation_share_a_step() -> None:
    sched = make_scheduler(num_blocks=64)
    sched.add_request(make_request("g", 6, max_tokens=3))
    sched.add_request(_pooling("p", 7))
    firsts: list[SchedulerOutput] = []
    outs = run_to_completion(sched, on_step=lambda _s, so: firsts.append(so))
    assert set(firsts[0].num_scheduled_tokens) == {"g", "p"}
    assert firsts[0].scheduled_new_reqs[1].pooling_params is not None
    assert len(tokens_of(outs["g"])) == 3
    assert outs["p"][-1].pooling_output is not None


def test_embed_reads_prefix_cache_but_token_tasks_do_not() -> None:
    # vllm/pooling_params.py:198-205: token_embed/token_classify skip cache reads.
    sched = make_scheduler(num_blocks=64)
    sched.add_request(_pooling("a", 17))
    run_to_completion(sched)
    sched.add_request(_pooling("b", 17))
    so = sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 16
    sched.update_from_output(so, FakeRunner().execute(so))
    run_to_completion(sched)
    sched.add_request(_pooling("c", 17, task="token_embed"))
    so = sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0


def test_pooler_output_ignored_for_a_generation_request() -> None:
    sched = make_scheduler(num_blocks=32)
    sched.add_request(make_request("g", 4, max_tokens=2))
    so = sched.schedule()
    bogus = PoolerOutput(data=struct.pack("<f", 1.0), shape=[1])
    mro = ModelRunnerOutput(req_ids=["g"], sampled_token_ids=[[5]], pooler_output={"g": bogus})
    outs = [o for eco in sched.update_from_output(so, mro).values() for o in eco.outputs]
    assert outs[0].finish_reason is None
    assert outs[0].pooling_output is None


def test_old_engine_core_request_without_pooling_field_decodes() -> None:
    old = make_request("r", 3)
    data = msgspec.msgpack.encode(old)
    assert msgspec.msgpack.decode(data, type=EngineCoreRequest).pooling_params is None
    new = _pooling("p", 3)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(new), type=EngineCoreRequest)
    assert back.pooling_params == new.pooling_params
