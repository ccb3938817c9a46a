"""Conformance with vLLM v1's scheduler: the scenarios of vLLM's scheduler tests.

Requests, prompts and sizes follow vLLM's test helpers (request i has the
prompt `[i] * num_tokens`, block size 16, EOS 50256) so that the numbers
below are the ones vLLM's scheduler produces. The model is replaced by
hand-written `ModelRunnerOutput`s, step by step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from paged.kvcache import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from paged.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from paged.scheduler.boundary import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    ModelRunnerOutput,
    SchedulerOutput,
)
from paged.scheduler.config import SchedulerConfig
from paged.scheduler.request import Request, RequestStatus
from paged.scheduler.sampling_params import SamplingParams
from paged.scheduler.scheduler import Scheduler
from paged.scheduler.stop import check_stop

EOS = 50256


def create_scheduler(
    *,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 8192,
    enable_prefix_caching: bool = True,
    long_prefill_token_threshold: int = 0,
    disable_chunked_mm_input: bool = False,
    enable_chunked_prefill: bool = True,
    num_blocks: int = 10000,
    block_size: int = 16,
    max_model_len: int | None = None,
    policy: str = "fcfs",
    max_tokens_per_mm_item: int = 0,
) -> Scheduler:
    config = SchedulerConfig(
        max_model_len=max_model_len or max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=enable_chunked_prefill,
        long_prefill_token_threshold=long_prefill_token_threshold,
        disable_chunked_mm_input=disable_chunked_mm_input,
        policy=policy,  # type: ignore[arg-type]
    )
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype="float32")
    kv = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    return Scheduler(
        config,
        kv,
        block_size,
        enable_caching=enable_prefix_caching,
        hash_seed=0,
        max_tokens_per_mm_item=max_tokens_per_mm_item,
    )


def create_requests(
    num_requests: int,
    num_tokens: int = 10,
    *,
    mm_positions: list[list[PlaceholderRange]] | None = None,
    max_tokens: int = 16,
    starting_idx: int = 0,
    same_prompt: bool = False,
    priorities: Sequence[int] | None = None,
    arrival_times: Sequence[float] | None = None,
    **params: Any,
) -> list[EngineCoreRequest]:
    reqs = []
    for i in range(num_requests):
        idx = i + starting_idx
        mm = None
        if mm_positions is not None:
            mm = [
                MultiModalFeatureSpec(modality="image", identifier=f"hash{idx}_{j}", mm_position=p)
                for j, p in enumerate(mm_positions[i])
            ]
        reqs.append(
            EngineCoreRequest(
                request_id=f"{idx}",
                prompt_token_ids=[0 if same_prompt else idx] * num_tokens,
                sampling_params=SamplingParams(max_tokens=max_tokens, **params),
                eos_token_id=EOS,
                arrival_time=arrival_times[i] if arrival_times else float(idx),
                priority=priorities[i] if priorities else 0,
                mm_features=mm,
            )
        )
    return reqs


def mro(so: SchedulerOutput, sampled: dict[str, list[int]]) -> ModelRunnerOutput:
    """The runner's answer: `sampled` tokens per request, nothing for the others."""
    ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=[sampled.get(r, []) for r in ids])


def outputs_by_id(results: dict[int, Any]) -> dict[str, EngineCoreOutput]:
    return {o.request_id: o for eco in results.values() for o in eco.outputs}


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
@pytest.mark.parametrize("prompt_logprobs", [None, 5])
def test_schedule_all_new_requests(
    enable_prefix_caching: bool, prompt_logprobs: int | None
) -> None:
    sched = create_scheduler(enable_prefix_caching=enable_prefix_caching)
    requests = create_requests(10, prompt_logprobs=prompt_logprobs)
    for r in requests:
        sched.add_request(r)
    so = sched.schedule()
    assert len(so.scheduled_new_reqs) == 10
    assert not so.scheduled_cached_reqs.req_ids and not so.finished_req_ids
    assert so.num_scheduled_tokens == {r.request_id: 10 for r in requests}
    assert len(sched.waiting) == 0
    assert [r.request_id for r in sched.running] == [r.request_id for r in requests]


def test_add_finish_and_count_requests() -> None:
    sched = create_scheduler()
    requests = create_requests(10)
    for i, r in enumerate(requests):
        sched.add_request(r)
        assert r.request_id in sched.requests
        assert len(sched.waiting) == i + 1
    assert sched.get_num_unfinished_requests() == 10
    sched.schedule()
    for i, r in enumerate(requests):
        sched.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED)
        assert r.request_id not in sched.requests
        assert len(sched.running) == 9 - i
        assert sched.get_num_unfinished_requests() == 9 - i
    # Finished ids go to the runner in the next SchedulerOutput, then are cleared.
    so = sched.schedule()
    assert sorted(so.finished_req_ids) == sorted(r.request_id for r in requests)
    assert sched.schedule().finished_req_ids == []


def test_encoder_budget_trims_chunks_and_skips_a_running_request() -> None:
    sched = create_scheduler(max_num_batched_tokens=1024, max_tokens_per_mm_item=600)
    positions = [[PlaceholderRange(offset=100, length=600)] for _ in range(3)]
    requests = create_requests(3, 800, mm_positions=positions)
    for r in requests:
        sched.add_request(r)
    so = sched.schedule()
    assert len(so.scheduled_new_reqs) == 3 and not so.finished_req_ids
    assert sched.max_num_encoder_input_tokens == 1024
    # r0 whole (its image uses 600 of the 1024 encoder budget); r1 and r2 stop
    # before their image, which no longer fits the encoder budget.
    assert so.num_scheduled_tokens == {"0": 800, "1": 100, "2": 100}
    assert so.scheduled_encoder_inputs == {"0": [0]}
    sched.update_from_output(so, mro(so, {"0": [0]}))
    so = sched.schedule()
    assert len(sched.running) == 3
    assert not so.scheduled_new_reqs and len(so.scheduled_cached_reqs.req_ids) == 2
    # r2 is running but not scheduled: its image does not fit what r1 left.
    assert so.num_scheduled_tokens == {"0": 1, "1": 700}
    assert so.scheduled_encoder_inputs == {"1": [0]}


def test_disabled_mm_chunking_schedules_text_then_the_whole_item() -> None:
    sched = create_scheduler(
        max_num_batched_tokens=1024,
        disable_chunked_mm_input=True,
        max_model_len=2048,
        max_tokens_per_mm_item=800,
    )
    (r,) = create_requests(1, 1200, mm_positions=[[PlaceholderRange(offset=400, length=800)]])
    sched.add_request(r)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"0": 400}  # the text before the image only
    sched.update_from_output(so, mro(so, {}))
    so = sched.schedule()
    assert len(so.scheduled_cached_reqs.req_ids) == 1 and so.num_scheduled_tokens == {"0": 800}
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        create_scheduler(
            max_num_batched_tokens=100, disable_chunked_mm_input=True, max_tokens_per_mm_item=800
        )


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_long_prefill_threshold_chunks_concurrent_prompts(enable_prefix_caching: bool) -> None:
    sched = create_scheduler(
        max_num_batched_tokens=1024,
        long_prefill_token_threshold=400,
        enable_prefix_caching=enable_prefix_caching,
    )
    requests = create_requests(3, 800)
    for r in requests:
        sched.add_request(r)
    so = sched.schedule()
    assert len(so.scheduled_new_reqs) == 3
    assert so.num_scheduled_tokens == {"0": 400, "1": 400, "2": 224}
    sched.update_from_output(so, mro(so, {}))
    so = sched.schedule()
    assert len(sched.running) == 3 and len(so.scheduled_cached_reqs.req_ids) == 3
    assert so.num_scheduled_tokens == {"0": 400, "1": 400, "2": 224}
    sched.update_from_output(so, mro(so, {"0": [0], "1": [0]}))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"0": 1, "1": 1, "2": 800 - 224 - 224}


def test_long_prefill_threshold_ignored_for_a_lone_request() -> None:
    sched = create_scheduler(max_num_batched_tokens=1024, long_prefill_token_threshold=400)
    sched.add_request(create_requests(1, 800)[0])
    assert sched.schedule().num_scheduled_tokens == {"0": 800}


@pytest.mark.parametrize("enable_chunked_prefill", [True, False])
def test_schedule_order_head_of_line(enable_chunked_prefill: bool) -> None:
    sched = create_scheduler(
        max_num_batched_tokens=1024, max_num_seqs=3, enable_chunked_prefill=enable_chunked_prefill
    )
    requests = create_requests(2, 800) + create_requests(2, 10, starting_idx=2)
    for r in requests:
        sched.add_request(r)
    so = sched.schedule()
    if enable_chunked_prefill:
        # The second long prompt gets the rest of the budget as a chunk.
        assert [r.req_id for r in so.scheduled_new_reqs] == ["0", "1"]
        assert so.num_scheduled_tokens == {"0": 800, "1": 224}
    else:
        # It does not fit, and the short prompts behind it are not taken instead.
        assert [r.req_id for r in so.scheduled_new_reqs] == ["0"]


def test_max_num_seqs_caps_admission() -> None:
    sched = create_scheduler(max_num_seqs=2)
    for r in create_requests(3):
        sched.add_request(r)
    so = sched.schedule()
    assert list(so.num_scheduled_tokens) == ["0", "1"] and len(sched.waiting) == 1


def spec_step(
    sched: Scheduler, drafts: dict[str, list[int]], sampled: dict[str, list[int]]
) -> SchedulerOutput:
    sched.update_draft_token_ids(drafts)
    so = sched.schedule()
    assert so.scheduled_spec_decode_tokens == {k: v for k, v in drafts.items() if v}
    sched.update_from_output(so, mro(so, sampled))
    return so


def prefilled(num: int, **params: Any) -> tuple[Scheduler, list[Request]]:
    """A scheduler whose `num` requests have prefilled and sampled token 1."""
    sched = create_scheduler()
    for r in create_requests(num, **params):
        sched.add_request(r)
    so = sched.schedule()
    sched.update_from_output(so, mro(so, {str(i): [1] for i in range(num)}))
    return sched, [sched.requests[str(i)] for i in range(num)]


def test_stop_on_eos_inside_a_speculative_step() -> None:
    sched, (r0, r1) = prefilled(2, max_tokens=10)
    so = spec_step(sched, {"0": [], "1": [10]}, {"0": [EOS], "1": [10, 11]})
    assert so.num_scheduled_tokens == {"0": 1, "1": 2}
    assert [r.request_id for r in sched.running] == ["1"]
    assert r0.status is RequestStatus.FINISHED_STOPPED
    assert "0" in sched.finished_req_ids
    assert list(r0.output_token_ids) == [1, EOS]  # the EOS is kept
    assert list(r1.output_token_ids) == [1, 10, 11]


def test_stop_token_inside_accepted_drafts_truncates_the_rest() -> None:
    sched, (r0, r1) = prefilled(2, max_tokens=10, stop_token_ids=[42, 43])
    spec_step(sched, {"0": [10, 42], "1": [13]}, {"0": [10, 42, 12], "1": [13, 14]})
    assert [r.request_id for r in sched.running] == ["1"]
    assert r0.status is RequestStatus.FINISHED_STOPPED and r0.stop_reason == 42
    assert list(r0.output_token_ids) == [1, 10, 42]
    assert list(r1.output_token_ids) == [1, 13, 14]


def test_max_tokens_truncates_accepted_drafts() -> None:
    sched, (r0, r1) = prefilled(2, max_tokens=3)
    spec_step(sched, {"0": [10, 11], "1": []}, {"0": [10, 11, 12], "1": [13]})
    assert [r.request_id for r in sched.running] == ["1"]
    assert r0.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert list(r0.output_token_ids) == [1, 10, 11]
    assert list(r1.output_token_ids) == [1, 13]


def test_ignore_eos_keeps_going_past_eos() -> None:
    sched, (r0,) = prefilled(1, max_tokens=10, ignore_eos=True)
    spec_step(sched, {"0": [EOS, 10]}, {"0": [EOS, 10, 11]})
    assert [r.request_id for r in sched.running] == ["0"] and not r0.is_finished()
    assert list(r0.output_token_ids) == [1, EOS, 10, 11]


def test_stop_token_ids_apply_with_ignore_eos_and_are_reported() -> None:
    sched, (r0,) = prefilled(1, max_tokens=10, ignore_eos=True, stop_token_ids=[7])
    so = sched.schedule()
    results = sched.update_from_output(so, mro(so, {"0": [7]}))
    out = outputs_by_id(results)["0"]
    assert out.new_token_ids == [7] and out.finish_reason is FinishReason.STOP
    assert out.stop_reason == 7 and r0.status is RequestStatus.FINISHED_STOPPED
    assert sched.schedule().finished_req_ids == ["0"]


def test_check_stop_min_tokens() -> None:
    def request(**params: Any) -> Request:
        return Request("0", [0, 1, 2], SamplingParams(**params), EOS, max_model_len=100)

    r = request(max_tokens=20, min_tokens=5)
    r.append_output_token_ids([10, 11, EOS])
    assert check_stop(r, 100) is False
    r.append_output_token_ids([10, 11, 12, 13, 14, EOS])
    assert check_stop(r, 100) is True and r.status is RequestStatus.FINISHED_STOPPED
    r = request(max_tokens=20, min_tokens=0)
    r.append_output_token_ids([10, EOS])
    assert check_stop(r, 100) is True
    r = request(max_tokens=20, min_tokens=5, stop_token_ids=[42])
    r.append_output_token_ids([10, 11, 42])
    assert check_stop(r, 100) is False
    r.append_output_token_ids([10, 11, 12, 13, 14, 42])
    assert check_stop(r, 100) is True and r.stop_reason == 42


def test_preempted_request_still_gets_the_token_sampled_before_preemption() -> None:
    # 10 usable blocks of 16; two 80-token prompts take 5 each.
    sched = create_scheduler(max_num_batched_tokens=100, num_blocks=11, enable_prefix_caching=False)
    r0, r1 = create_requests(2, 80)
    sched.add_request(r0)
    so0 = sched.schedule()
    assert len(so0.num_scheduled_tokens) == 1 and len(so0.scheduled_new_reqs[0].block_ids[0]) == 5
    # A second step is scheduled while the first is still running (pipelining).
    sched.add_request(r1)
    so1 = sched.schedule()
    assert list(so1.num_scheduled_tokens) == ["1"]
    assert len(so1.scheduled_new_reqs[0].block_ids[0]) == 5
    sched.update_from_output(so0, mro(so0, {"0": [0]}))
    # r0's next token needs a sixth block: r1 (the last running) is preempted.
    so2 = sched.schedule()
    assert [r.request_id for r in sched.running] == ["0"]
    assert sched.requests["1"].status is RequestStatus.PREEMPTED
    assert so2.preempted_req_ids == ["1"]
    # r1's token from before its preemption is kept.
    results = sched.update_from_output(so1, mro(so1, {"1": [42]}))
    assert list(sched.requests["1"].output_token_ids) == [42]
    assert outputs_by_id(results)["1"].new_token_ids == [42]
    sched.check_integrity()


def test_preempted_request_that_stops_leaves_the_waiting_queue() -> None:
    sched = create_scheduler(max_num_batched_tokens=100, num_blocks=11, enable_prefix_caching=False)
    r0, r1 = create_requests(2, 80)
    sched.add_request(r0)
    so0 = sched.schedule()
    sched.add_request(r1)
    so1 = sched.schedule()
    sched.update_from_output(so0, mro(so0, {"0": [0]}))
    sched.schedule()
    results = sched.update_from_output(so1, mro(so1, {"1": [EOS]}))
    assert outputs_by_id(results)["1"].finish_reason is FinishReason.STOP
    assert len(sched.waiting) == 0 and "1" not in sched.requests
    sched.check_integrity()


def test_fcfs_preemption_victim_is_the_last_running_and_resumes_first() -> None:
    # 4 usable blocks of 16; two 31-token prompts take 2 blocks each.
    sched = create_scheduler(
        max_num_batched_tokens=200, num_blocks=5, max_num_seqs=3, enable_prefix_caching=False
    )
    a, b = create_requests(2, 31, max_tokens=20)
    sched.add_request(a)
    sched.add_request(b)
    so = sched.schedule()
    sched.update_from_output(so, mro(so, {"0": [100], "1": [100]}))  # 32 tokens each
    (c,) = create_requests(1, 10, starting_idx=2)
    sched.add_request(c)
    so = sched.schedule()  # both decode within their blocks; c does not fit
    assert so.num_scheduled_tokens == {"0": 1, "1": 1}
    sched.update_from_output(so, mro(so, {"0": [100], "1": [100]}))  # 33 tokens each
    so = sched.schedule()
    # "0" needs a third block: "1", last in the running list, is preempted; no
    # admission happens in this step although c's block is now free.
    assert so.preempted_req_ids == ["1"] and so.num_scheduled_tokens == {"0": 1}
    assert not so.scheduled_new_reqs
    waiting = list(sched.waiting)
    assert [r.request_id for r in waiting] == ["1", "2"]
    assert waiting[0].num_computed_tokens == 0 and waiting[0].status is RequestStatus.PREEMPTED
    sched.update_from_output(so, mro(so, {"0": [100]}))
    sched.finish_requests("0", RequestStatus.FINISHED_ABORTED)
    so = sched.schedule()
    # Recomputed from scratch (prompt plus its two output tokens), ahead of c.
    cached = so.scheduled_cached_reqs
    assert cached.req_ids == ["1"] and cached.resumed_from_preemption == [True]
    assert cached.new_token_ids == [[100, 100]]
    assert [r.req_id for r in so.scheduled_new_reqs] == ["2"]
    assert so.num_scheduled_tokens == {"1": 33, "2": 10}
    assert so.finished_req_ids == ["0"]


def test_priority_scheduling_order() -> None:
    cases = [
        ([2, 0, 1], [1.0, 2.0, 3.0], ["1", "2", "0"]),
        ([1, 1, 1], [3.0, 1.0, 2.0], ["1", "2", "0"]),
        ([2, 1, 1, 0], [1.0, 3.0, 2.0, 4.0], ["3", "2", "1", "0"]),
    ]
    for priorities, arrivals, expected in cases:
        sched = create_scheduler(policy="priority")
        for r in create_requests(len(priorities), priorities=priorities, arrival_times=arrivals):
            sched.add_request(r)
        so = sched.schedule()
        assert [r.req_id for r in so.scheduled_new_reqs] == expected


def test_priority_waiting_queue_order() -> None:
    sched = create_scheduler(policy="priority", max_num_seqs=1)
    for r in create_requests(3, priorities=[3, 2, 0], arrival_times=[1.0, 2.0, 3.0]):
        sched.add_request(r)
    so = sched.schedule()
    assert [r.req_id for r in so.scheduled_new_reqs] == ["2"]
    assert [(r.priority, r.request_id) for r in sched.waiting] == [(2, "1"), (3, "0")]


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_priority_preemption_and_resumption_when_out_of_kv(enable_prefix_caching: bool) -> None:
    sched = create_scheduler(
        policy="priority",
        max_num_seqs=2,
        max_num_batched_tokens=200,
        num_blocks=5,
        enable_prefix_caching=enable_prefix_caching,
    )
    (low,) = create_requests(1, 30, priorities=[1], arrival_times=[0.0])
    sched.add_request(low)
    so = sched.schedule()
    assert len(so.scheduled_new_reqs) == 1 and len(sched.running) == 1
    sched.update_from_output(so, mro(so, {"0": [100]}))
    (high,) = create_requests(1, 32, priorities=[0], arrival_times=[1.0], starting_idx=1)
    sched.add_request(high)
    so = sched.schedule()
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    assert len(so.scheduled_new_reqs) == 1 and so.scheduled_cached_reqs.req_ids == ["0"]
    assert len(sched.waiting) == 0 and len(sched.running) == 2
    sched.update_from_output(so, mro(so, {"0": [100], "1": [100]}))
    # low (32 tokens) still fits its 2 blocks, high (33) needs a third: low, the
    # largest (priority, arrival), is preempted although scheduled first.
    so = sched.schedule()
    assert not so.scheduled_new_reqs and so.scheduled_cached_reqs.req_ids == ["1"]
    assert so.num_scheduled_tokens == {"1": 1}
    assert sched.requests["0"].status is RequestStatus.PREEMPTED
    assert len(sched.waiting) == 1 and len(sched.running) == 1
    sched.update_from_output(so, mro(so, {"1": [100]}))
    sched.finish_requests("1", RequestStatus.FINISHED_STOPPED)
    so = sched.schedule()
    cached = so.scheduled_cached_reqs
    assert not so.scheduled_new_reqs and cached.req_ids == ["0"]
    assert cached.resumed_from_preemption == [True]
    # Resumed: 30 prompt tokens and 2 decoded tokens are recomputed, less the
    # block 0 still cached (high's third block evicted low's block 1).
    assert cached.new_token_ids == [[100, 100]]
    assert so.num_scheduled_tokens == {"0": 16 if enable_prefix_caching else 32}
    assert len(sched.waiting) == 0 and len(sched.running) == 1


def test_same_prompt_in_one_step_hits_the_blocks_cached_at_allocation() -> None:
    sched = create_scheduler(max_num_batched_tokens=1000)
    r0, r1 = create_requests(2, 100, max_tokens=3, same_prompt=True)
    sched.add_request(r0)
    sched.add_request(r1)
    so = sched.schedule()
    # r1 is admitted after r0 in the same step and hits r0's 6 full blocks.
    assert so.num_scheduled_tokens == {"0": 100, "1": 4}
    assert sched.requests["0"].num_cached_tokens == 0
    assert sched.requests["1"].num_cached_tokens == 96
    assert so.scheduled_new_reqs[1].num_computed_tokens == 96
    assert so.scheduled_new_reqs[1].block_ids[0][:6] == so.scheduled_new_reqs[0].block_ids[0][:6]


def test_common_prefix_blocks_reported_for_cascade_attention() -> None:
    sched = create_scheduler(max_num_batched_tokens=1000)
    for r in create_requests(3, 40, same_prompt=True):
        sched.add_request(r)
    so = sched.schedule()
    # 40 tokens: 2 full blocks shared by all three, the partial third is not.
    assert so.num_common_prefix_blocks == [2]


def test_no_leak_after_many_requests() -> None:
    sched = create_scheduler(num_blocks=64, max_num_batched_tokens=256, max_num_seqs=8)
    requests = create_requests(30, 40, max_tokens=5)
    for r in requests:
        sched.add_request(r)
    for _ in range(200):
        if not sched.has_requests():
            break
        so = sched.schedule()
        done = {
            rid
            for rid in so.num_scheduled_tokens
            if sched.requests[rid].num_computed_tokens >= sched.requests[rid].num_tokens
        }
        sched.update_from_output(so, mro(so, {rid: [5] for rid in done}))
    assert not sched.has_requests() and not sched.requests
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 63
    assert sched.kv_cache_manager.usage == 0.0
