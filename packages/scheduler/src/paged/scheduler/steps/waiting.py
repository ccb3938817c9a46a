"""Phase 2 of a step: admit WAITING requests with what is left of the budget.

Skipped entirely in a step that preempted (admitting would only thrash).
Per request at the head of the queue:

    WAITING_FOR_REMOTE_KVS, load not finished     -> set aside, look at the next one
    nothing to run before an encoder item still loading through the EC connector
                                                  -> start the load if new, set aside
    grammar still compiling (GrammarCompileGate)  -> set aside, look at the next one
    local prefix-cache hit + connector hit        -> computed tokens (connector may
                                                     say "ask again": set aside)
    async external load                           -> allocate, park in WAITING_FOR_REMOTE_KVS
    otherwise: chunk = rest of the known sequence, cut by threshold and budget
               (chunked prefill off and it does not fit: stop), encoder inputs may cut it
    blocks for the whole known sequence do not fit -> stop (FCFS head of line)
    its LoRA adapter would be one more than `max_loras` distinct adapters among
    the running requests (those not scheduled this step count too: they join
    a later batch)                                -> set aside, look at the next one

Set-aside requests go back to the head of the queue in their order.
"""

from __future__ import annotations

from paged.kvcache import KVCacheBlocks
from paged.scheduler.boundary import EngineCoreOutput, FinishReason
from paged.scheduler.queue import RequestQueue, create_request_queue
from paged.scheduler.remote_kv import finish_remote_kv_load
from paged.scheduler.request import Request, RequestStatus
from paged.scheduler.state import SchedulerState, StepPlan
from paged.scheduler.steps.encoder_inputs import (
    EncoderDecision,
    commit_encoder_inputs,
    schedule_encoder_inputs,
    start_async_loads,
)
from paged.scheduler.update import free_request


def schedule_waiting(state: SchedulerState, plan: StepPlan, long_prefill_threshold: int) -> None:
    config = state.config
    waiting = state.waiting
    skipped = create_request_queue(config.policy)
    loras = _running_loras(state)
    while waiting and plan.budget.tokens > 0 and len(state.running) < config.max_num_seqs:
        request = waiting.peek_request()
        if request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
            if not finish_remote_kv_load(state, request):
                skipped.add_request(waiting.pop_request())
                continue
            request.status = RequestStatus.WAITING
        if (
            state.grammar_ready is not None
            and request.sampling_params.structured_outputs is not None
            and not state.grammar_ready(request)
        ):
            skipped.add_request(waiting.pop_request())  # grammar still compiling
            continue
        if request.num_tokens > state.max_tokens_in_kv_cache:
            _finish_too_long(state, waiting.pop_request())
            continue
        if _exceeds_max_loras(config.max_loras, loras, request):
            skipped.add_request(waiting.pop_request())
            continue
        if not _try_admit(state, plan, request, long_prefill_threshold, skipped):
            break
        if request.lora_name is not None and request.status is RequestStatus.RUNNING:
            loras.add(request.lora_name)
    if skipped:
        waiting.prepend_requests(list(skipped))


def _running_loras(state: SchedulerState) -> set[str]:
    """The distinct adapters of every running request (vLLM counts all of them,
    scheduled this step or not, since an unscheduled one joins a later batch)."""
    if state.config.max_loras is None:
        return set()
    loras = {r.lora_name for r in state.running if r.lora_name is not None}
    if len(loras) > state.config.max_loras:
        # Only admission adds adapters, and it keeps to the limit: a broken invariant.
        raise RuntimeError(
            f"{len(loras)} distinct LoRA adapters running, more than max_loras "
            f"({state.config.max_loras}): {sorted(loras)}"
        )
    return loras


def _exceeds_max_loras(max_loras: int | None, loras: set[str], request: Request) -> bool:
    """vLLM's rule: a request with an adapter not yet running waits when the
    running adapters already number `max_loras`; base-model requests never do."""
    return (
        max_loras is not None
        and request.lora_name is not None
        and request.lora_name not in loras
        and len(loras) >= max_loras
    )


def _try_admit(
    state: SchedulerState,
    plan: StepPlan,
    request: Request,
    long_prefill_threshold: int,
    skipped: RequestQueue,
) -> bool:
    """Admit the head request or set it aside; False stops the waiting scan."""
    kv = state.kv
    num_external = 0
    load_async = False
    if request.num_computed_tokens == 0:
        computed_blocks, num_local = kv.get_computed_blocks(request)
        if state.kv_connector is not None:
            ext, load_async = state.kv_connector.get_num_new_matched_tokens(request, num_local)
            if ext is None:
                skipped.add_request(state.waiting.pop_request())
                return True
            num_external = ext
        num_computed = num_local + num_external
    else:
        # Back from an async KV load: the loaded tokens are already counted.
        computed_blocks, num_local = kv.create_empty_block_list(), 0
        num_computed = request.num_computed_tokens
    decision: EncoderDecision | None = None
    num_new = 0
    if not load_async:
        num_new = request.num_tokens - num_computed
        if 0 < long_prefill_threshold < num_new:
            num_new = long_prefill_threshold
        if not state.config.enable_chunked_prefill and num_new > plan.budget.tokens:
            return False
        num_new = min(num_new, plan.budget.tokens)
        if request.mm_features:
            decision = _encoder_decision(state, plan, request, num_computed, num_new)
            num_new = decision.num_new_tokens
            if num_new == 0:
                state.encoder_cache.free(request)
                if decision.waiting_for_load:
                    # Its embeddings are on their way: wait aside, others go on.
                    start_async_loads(
                        request,
                        decision,
                        state.encoder_cache,
                        state.ec_connector,
                        state.ec_transfer,
                    )
                    skipped.add_request(state.waiting.pop_request())
                    return True
                return False
    if not load_async and not _whole_sequence_fits(state, request, computed_blocks, num_computed):
        if request.mm_features:
            state.encoder_cache.free(request)
        return False
    new_blocks = kv.allocate_slots(
        request,
        num_new,
        num_new_computed_tokens=num_local,
        new_computed_blocks=computed_blocks,
        num_lookahead_tokens=(
            state.config.num_lookahead_tokens if request.num_computed_tokens else 0
        ),
        num_external_computed_tokens=num_external,
        delay_cache_blocks=load_async,
    )
    if new_blocks is None:
        if request.mm_features:
            state.encoder_cache.free(request)
        return False
    if state.kv_connector is not None:
        blocks: KVCacheBlocks = kv.get_blocks(request.request_id)
        state.kv_connector.update_state_after_alloc(request, blocks, num_external)
    state.waiting.pop_request()
    if load_async:
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.num_external_computed_tokens = num_external
        request.kv_load_target_tokens = num_computed
        skipped.add_request(request)
        return True
    _admit(state, plan, request, num_computed, num_new, decision)
    return True


def _finish_too_long(state: SchedulerState, request: Request) -> None:
    """A request that grew past the whole KV cache can never run again: finish it.

    vLLM would preempt it forever; reporting LENGTH keeps the frontend from hanging.
    """
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    request.finish_detail = (
        f"sequence of {request.num_tokens} tokens no longer fits the KV cache "
        f"({state.max_tokens_in_kv_cache} tokens)"
    )
    params = free_request(state, request)
    output = EngineCoreOutput(
        request_id=request.request_id,
        new_token_ids=[],
        finish_reason=FinishReason.LENGTH,
        finish_detail=request.finish_detail,
        kv_transfer_params=params.kv,
        ec_transfer_params=params.ec,
        num_cached_tokens=max(request.num_cached_tokens, 0),
    )
    state.pending_outputs.append((request.client_index, output))


def _whole_sequence_fits(
    state: SchedulerState, request: Request, computed_blocks: KVCacheBlocks, num_computed: int
) -> bool:
    """vLLM admits a request only if blocks for all its known tokens fit now.

    Admitting a prompt whose later chunks cannot get blocks would only lead
    to preemptions; the check uses the manager's own block arithmetic (prefix
    hits on free cached blocks cost capacity, hits on blocks in use do not).
    """
    kv = state.kv
    num_tokens = min(request.num_tokens, state.config.max_model_len)
    needed = kv.coordinator.get_num_blocks_to_allocate(
        request.request_id, num_tokens, computed_blocks.blocks, 0, num_computed, num_tokens
    )
    return needed <= kv.block_pool.get_num_free_blocks()


def _encoder_decision(
    state: SchedulerState, plan: StepPlan, request: Request, num_computed: int, num_new: int
) -> EncoderDecision:
    return schedule_encoder_inputs(
        request,
        num_computed,
        num_new,
        plan.budget.encoder_embeds,
        state.encoder_cache,
        state.ec_connector,
        state.config.disable_chunked_mm_input,
        state.ec_transfer,
    )


def _admit(
    state: SchedulerState,
    plan: StepPlan,
    request: Request,
    num_computed: int,
    num_new: int,
    decision: EncoderDecision | None,
) -> None:
    req_id = request.request_id
    state.running.append(request)
    if request.status is RequestStatus.PREEMPTED:
        plan.scheduled_resumed.append(request)
    else:
        plan.scheduled_new.append(request)
    # New and resumed requests get their whole block table.
    plan.new_block_ids[req_id] = state.kv.get_block_ids(req_id)
    plan.num_scheduled_tokens[req_id] = num_new
    plan.budget.take_tokens(num_new)
    request.status = RequestStatus.RUNNING
    request.num_computed_tokens = num_computed
    if request.num_cached_tokens < 0:
        request.num_cached_tokens = num_computed
    if decision is not None and (decision.to_compute or decision.to_load or decision.to_load_async):
        if decision.to_compute:
            plan.encoder_inputs[req_id] = decision.to_compute
            plan.budget.encoder_embeds -= decision.compute_embeds
        commit_encoder_inputs(
            request, decision, state.encoder_cache, state.ec_connector, state.ec_transfer
        )
