"""Property: under the priority policy a self-preemption never ends the running pass.

vLLM 0.33.0 (v1/core/sched/scheduler.py:982-994): the request that preempts
itself was the largest `(priority, arrival_time)` of `running`, so the pass goes
on with the requests after it. With a token budget that no step can exhaust,
every request still RUNNING after `schedule()` was therefore scheduled in it,
and every request scheduled ranks better than every request preempted.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from paged.scheduler.testing import FakeRunner, make_request, make_scheduler

request_st = st.tuples(
    st.integers(1, 12),  # prompt length
    st.integers(1, 30),  # max_tokens
    st.integers(0, 3),  # priority
    st.integers(0, 5),  # arrival step
)


@settings(max_examples=80, deadline=None)
@given(
    reqs=st.lists(request_st, min_size=2, max_size=6),
    num_blocks=st.integers(4, 14),
)
def test_priority_pass_schedules_every_running_request_with_ample_budget(
    reqs: list[tuple[int, int, int, int]], num_blocks: int
) -> None:
    sched = make_scheduler(
        num_blocks=num_blocks,
        max_model_len=48,
        policy="priority",
        max_num_batched_tokens=512,  # more than all prompts together: never the limit
        max_num_seqs=8,
    )
    runner = FakeRunner()
    pending = sorted(enumerate(reqs), key=lambda x: x[1][3])
    keys: dict[str, tuple[int, float]] = {}
    for step_no in range(300):
        while pending and pending[0][1][3] <= step_no:
            i, (plen, max_tokens, prio, _) = pending.pop(0)
            rid = f"r{i}"
            prompt = [1000 * (i + 1) + j for j in range(plen)]
            sched.add_request(
                make_request(rid, prompt, max_tokens=max_tokens, priority=prio, arrival=i)
            )
            keys[rid] = (prio, float(i))
        if not pending and not sched.has_requests():
            break
        so = sched.schedule()
        scheduled = set(so.num_scheduled_tokens)
        running = {r.request_id for r in sched.state.running}
        assert running <= scheduled, (step_no, running - scheduled)
        if so.preempted_req_ids and scheduled:
            assert max(keys[r] for r in scheduled) < min(keys[r] for r in so.preempted_req_ids)
        sched.update_from_output(so, runner.execute(so))
        sched.check_integrity()
