"""Apply a `SchedulerOutput`'s request diffs to the runner's state (vLLM `_update_states`).

Order matters and follows vLLM:

1. finished requests: forget them entirely;
2. preempted requests: leave the batch, keep their `CachedRequestState`;
3. batch rows not scheduled this step: leave the batch (state kept);
4. new requests: build a state;
5. cached requests: update computed counts, tokens, block ids; a request
   resumed from preemption replaces its block table and output tokens;
6. (re-)add every scheduled request that is not in the batch, then condense.

Pipeline parallelism (`stage`): only the last stage samples. With PP the
scheduler sends each running request's input tokens for the step
(`new_token_ids[i]` = all tokens [computed, computed + scheduled)); a stage
before the last appends those it has not seen (the tokens sampled on the last
stage), the last stage ignores them (it appended its own samples), as vLLM.
"""

from __future__ import annotations

import torch

from paged.runner.input_batch import CachedRequestState, InputBatch
from paged.runner.pipeline.stage import PipelineStage
from paged.scheduler.boundary import CachedRequestData, NewRequestData, SchedulerOutput


def update_states(
    requests: dict[str, CachedRequestState],
    batch: InputBatch,
    scheduler_output: SchedulerOutput,
    generator_device: torch.device,
    stage: PipelineStage | None = None,
    lora_enabled: bool = False,
) -> None:
    """Bring `requests` and `batch` to the state `scheduler_output` describes.

    A request naming a LoRA adapter is refused unless `lora_enabled` (the
    runner was built with a LoRAConfig).
    """
    for req_id in scheduler_output.finished_req_ids:
        requests.pop(req_id, None)
        batch.remove_request(req_id)
    for req_id in scheduler_output.preempted_req_ids:
        batch.remove_request(req_id)
    scheduled = scheduler_output.num_scheduled_tokens
    for req_id in batch.req_ids:
        if req_id not in scheduled:
            batch.remove_request(req_id)

    for new_req in scheduler_output.scheduled_new_reqs:
        requests[new_req.req_id] = _new_state(new_req, generator_device, lora_enabled)

    cached = scheduler_output.scheduled_cached_reqs
    _check_cached_lengths(cached)
    for i, req_id in enumerate(cached.req_ids):
        state = requests.get(req_id)
        if state is None:
            raise ValueError(
                f"scheduler_output: cached request {req_id!r} is unknown to the runner "
                "(it was never sent as a new request, or already finished)"
            )
        _apply_cached_diff(state, batch, cached, i, stage)

    for req_id in scheduled:
        if req_id not in requests:
            raise ValueError(
                f"scheduler_output: num_scheduled_tokens names {req_id!r}, which is neither "
                "a new nor a cached request"
            )
        if req_id not in batch.req_id_to_index:
            batch.add_request(requests[req_id])
    batch.condense()


def _new_state(
    new_req: NewRequestData, device: torch.device, lora_enabled: bool
) -> CachedRequestState:
    if new_req.lora_request is not None and not lora_enabled:
        raise ValueError(
            f"scheduler_output: request {new_req.req_id!r} asks for LoRA adapter "
            f"{new_req.lora_request!r}, but LoRA is not enabled (start with --enable-lora)"
        )
    params = new_req.sampling_params
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device=device)
        generator.manual_seed(params.seed)
    return CachedRequestState(
        req_id=new_req.req_id,
        prompt_token_ids=list(new_req.prompt_token_ids),
        sampling_params=params,
        block_ids=tuple(list(ids) for ids in new_req.block_ids),
        num_computed_tokens=new_req.num_computed_tokens,
        mm_features=new_req.mm_features,
        lora_request=new_req.lora_request,
        generator=generator,
    )


def _check_cached_lengths(cached: CachedRequestData) -> None:
    n = len(cached.req_ids)
    for name, values in (
        ("resumed_from_preemption", cached.resumed_from_preemption),
        ("new_token_ids", cached.new_token_ids),
        ("new_block_ids", cached.new_block_ids),
        ("num_computed_tokens", cached.num_computed_tokens),
    ):
        if len(values) != n:
            raise ValueError(
                f"scheduler_output.scheduled_cached_reqs.{name} has {len(values)} entries "
                f"for {n} req_ids"
            )


def _apply_cached_diff(
    state: CachedRequestState,
    batch: InputBatch,
    cached: CachedRequestData,
    i: int,
    stage: PipelineStage | None = None,
) -> None:
    resumed = cached.resumed_from_preemption[i]
    new_tokens = cached.new_token_ids[i]
    new_blocks = cached.new_block_ids[i]
    state.num_computed_tokens = cached.num_computed_tokens[i]

    if resumed:
        # The scheduler sends all output tokens of a resumed request and its
        # whole block table; both replace what the runner held.
        state.output_token_ids = list(new_tokens)
        if new_blocks is not None:
            state.block_ids = tuple(list(ids) for ids in new_blocks)
        batch.remove_request(state.req_id)  # re-added from the fresh state
        return

    if stage is not None and stage.pp_size > 1:
        new_tokens = _unseen_step_tokens(state, new_tokens, stage)
    if new_tokens:
        # Tokens the runner cannot know itself (e.g. sampled on another rank).
        state.output_token_ids.extend(new_tokens)
    if cached.num_output_tokens and i < len(cached.num_output_tokens):
        # Drop tokens the scheduler did not keep (e.g. rejected drafts).
        del state.output_token_ids[cached.num_output_tokens[i] :]
    if new_blocks is not None:
        for group, ids in zip(state.block_ids, new_blocks, strict=True):
            group.extend(ids)

    row = batch.req_id_to_index.get(state.req_id)
    if row is None:
        return  # added from the state below
    batch.num_computed_tokens_cpu[row] = state.num_computed_tokens
    if new_blocks is not None:
        batch.block_table.append_row(new_blocks, row)
    if new_tokens or batch.num_tokens[row] != state.num_tokens:
        _sync_tokens(batch, row, state)


def _unseen_step_tokens(
    state: CachedRequestState, step_tokens: list[int], stage: PipelineStage
) -> list[int]:
    """The tail of this step's input tokens this stage has not seen (PP; see module docstring)."""
    if stage.is_last:
        return []  # this stage sampled them and already holds them
    unseen = state.num_computed_tokens + len(step_tokens) - state.num_tokens
    return step_tokens[-unseen:] if unseen > 0 else []


def _sync_tokens(batch: InputBatch, row: int, state: CachedRequestState) -> None:
    n_prompt = state.num_prompt_tokens
    batch.token_ids_cpu[row, n_prompt : state.num_tokens] = state.output_token_ids
    batch.num_tokens[row] = state.num_tokens
