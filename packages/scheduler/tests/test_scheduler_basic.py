"""Scheduling simulations against the real KVCacheManager and a deterministic fake runner."""

from __future__ import annotations

from paged.scheduler.boundary import FinishReason
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


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt) :]


def test_single_request_prefill_then_decode() -> None:
    sched = make_scheduler()
    total = free_blocks(sched)
    sched.add_request(make_request("a", 10, max_tokens=5))
    so = sched.schedule()
    assert [r.req_id for r in so.scheduled_new_reqs] == ["a"]
    assert so.num_scheduled_tokens == {"a": 10}
    assert so.scheduled_new_reqs[0].block_ids == ([1, 2, 3],)
    runner = FakeRunner()
    got = sched.update_from_output(so, runner.execute(so))
    assert [o.new_token_ids for o in all_outputs(got)] == [expected_tokens(list(range(1, 11)), 1)]
    outs = run_to_completion(sched, runner)
    assert len(tokens_of(outs["a"])) == 4
    assert outs["a"][-1].finish_reason is FinishReason.LENGTH
    assert free_blocks(sched) == total
    assert not sched.has_requests()
