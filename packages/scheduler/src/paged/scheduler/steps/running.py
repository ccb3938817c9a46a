"""Phase 1 of a step: advance RUNNING requests, in running order.

Decodes and unfinished prefill chunks are treated alike (unified compute
model): each request asks for `num_tokens_with_spec - num_computed_tokens`
tokens, cut by `long_prefill_token_threshold`, the remaining budget and
`max_model_len`. When `allocate_slots` finds no blocks, requests are
preempted (see preemption.py) until it succeeds or the asking request itself
was the victim. What follows a self-preemption depends on the policy, as in
vLLM 0.33.0 (vllm/v1/core/sched/scheduler.py:982-994):

- FCFS: the victim is the last running request, so nothing after it is left
  to schedule; the phase ends.
- priority: the victim was the largest `(priority, arrival_time)`, so every
  request after it in running order ranks better and may fit in the blocks it
  just freed; the pass goes on with them. The victim left `running`, so the
  index already points at the next request (and it moved back by one for each
  victim that stood before it).
"""

from __future__ import annotations

from paged.kvcache import KVCacheBlocks
from paged.scheduler.request import Request, RequestStatus
from paged.scheduler.state import SchedulerState, StepPlan
from paged.scheduler.steps.encoder_inputs import (
    EncoderDecision,
    commit_encoder_inputs,
    schedule_encoder_inputs,
    start_async_loads,
)
from paged.scheduler.steps.preemption import pick_victim, preempt, unschedule


def block_ids_or_none(blocks: KVCacheBlocks) -> tuple[list[int], ...] | None:
    """The new block ids, or None when no group got a block (the common decode case)."""
    ids = blocks.get_block_ids()
    for group in ids:
        if group:
            return ids
    return None


def schedule_running(state: SchedulerState, plan: StepPlan, long_prefill_threshold: int) -> None:
    config = state.config
    max_model_len = config.max_model_len
    lookahead = config.num_lookahead_tokens
    kv = state.kv
    running = state.running
    index = 0
    while index < len(running) and plan.budget.tokens > 0:
        request = running[index]
        computed = request.num_computed_tokens
        num_new = request.num_tokens_with_spec - computed
        if 0 < long_prefill_threshold < num_new:
            num_new = long_prefill_threshold
        # Positions must stay below max_model_len (drafts could push past it).
        num_new = min(num_new, plan.budget.tokens, max_model_len - computed)
        decision: EncoderDecision | None = None
        if request.mm_features and num_new > 0:
            decision = schedule_encoder_inputs(
                request,
                computed,
                num_new,
                plan.budget.encoder_embeds,
                state.encoder_cache,
                state.ec_connector,
                config.disable_chunked_mm_input,
                state.ec_transfer,
            )
            num_new = decision.num_new_tokens
        if num_new <= 0:
            if decision is not None:
                # Stopped before an item whose embeddings load asynchronously.
                start_async_loads(
                    request,
                    decision,
                    state.encoder_cache,
                    state.ec_connector,
                    state.ec_transfer,
                )
            index += 1
            continue
        while True:
            new_blocks = kv.allocate_slots(request, num_new, num_lookahead_tokens=lookahead)
            if new_blocks is not None:
                break
            victim = pick_victim(state)
            victim_index = running.index(victim)
            running.pop(victim_index)
            if victim_index < index:
                index -= 1
            unschedule(plan, victim)
            preempt(state, victim)
            plan.preempted.append(victim)
            if victim is request:
                break
        if new_blocks is None:
            if config.policy == "priority" and request.status is RequestStatus.PREEMPTED:
                continue  # `index` already names the request after the victim
            break
        _record(state, plan, request, num_new, new_blocks, decision)
        index += 1


def _record(
    state: SchedulerState,
    plan: StepPlan,
    request: Request,
    num_new: int,
    new_blocks: KVCacheBlocks,
    decision: EncoderDecision | None,
) -> None:
    req_id = request.request_id
    plan.scheduled_running.append(request)
    plan.num_scheduled_tokens[req_id] = num_new
    # Most decode steps add no block: the manager then returns its shared empty instance.
    plan.new_block_ids[req_id] = (
        None if new_blocks is state.kv.empty_kv_cache_blocks else block_ids_or_none(new_blocks)
    )
    plan.budget.take_tokens(num_new)
    if request.spec_token_ids:
        num_spec = num_new + request.num_computed_tokens - request.num_tokens
        if num_spec > 0:
            plan.spec_decode_tokens[req_id] = request.spec_token_ids[:num_spec]
        # Fresh drafts arrive through update_draft_token_ids before the next step.
        request.spec_token_ids = []
    if decision is not None and (decision.to_compute or decision.to_load or decision.to_load_async):
        if decision.to_compute:
            plan.encoder_inputs[req_id] = decision.to_compute
            plan.budget.encoder_embeds -= decision.compute_embeds
        commit_encoder_inputs(
            request, decision, state.encoder_cache, state.ec_connector, state.ec_transfer
        )
