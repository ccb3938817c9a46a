"""Preemption by recompute (seed: Scheduler と KVCacheManager の相互作用, プリエンプション).

Victim choice (vLLM-compatible): under FCFS the last request of the running
list (possibly the one asking for blocks); under priority the largest
`(priority, arrival_time)`, even if it was already scheduled in this step, in
which case its share of the step is taken back. The victim's blocks and
encoder-cache references are freed, it restarts from zero computed tokens and
goes back to the front of the waiting queue.
"""

from __future__ import annotations

from paged.scheduler.request import Request, RequestStatus
from paged.scheduler.state import SchedulerState, StepPlan


def pick_victim(state: SchedulerState) -> Request:
    running = state.running
    if state.config.policy == "priority":
        return max(running, key=lambda r: (r.priority, r.arrival_time))
    return running[-1]


def unschedule(plan: StepPlan, request: Request) -> None:
    """Take back what `request` got earlier in this step (priority-policy victims)."""
    req_id = request.request_id
    num_tokens = plan.num_scheduled_tokens.pop(req_id, None)
    if num_tokens is None:
        return
    plan.budget.give_back_tokens(num_tokens)
    plan.scheduled_running.remove(request)
    plan.new_block_ids.pop(req_id, None)
    plan.spec_decode_tokens.pop(req_id, None)
    inputs = plan.encoder_inputs.pop(req_id, None)
    if inputs:
        plan.budget.encoder_embeds += sum(request.get_num_encoder_embeds(i) for i in inputs)


def preempt(state: SchedulerState, request: Request) -> None:
    """Free everything `request` holds and put it at the front of the waiting queue."""
    state.kv.free(request)
    state.encoder_cache.free(request)
    request.status = RequestStatus.PREEMPTED
    request.num_computed_tokens = 0
    request.spec_token_ids = []
    request.num_preemptions += 1
    state.num_preempted_since_stats += 1
    state.waiting.prepend_request(request)
