"""Phase 3 of a step: turn the plan into a `SchedulerOutput`, then advance computed counts.

New requests carry all their data (`NewRequestData`); running and resumed
ones only deltas (`CachedRequestData`). A resumed request's `new_block_ids`
is its whole block table (it replaces the runner's) and its
`new_token_ids` are all its output tokens (the runner may have dropped them).
"""

from __future__ import annotations

import msgspec

from paged.scheduler.boundary import CachedRequestData, NewRequestData, SchedulerOutput
from paged.scheduler.state import SchedulerState, StepPlan
from paged.scheduler.steps.encoder_inputs import free_consumed_encoder_inputs


def build_scheduler_output(state: SchedulerState, plan: StepPlan) -> SchedulerOutput:
    new_block_ids = plan.new_block_ids
    new_reqs = [
        NewRequestData(
            req_id=r.request_id,
            prompt_token_ids=r.prompt_token_ids,
            sampling_params=r.sampling_params,
            block_ids=new_block_ids[r.request_id] or state.kv.get_block_ids(r.request_id),
            num_computed_tokens=r.num_computed_tokens,
            mm_features=r.mm_features or None,
            lora_request=r.lora_name,
            pooling_params=r.pooling_params,
            lora_path=r.lora_path,
        )
        for r in plan.scheduled_new
    ]
    cached = _cached_request_data(plan, send_step_tokens=state.config.pipeline_parallel_size > 1)
    if state.running:
        common = state.kv.get_num_common_prefix_blocks(state.running[0].request_id)
    else:
        common = [0] * state.num_kv_cache_groups
    output = SchedulerOutput(
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=plan.num_scheduled_tokens,
        total_num_scheduled_tokens=sum(plan.num_scheduled_tokens.values()),
        scheduled_spec_decode_tokens=plan.spec_decode_tokens,
        scheduled_encoder_inputs=plan.encoder_inputs,
        num_common_prefix_blocks=list(common),
        finished_req_ids=sorted(state.finished_req_ids),
        preempted_req_ids=[r.request_id for r in plan.preempted],
        free_encoder_mm_hashes=state.encoder_cache.get_freed_mm_hashes(),
    )
    if state.kv_connector is not None:
        meta = state.kv_connector.build_connector_meta(output)
        output = msgspec.structs.replace(output, kv_connector_metadata=meta)
    if state.ec_connector is not None:
        # The connector's own metadata struct, as bytes: its worker side decodes it.
        ec_meta = msgspec.msgpack.encode(state.ec_connector.build_connector_meta(output))
        output = msgspec.structs.replace(output, ec_connector_metadata=ec_meta)
    return output


def _cached_request_data(plan: StepPlan, *, send_step_tokens: bool = False) -> CachedRequestData:
    """Deltas of running and resumed requests.

    send_step_tokens (pipeline parallel): each running request's tokens to
    compute this step, so stages that do not sample learn the sampled ones.
    """
    running, resumed = plan.scheduled_running, plan.scheduled_resumed
    if not running and not resumed:
        return CachedRequestData()
    new_block_ids = plan.new_block_ids
    req_ids = [r.request_id for r in running]
    resumed_flags = [False] * len(running)
    token_ids: list[list[int]] = [[] for _ in running]
    if send_step_tokens:
        token_ids = [
            r.all_token_ids[
                r.num_computed_tokens : r.num_computed_tokens
                + plan.num_scheduled_tokens[r.request_id]
            ]
            for r in running
        ]
    block_ids = [new_block_ids[i] for i in req_ids]
    computed = [r.num_computed_tokens for r in running]
    outputs = [r.num_output_tokens for r in running]
    for r in resumed:
        req_ids.append(r.request_id)
        resumed_flags.append(True)
        token_ids.append(list(r.output_token_ids))
        block_ids.append(new_block_ids[r.request_id])
        computed.append(r.num_computed_tokens)
        outputs.append(r.num_output_tokens)
    return CachedRequestData(
        req_ids=req_ids,
        resumed_from_preemption=resumed_flags,
        new_token_ids=token_ids,
        new_block_ids=block_ids,
        num_computed_tokens=computed,
        num_output_tokens=outputs,
    )


def advance_after_schedule(state: SchedulerState, output: SchedulerOutput) -> None:
    """Count scheduled tokens as computed now, so the next step can follow at once.

    Rejected draft tokens are taken back in `update_from_output`.
    """
    requests = state.requests
    encoder_cache = state.encoder_cache
    for req_id, num in output.num_scheduled_tokens.items():
        request = requests[req_id]
        request.num_computed_tokens += num
        if request.mm_features:
            free_consumed_encoder_inputs(request, encoder_cache)
    state.finished_req_ids.clear()
    state.last_num_scheduled_tokens = output.total_num_scheduled_tokens
