"""add_request validation, ignored prompts, aborts, stop conditions, NaNs, outputs per client."""

from __future__ import annotations

import pytest

from paged.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from paged.scheduler.boundary import EngineCoreOutputs, FinishReason, ModelRunnerOutput
from paged.scheduler.request import RequestStatus
from paged.scheduler.scheduler import Scheduler
from paged.scheduler.testing import (
    FakeRunner,
    all_outputs,
    free_blocks,
    make_request,
    make_scheduler,
    next_token,
    run_to_completion,
    tokens_of,
)


def distinct(base: int, n: int) -> list[int]:
    return [base * 1000 + i for i in range(n)]


def step(sched: Scheduler, runner: FakeRunner) -> dict[int, EngineCoreOutputs]:
    so = sched.schedule()
    out = sched.update_from_output(so, runner.execute(so))
    sched.check_integrity()
    return out


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
        ({"logprobs": 5}, "logprobs"),  # above this scheduler's max_logprobs=4
    ],
)
def test_add_request_rejects_bad_params_without_trace(
    kwargs: dict[str, object], field: str
) -> None:
    sched = make_scheduler(max_logprobs=4)
    with pytest.raises(ValueError, match=field):
        sched.add_request(make_request("a", 4, **kwargs))  # type: ignore[arg-type]
    assert not sched.has_requests() and "a" not in sched.state.requests


def test_add_request_rejects_duplicate_and_empty_and_bad_mm() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 4))
    with pytest.raises(ValueError, match="request_id"):
        sched.add_request(make_request("a", 4))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        sched.add_request(make_request("b", []))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        sched.add_request(make_request("b", [1, -2]))
    outside = MultiModalFeatureSpec("image", "h", PlaceholderRange(2, 5))
    with pytest.raises(ValueError, match=r"mm_features\[0\]"):
        sched.add_request(make_request("b", 4, mm=[outside]))
    a = MultiModalFeatureSpec("image", "x", PlaceholderRange(3, 2))
    b = MultiModalFeatureSpec("image", "y", PlaceholderRange(0, 2))
    with pytest.raises(ValueError, match=r"mm_features\[1\]"):
        sched.add_request(make_request("b", 8, mm=[a, b]))
    assert sched.get_num_unfinished_requests() == 1
    assert free_blocks(sched) == 63


def test_prompt_longer_than_max_model_len_is_ignored_with_reason() -> None:
    sched = make_scheduler(max_model_len=16)
    sched.add_request(make_request("long", 17, client=3))
    assert sched.has_requests()
    assert sched.get_num_unfinished_requests() == 0
    so = sched.schedule()
    assert so.total_num_scheduled_tokens == 0
    out = sched.update_from_output(so, ModelRunnerOutput())
    (o,) = out[3].outputs
    assert o.request_id == "long" and o.finish_reason is FinishReason.LENGTH
    assert o.finish_detail is not None and "max_model_len=16" in o.finish_detail
    assert not sched.has_requests()
    # Same id may be used again: nothing was registered.
    sched.add_request(make_request("long", 4))


def test_prompt_longer_than_kv_cache_is_ignored() -> None:
    sched = make_scheduler(num_blocks=3, max_model_len=64)  # 8 tokens of KV
    sched.add_request(make_request("big", 9))
    outs = run_to_completion(sched, FakeRunner())
    assert outs["big"][0].finish_reason is FinishReason.LENGTH
    assert "KV cache" in (outs["big"][0].finish_detail or "")


def test_prompt_equal_to_max_model_len_yields_one_token() -> None:
    sched = make_scheduler(max_model_len=12, max_num_batched_tokens=5)
    sched.add_request(make_request("a", distinct(1, 12), max_tokens=None))
    outs = run_to_completion(sched, FakeRunner())
    assert tokens_of(outs["a"]) == [next_token(distinct(1, 12))]
    assert outs["a"][-1].finish_reason is FinishReason.LENGTH


def test_abort_mid_prefill_frees_every_block_and_unknown_is_noop() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    runner = FakeRunner()
    sched.add_request(make_request("a", distinct(1, 30)))
    sched.add_request(make_request("w", distinct(2, 30)))
    step(sched, runner)
    assert free_blocks(sched) < 63
    sched.finish_requests(["a", "w", "nope"], RequestStatus.FINISHED_ABORTED)
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)  # already finished: no-op
    assert free_blocks(sched) == 63
    assert sched.get_num_unfinished_requests() == 0
    so = sched.schedule()
    assert so.finished_req_ids == ["a", "w"]
    sched.update_from_output(so, runner.execute(so))
    assert not sched.has_requests()
    with pytest.raises(ValueError, match="finished_status"):
        sched.finish_requests("x", RequestStatus.RUNNING)


def test_abort_while_step_in_flight_drops_its_output() -> None:
    sched = make_scheduler()
    runner = FakeRunner()
    sched.add_request(make_request("a", 4))
    so = sched.schedule()
    mro = runner.execute(so)
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert all_outputs(sched.update_from_output(so, mro)) == []


@pytest.mark.parametrize(
    ("params", "eos", "n_tokens", "reason", "stop_reason"),
    [
        ({"max_tokens": 5}, None, 5, FinishReason.LENGTH, None),
        ({"max_tokens": 50}, "first", 1, FinishReason.STOP, None),
        ({"max_tokens": 50, "ignore_eos": True}, "first", 50, FinishReason.LENGTH, None),
        ({"max_tokens": 50, "stop_token_ids": ["third"]}, None, 3, FinishReason.STOP, "third"),
        (
            {"max_tokens": 50, "ignore_eos": True, "stop_token_ids": ["third"]},
            "first",
            3,
            FinishReason.STOP,
            "third",
        ),
        ({"max_tokens": 50, "min_tokens": 4, "stop_token_ids": ["third"]}, None, 0, None, None),
    ],
)
def test_stop_conditions_through_the_scheduler(
    params: dict[str, object],
    eos: str | None,
    n_tokens: int,
    reason: FinishReason | None,
    stop_reason: str | None,
) -> None:
    prompt = distinct(1, 5)
    seq = list(prompt)
    for _ in range(60):
        seq.append(next_token(seq))
    gen = seq[5:]
    named = {"first": gen[0], "third": gen[2]}
    resolved = {k: ([named[x] for x in v] if isinstance(v, list) else v) for k, v in params.items()}
    if "min_tokens" in params:
        # min_tokens=4 suppresses the stop token at position 3; the request
        # stops at its next occurrence from the 4th token on (or at max_tokens).
        later = [i for i in range(3, 50) if gen[i] == named["third"]]
        n_tokens = later[0] + 1 if later else 50
        reason = FinishReason.STOP if later else FinishReason.LENGTH
        stop_reason = "third" if later else None
        assert n_tokens > 3
    sched = make_scheduler(max_model_len=200)
    sched.add_request(
        make_request("r", prompt, eos=named[eos] if eos else None, **resolved)  # type: ignore[arg-type]
    )
    outs = run_to_completion(sched, FakeRunner())["r"]
    assert tokens_of(outs) == gen[:n_tokens]  # the stop token itself is kept
    assert outs[-1].finish_reason is reason
    assert outs[-1].stop_reason == (named[stop_reason] if stop_reason else None)


def test_max_model_len_caps_generation() -> None:
    sched = make_scheduler(max_model_len=10)
    sched.add_request(make_request("r", distinct(1, 6), max_tokens=50))
    outs = run_to_completion(sched, FakeRunner())["r"]
    assert len(tokens_of(outs)) == 4
    assert outs[-1].finish_reason is FinishReason.LENGTH


def test_nan_logits_finish_with_error() -> None:
    sched = make_scheduler()
    runner = FakeRunner()
    sched.add_request(make_request("a", 4))
    sched.add_request(make_request("b", distinct(2, 4)))
    so = sched.schedule()
    mro = runner.execute(so)
    bad = ModelRunnerOutput(
        req_ids=mro.req_ids, sampled_token_ids=mro.sampled_token_ids, num_nans_in_logits={"a": 3}
    )
    outs = {o.request_id: o for o in all_outputs(sched.update_from_output(so, bad))}
    assert outs["a"].finish_reason is FinishReason.ERROR and outs["a"].new_token_ids == []
    assert "NaN" in (outs["a"].finish_detail or "")
    assert outs["b"].finish_reason is None and len(outs["b"].new_token_ids) == 1
    assert sched.get_num_unfinished_requests() == 1


def test_outputs_grouped_by_client_with_stats_and_finished_sets() -> None:
    sched = make_scheduler(include_finished_set=True)
    runner = FakeRunner()
    sched.add_request(make_request("a", distinct(1, 4), max_tokens=1, client=0))
    sched.add_request(make_request("b", distinct(2, 4), max_tokens=3, client=1))
    out = step(sched, runner)
    assert set(out) == {0, 1}
    assert [o.request_id for o in out[1].outputs] == ["b"]
    assert out[0].finished_requests == ["a"] and out[1].finished_requests is None
    stats = out[0].scheduler_stats
    assert stats is not None and out[1].scheduler_stats is None
    assert stats.num_running_reqs == 1 and stats.num_scheduled_tokens == 8
    assert stats.prefix_cache_stats.requests == 2 and stats.prefix_cache_stats.queries == 8
    assert 0.0 < stats.kv_cache_usage <= 1.0


def test_stats_report_preemptions_and_prefix_hits() -> None:
    sched = make_scheduler()
    runner = FakeRunner()
    prompt = distinct(1, 12)
    sched.add_request(make_request("a", prompt, max_tokens=2))
    step(sched, runner)
    sched.add_request(make_request("b", [*prompt, 7, 7], max_tokens=2))
    so = sched.schedule()
    # b's first 12 tokens (3 full blocks) hit a's cached blocks: 2 left to compute
    assert so.num_scheduled_tokens["b"] == 2
    assert so.scheduled_new_reqs[0].num_computed_tokens == 12
    out = sched.update_from_output(so, runner.execute(so))
    stats = out[0].scheduler_stats
    assert stats is not None
    assert (stats.prefix_cache_stats.queries, stats.prefix_cache_stats.hits) == (14, 12)
    assert all_outputs(out)[-1].num_cached_tokens == 12
