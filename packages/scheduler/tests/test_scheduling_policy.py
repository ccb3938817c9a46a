"""The vLLM-compatible scheduling behaviour listed in ARCHITECTURE.md, bullet by bullet."""

from __future__ import annotations

from paged.scheduler.boundary import FinishReason, ModelRunnerOutput, SchedulerOutput
from paged.scheduler.request import RequestStatus
from paged.scheduler.scheduler import Scheduler
from paged.scheduler.testing import (
    FakeRunner,
    free_blocks,
    make_request,
    make_scheduler,
    next_token,
    run_to_completion,
    tokens_of,
)


def step(sched: Scheduler, runner: FakeRunner) -> SchedulerOutput:
    so = sched.schedule()
    sched.update_from_output(so, runner.execute(so))
    sched.check_integrity()
    return so


def expected(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt) :]


def test_chunked_prefill_splits_and_resumes() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    runner = FakeRunner()
    sched.add_request(make_request("a", 20, max_tokens=3))
    chunks = [step(sched, runner).num_scheduled_tokens["a"] for _ in range(3)]
    assert chunks == [8, 8, 4]  # the last chunk completes the prompt and samples
    assert runner.reqs["a"].tokens[20:] == expected(list(range(1, 21)), 1)
    outs = run_to_completion(sched, runner)
    assert tokens_of(outs["a"]) == expected(list(range(1, 21)), 3)[1:]


def distinct(base: int, n: int) -> list[int]:
    """A prompt sharing no block with prompts of another `base`."""
    return [base * 1000 + i for i in range(n)]


def test_running_first_then_waiting_gets_the_rest() -> None:
    sched = make_scheduler(max_num_batched_tokens=10)
    runner = FakeRunner()
    sched.add_request(make_request("a", distinct(1, 9), max_tokens=5))
    step(sched, runner)  # a: 9-token prefill
    sched.add_request(make_request("b", distinct(2, 12), max_tokens=5))
    so = step(sched, runner)
    # a decodes (1 token) first, b's prefill takes the remaining 9
    assert so.num_scheduled_tokens == {"a": 1, "b": 9}
    assert list(so.num_scheduled_tokens) == ["a", "b"]
    assert so.scheduled_cached_reqs.req_ids == ["a"]
    assert [r.req_id for r in so.scheduled_new_reqs] == ["b"]
    sched.add_request(make_request("c", distinct(3, 8), max_tokens=5))
    so = step(sched, runner)
    # running in order (a decode, b's unfinished chunk), then c with what is left
    assert list(so.num_scheduled_tokens.items()) == [("a", 1), ("b", 3), ("c", 6)]


def test_new_prompt_gets_one_token_chunk() -> None:
    sched = make_scheduler(max_num_batched_tokens=4)
    runner = FakeRunner()
    for rid in ("a", "b", "c"):
        sched.add_request(make_request(rid, 1, max_tokens=4))
    step(sched, runner)  # three one-token prompts
    sched.add_request(make_request("d", 8, max_tokens=2))
    so = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1, "c": 1, "d": 1}


def test_max_num_seqs_caps_running() -> None:
    sched = make_scheduler(max_num_seqs=2)
    runner = FakeRunner()
    for rid in "abc":
        sched.add_request(make_request(rid, 4, max_tokens=2))
    so = step(sched, runner)
    assert sorted(so.num_scheduled_tokens) == ["a", "b"]
    assert sched.get_request_counts() == (2, 1)


def test_waiting_admitted_only_if_whole_sequence_fits_and_head_of_line() -> None:
    # 8 usable blocks of 4 tokens; budget 8 tokens per step.
    sched = make_scheduler(num_blocks=9, max_num_batched_tokens=8)
    runner = FakeRunner()
    sched.add_request(make_request("a", distinct(1, 16), max_tokens=2))  # 4 blocks
    sched.add_request(make_request("big", distinct(2, 20), max_tokens=2))  # 5 blocks
    sched.add_request(make_request("small", distinct(3, 4), max_tokens=2))  # behind big
    so = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 8}  # a's first chunk: its whole prompt fits
    so = step(sched, runner)
    # a has 4 blocks; big needs 5 of the 4 left: not admitted although a chunk
    # would fit, and small behind it waits too (FCFS head of line).
    assert so.num_scheduled_tokens == {"a": 8}
    assert [r.request_id for r in sched.state.waiting] == ["big", "small"]


def test_fcfs_victim_is_last_running_and_resumes_first() -> None:
    # 6 usable blocks; two 8-token prompts take 2 blocks each.
    sched = make_scheduler(num_blocks=7, max_num_batched_tokens=64)
    runner = FakeRunner()
    sched.add_request(make_request("a", distinct(1, 8), max_tokens=12))
    sched.add_request(make_request("b", distinct(2, 8), max_tokens=12))
    sched.add_request(make_request("c", distinct(3, 8), max_tokens=12))
    preempted: list[str] = []
    for _ in range(6):
        so = step(sched, runner)
        preempted += so.preempted_req_ids
        if so.preempted_req_ids:
            # no admission in a step that preempted
            assert not so.scheduled_new_reqs
            assert True not in so.scheduled_cached_reqs.resumed_from_preemption
            break
    assert preempted == ["c"]
    waiting = list(sched.state.waiting)
    assert waiting[0].request_id == "c" and waiting[0].status is RequestStatus.PREEMPTED
    assert waiting[0].num_computed_tokens == 0


def test_preemption_gives_same_tokens_as_no_pressure() -> None:
    prompts = {f"r{i}": [(i * 13 + j) % 50 + 1 for j in range(6 + i)] for i in range(5)}

    def run(num_blocks: int) -> tuple[dict[str, list[int]], int]:
        sched = make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=32)
        for rid, p in prompts.items():
            sched.add_request(make_request(rid, p, max_tokens=14))
        preempted = 0

        def count(_s: Scheduler, so: SchedulerOutput) -> None:
            nonlocal preempted
            preempted += len(so.preempted_req_ids)

        outs = run_to_completion(sched, FakeRunner(), on_step=count)
        assert free_blocks(sched) == num_blocks - 1
        return {rid: tokens_of(o) for rid, o in outs.items()}, preempted

    relaxed, n0 = run(200)
    tight, n1 = run(12)
    assert n0 == 0 and n1 > 0
    assert tight == relaxed
    for rid, p in prompts.items():
        assert relaxed[rid] == expected(p, 14)


def test_priority_order_and_victim_taken_back_from_step() -> None:
    sched = make_scheduler(num_blocks=7, max_num_batched_tokens=64, policy="priority")
    runner = FakeRunner()
    sched.add_request(make_request("low", 8, max_tokens=20, priority=5, arrival=0.0))
    sched.add_request(make_request("high", 8, max_tokens=20, priority=0, arrival=1.0))
    so = step(sched, runner)
    # Priority order at admission: high first.
    assert [r.req_id for r in so.scheduled_new_reqs] == ["high", "low"]
    sched.add_request(make_request("mid", 8, max_tokens=20, priority=2, arrival=2.0))
    victims: list[str] = []
    for _ in range(12):
        so = step(sched, runner)
        victims += so.preempted_req_ids
        for rid in so.preempted_req_ids:
            assert rid not in so.num_scheduled_tokens  # taken back out of the step
        if victims:
            break
    assert victims and victims[0] == "low"


def test_priority_victim_already_scheduled_in_step_is_unscheduled() -> None:
    # running order [high-prio-but-late?]: build running = [low, high] so low is
    # scheduled before high asks for a block and low is then the victim.
    sched = make_scheduler(num_blocks=5, max_num_batched_tokens=64, policy="priority")
    runner = FakeRunner()
    sched.add_request(make_request("low", 7, max_tokens=20, priority=9))
    step(sched, runner)  # low alone: 2 blocks
    sched.add_request(make_request("high", 7, max_tokens=20, priority=0))
    step(sched, runner)  # high admitted after low: running = [low, high]
    assert [r.request_id for r in sched.state.running] == ["low", "high"]
    taken_back = False
    for _ in range(10):
        so = step(sched, runner)
        if so.preempted_req_ids:
            assert so.preempted_req_ids == ["low"]
            assert "low" not in so.num_scheduled_tokens and "high" in so.num_scheduled_tokens
            taken_back = True
            break
    assert taken_back


def test_several_preemptions_in_one_step() -> None:
    # 6 usable blocks of 4. big (24 tokens = all 6 blocks) prefills in chunks of
    # 8 while s1 and s2 (1 block each) are admitted beside it; big's last chunk
    # needs 2 blocks with none free: s2 then s1 are preempted in the same step.
    sched = make_scheduler(num_blocks=7, max_num_batched_tokens=10, long_prefill_token_threshold=8)
    runner = FakeRunner()
    sched.add_request(make_request("big", distinct(1, 24), max_tokens=1))
    sched.add_request(make_request("s1", distinct(2, 2), max_tokens=12))
    sched.add_request(make_request("s2", distinct(3, 2), max_tokens=12))
    assert step(sched, runner).num_scheduled_tokens == {"big": 8, "s1": 2}
    assert step(sched, runner).num_scheduled_tokens == {"big": 8, "s1": 1, "s2": 1}
    assert free_blocks(sched) == 0
    so = step(sched, runner)
    assert so.preempted_req_ids == ["s2", "s1"]
    assert so.num_scheduled_tokens == {"big": 8}
    assert [r.request_id for r in sched.state.waiting] == ["s1", "s2"]
    outs = run_to_completion(sched, runner)
    # s1 sampled 2 tokens before preemption, recomputed, then went on identically
    assert tokens_of(outs["s1"]) == expected(distinct(2, 2), 12)[2:]
    assert free_blocks(sched) == 6


def test_request_outgrowing_the_whole_cache_finishes_with_length() -> None:
    sched = make_scheduler(num_blocks=5)  # 16 tokens of KV in total
    sched.add_request(make_request("a", distinct(1, 10), max_tokens=40))
    outs = run_to_completion(sched, FakeRunner())
    last = outs["a"][-1]
    assert last.finish_reason is FinishReason.LENGTH
    assert last.finish_detail is not None and "KV cache" in last.finish_detail
    assert len(tokens_of(outs["a"])) == 7  # 10 + 7 = 17 > 16 tokens of cache
    assert free_blocks(sched) == 4


def test_long_prefill_threshold_only_when_contended() -> None:
    sched = make_scheduler(long_prefill_token_threshold=4, max_num_batched_tokens=64)
    runner = FakeRunner()
    sched.add_request(make_request("solo", 12, max_tokens=2))
    assert step(sched, runner).num_scheduled_tokens == {"solo": 12}
    sched2 = make_scheduler(long_prefill_token_threshold=4, max_num_batched_tokens=64)
    sched2.add_request(make_request("a", 12, max_tokens=2))
    sched2.add_request(make_request("b", 12, max_tokens=2))
    assert step(sched2, FakeRunner()).num_scheduled_tokens == {"a": 4, "b": 4}


def test_adaptive_long_prefill_threshold_floors_at_a_fair_share() -> None:
    # vLLM 0.33.0 v1/core/sched/scheduler.py:764-769: max(threshold, budget // requests).
    def first_step(adaptive: bool, n: int) -> dict[str, int]:
        sched = make_scheduler(
            long_prefill_token_threshold=4,
            long_prefill_token_threshold_adaptive=adaptive,
            max_num_batched_tokens=64,
        )
        for i in range(n):
            sched.add_request(make_request(f"r{i}", distinct(i + 1, 40), max_tokens=2))
        return dict(step(sched, FakeRunner()).num_scheduled_tokens)

    assert first_step(False, 2) == {"r0": 4, "r1": 4}
    assert first_step(True, 2) == {"r0": 32, "r1": 32}
    assert first_step(True, 3) == {"r0": 21, "r1": 21, "r2": 21}  # 64 // 3
    assert first_step(True, 32) == {f"r{i}": 4 for i in range(16)}  # 64 // 32 < 4


def test_chunked_prefill_disabled_stops_at_prompt_over_budget() -> None:
    sched = make_scheduler(
        max_model_len=32, max_num_batched_tokens=32, enable_chunked_prefill=False
    )
    runner = FakeRunner()
    sched.add_request(make_request("a", distinct(1, 20), max_tokens=4))
    sched.add_request(make_request("b", distinct(2, 20), max_tokens=4))
    so = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 20}  # b (20) > 12 left and may not be chunked
    so = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 20}


def test_finished_id_reported_in_next_scheduler_output() -> None:
    sched = make_scheduler()
    runner = FakeRunner()
    sched.add_request(make_request("a", 4, max_tokens=1))
    sched.add_request(make_request("b", 4, max_tokens=5))
    step(sched, runner)  # a finishes after its first token
    so = step(sched, runner)
    assert so.finished_req_ids == ["a"]
    sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    so = sched.schedule()
    assert so.finished_req_ids == ["b"] and so.total_num_scheduled_tokens == 0
    sched.update_from_output(so, ModelRunnerOutput())
    assert not sched.has_requests()


def _self_preemption_run(c_joins_after_first_step: bool) -> list[SchedulerOutput]:
    """Block size 4, 4 usable blocks, priority policy; a (priority 1) then c (priority 0)."""
    sched = make_scheduler(
        num_blocks=5, max_model_len=64, policy="priority", max_num_batched_tokens=64, max_num_seqs=4
    )
    runner = FakeRunner()
    sched.add_request(make_request("a", 4, max_tokens=20, priority=1, arrival=0.0))
    if not c_joins_after_first_step:
        sched.add_request(make_request("c", 4, max_tokens=20, priority=0, arrival=1.0))
    outs = [step(sched, runner)]
    if c_joins_after_first_step:
        sched.add_request(make_request("c", 4, max_tokens=20, priority=0, arrival=1.0))
    outs += [step(sched, runner) for _ in range(5)]
    return outs


def test_priority_request_preempting_itself_lets_the_better_ones_after_it_run() -> None:
    # running = [a, c]: a is one token ahead, so it reaches a block boundary first with
    # no block free; it is the largest (priority, arrival), so it preempts itself. vLLM
    # 0.33.0 (v1/core/sched/scheduler.py:982-992) then `continue`s under the priority
    # policy: c, behind a with a better priority, gets one of a's freed blocks in the
    # same step. No waiting request is admitted (a step that preempted).
    outs = _self_preemption_run(c_joins_after_first_step=True)
    assert [(dict(o.num_scheduled_tokens), list(o.preempted_req_ids)) for o in outs] == [
        ({"a": 4}, []),
        ({"a": 1, "c": 4}, []),
        ({"a": 1, "c": 1}, []),
        ({"a": 1, "c": 1}, []),
        ({"a": 1, "c": 1}, []),
        ({"c": 1}, ["a"]),
    ]
    # c decodes its 8th token inside its own 2 blocks; a is not resumed in this step.
    last = outs[5]
    assert last.scheduled_cached_reqs.req_ids == ["c"] and not last.scheduled_new_reqs
    assert last.scheduled_cached_reqs.new_block_ids == [None]


def test_priority_victim_behind_the_asking_request_frees_its_blocks() -> None:
    # Same sizes, both added together: running = [c, a]; c asks first and the victim a
    # is another request, so c gets a's freed block in the same step.
    outs = _self_preemption_run(c_joins_after_first_step=False)
    assert dict(outs[5].num_scheduled_tokens) == {"c": 1} and outs[5].preempted_req_ids == ["a"]


def test_priority_victim_scheduled_earlier_in_step_gives_back_budget_and_blocks() -> None:
    # vLLM 0.33.0 v1/core/sched/scheduler.py:944-968: a priority victim already scheduled
    # in this step returns its tokens to the budget and drops its new blocks; it stood
    # before the asking request, so the index moves back by one and the request after
    # the asker is still reached. 9 usable blocks of 4, budget 8, chunks of 4.
    sched = make_scheduler(
        num_blocks=10,
        max_model_len=64,
        policy="priority",
        max_num_batched_tokens=8,
        max_num_seqs=3,
        long_prefill_token_threshold=4,
    )
    runner = FakeRunner()
    sched.add_request(make_request("low", distinct(1, 26), max_tokens=30, priority=9, arrival=0))
    outs = [step(sched, runner)]
    sched.add_request(make_request("high", distinct(2, 2), max_tokens=30, priority=0, arrival=1))
    outs.append(step(sched, runner))
    sched.add_request(make_request("mid", distinct(3, 12), max_tokens=30, priority=5, arrival=2))
    outs += [step(sched, runner) for _ in range(3)]
    assert [dict(o.num_scheduled_tokens) for o in outs[:4]] == [
        {"low": 8}, {"low": 4, "high": 2}, {"low": 4, "high": 1, "mid": 3},
        {"low": 4, "high": 1, "mid": 3},
    ]  # fmt: skip
    last = outs[4]
    # low took the last free block for its chunk, then high (decoding into a new block)
    # found none: low, the victim, gave back its 4 tokens, so mid gets a full chunk of 4
    # (3 without the give-back), and its new block goes to high.
    assert last.preempted_req_ids == ["low"]
    assert dict(last.num_scheduled_tokens) == {"high": 1, "mid": 4}
    assert last.total_num_scheduled_tokens == 5
    cached = last.scheduled_cached_reqs
    assert cached.req_ids == ["high", "mid"]
    assert cached.new_block_ids == [([9],), ([7],)]
    assert free_blocks(sched) == 4  # 9 usable - high's 2 - mid's 3
    waiting = list(sched.state.waiting)
    assert [r.request_id for r in waiting] == ["low"] and waiting[0].num_computed_tokens == 0
