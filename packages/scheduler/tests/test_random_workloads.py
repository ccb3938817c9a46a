"""Hypothesis-driven workloads: invariants hold every step, everything ends freed."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from paged.scheduler.boundary import SchedulerOutput
from paged.scheduler.request import RequestStatus
from paged.scheduler.testing import FakeRunner, free_blocks, make_request, make_scheduler

request_st = st.tuples(
    st.integers(1, 40),  # prompt length
    st.integers(1, 12),  # max_tokens
    st.integers(0, 3),  # priority
    st.integers(0, 3),  # shared-prefix family (prefix hits)
    st.integers(0, 6),  # arrival step
    st.booleans(),  # aborted at some point
)


@settings(max_examples=60, deadline=None)
@given(
    reqs=st.lists(request_st, min_size=1, max_size=12),
    num_blocks=st.integers(12, 40),
    budget=st.integers(4, 48),
    max_num_seqs=st.integers(1, 6),
    policy=st.sampled_from(["fcfs", "priority"]),
    threshold=st.sampled_from([0, 5]),
    caching=st.booleans(),
)
def test_random_workload_invariants(
    reqs: list[tuple[int, int, int, int, int, bool]],
    num_blocks: int,
    budget: int,
    max_num_seqs: int,
    policy: str,
    threshold: int,
    caching: bool,
) -> None:
    sched = make_scheduler(
        num_blocks=num_blocks,
        max_model_len=64,
        max_num_batched_tokens=budget,
        # vLLM rejects max_num_batched_tokens < max_num_seqs (SchedulerConfig).
        max_num_seqs=min(max_num_seqs, budget),
        policy=policy,
        long_prefill_token_threshold=threshold,
        enable_caching=caching,
    )
    runner = FakeRunner()
    usable = num_blocks - 1
    finished: set[str] = set()
    aborted: set[str] = set()
    pending = sorted(enumerate(reqs), key=lambda x: x[1][4])
    for step_no in range(600):
        while pending and pending[0][1][4] <= step_no:
            i, (plen, max_tokens, prio, family, _, _) = pending.pop(0)
            prompt = [family * 100 + (j if j < 8 else 50 + i * 40 + j) for j in range(plen)]
            sched.add_request(
                make_request(f"r{i}", prompt, max_tokens=max_tokens, priority=prio, arrival=i)
            )
        if not pending and not sched.has_requests():
            break
        so: SchedulerOutput = sched.schedule()
        assert so.total_num_scheduled_tokens <= budget
        assert len(so.num_scheduled_tokens) <= min(max_num_seqs, budget)
        assert len(sched.state.running) <= min(max_num_seqs, budget)
        assert all(n > 0 for n in so.num_scheduled_tokens.values())
        sched.check_integrity()
        sched.state.kv.check_integrity()
        # Abort some requests mid-flight (between schedule and update, as aborts arrive).
        for i, (*_, abort) in enumerate(reqs):
            rid = f"r{i}"
            if abort and step_no == 3 + i and rid in sched.state.requests:
                if not sched.state.requests[rid].is_finished():
                    aborted.add(rid)
                sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        for eco in sched.update_from_output(so, runner.execute(so)).values():
            for out in eco.outputs:
                assert out.request_id not in finished, "output after finish"
                if out.finish_reason is not None:
                    finished.add(out.request_id)
        sched.check_integrity()
        sched.state.kv.check_integrity()
    else:
        raise AssertionError("workload did not drain")
    # Every request was reported finished exactly once, except those the client aborted.
    assert finished == {f"r{i}" for i in range(len(reqs))} - aborted
    assert free_blocks(sched) == usable
    assert not sched.state.requests and not sched.state.running and not sched.state.waiting
    sched.state.encoder_cache.check_integrity()
