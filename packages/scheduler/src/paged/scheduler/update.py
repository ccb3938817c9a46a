"""`update_from_output`: fold one `ModelRunnerOutput` back into the requests.

Per scheduled request: roll back rejected draft tokens, append the sampled
tokens one at a time with a stop check after each (extra tokens after a stop
are dropped), fail requests whose logits held NaNs, free finished requests,
and emit an `EngineCoreOutput` when there is something to report.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paged.scheduler.boundary import (
    EngineCoreOutput,
    KVTransferParams,
    LogprobsLists,
    ModelRunnerOutput,
    SchedulerOutput,
)
from paged.scheduler.remote_kv import connector_finished, release_blocks
from paged.scheduler.request import Request, RequestStatus
from paged.scheduler.state import SchedulerState
from paged.scheduler.stop import check_stop
from paged.scheduler.structured_output import StructuredOutputProvider


@dataclass(slots=True)
class StepResults:
    """Outputs of one update, grouped by frontend client."""

    outputs: dict[int, list[EngineCoreOutput]] = field(default_factory=dict)

    def add(self, client_index: int, output: EngineCoreOutput) -> None:
        bucket = self.outputs.get(client_index)
        if bucket is None:
            self.outputs[client_index] = [output]
        else:
            bucket.append(output)


def append_and_check(
    request: Request, token_ids: list[int], max_model_len: int
) -> tuple[list[int], bool]:
    """Append tokens one by one, stopping at the first that ends the request."""
    if len(token_ids) == 1:
        request.append_output_token_ids(token_ids[0])
        return token_ids, check_stop(request, max_model_len)
    for n, token in enumerate(token_ids, 1):
        request.append_output_token_ids(token)
        if check_stop(request, max_model_len):
            return token_ids[:n], True
    return token_ids, False


def free_request(state: SchedulerState, request: Request) -> KVTransferParams | None:
    """Release a request that just reached a finished status (blocks maybe later)."""
    req_id = request.request_id
    # Aborted during an async load the worker has not reported done: it may
    # still be writing into the blocks.
    was_loading = (
        request.kv_load_target_tokens > 0 and req_id not in state.finished_recving_kv_req_ids
    )
    state.finished_recving_kv_req_ids.discard(req_id)
    state.failed_recving_kv_req_ids.discard(req_id)
    delay, params = connector_finished(state, request, was_loading)
    state.encoder_cache.free(request)
    state.finished_req_ids.add(req_id)
    per_client = state.finished_req_ids_per_client.get(request.client_index)
    if per_client is None:
        state.finished_req_ids_per_client[request.client_index] = {req_id}
    else:
        per_client.add(req_id)
    if delay:
        state.delayed_free_req_ids.add(req_id)
    else:
        release_blocks(state, request)
    return params


def _trim_logprobs(logprobs: LogprobsLists | None, n: int) -> LogprobsLists | None:
    if logprobs is None or len(logprobs.ranks) <= n:
        return logprobs
    return LogprobsLists(logprobs.token_ids[:n], logprobs.logprobs[:n], logprobs.ranks[:n])


def update_requests(
    state: SchedulerState,
    so: SchedulerOutput,
    mro: ModelRunnerOutput,
    failed_kv_load: set[str],
    structured: StructuredOutputProvider | None,
) -> StepResults:
    results = StepResults()
    requests = state.requests
    max_model_len = state.config.max_model_len
    index = {req_id: i for i, req_id in enumerate(mro.req_ids)}
    sampled = mro.sampled_token_ids
    spec = so.scheduled_spec_decode_tokens
    nans = mro.num_nans_in_logits
    stopped_running: set[str] = set()
    stopped_preempted: list[Request] = []
    running_status = RequestStatus.RUNNING
    for req_id in so.num_scheduled_tokens:
        request = requests.get(req_id)
        if request is None or request.is_finished():
            continue  # finished (e.g. aborted) while the step ran
        if req_id in failed_kv_load:
            continue  # recomputed from the last valid block next step
        i = index.get(req_id)
        generated = sampled[i] if i is not None else []
        running = request.status is running_status
        if running:
            drafts = spec.get(req_id) if spec else None
            if drafts and generated:
                # One bonus token plus the accepted drafts came back.
                request.num_computed_tokens -= len(drafts) + 1 - len(generated)
            if request.num_computed_tokens < request.num_tokens:
                generated = []  # a partial prefill chunk samples nothing
        # else: preempted after this step was scheduled (pipelined steps). As in
        # vLLM its sampled tokens are kept; it recomputes them with the rest.
        stopped = False
        new_tokens: list[int] = []
        if nans and nans.get(req_id, 0) > 0:
            request.status = RequestStatus.FINISHED_ERROR
            request.num_nans_in_logits = nans[req_id]
            request.finish_detail = f"{nans[req_id]} NaN values in the logits"
            stopped = True
        elif generated:
            new_tokens, stopped = append_and_check(request, generated, max_model_len)
            if structured is not None and not structured.accept_tokens(req_id, new_tokens):
                request.status = RequestStatus.FINISHED_ERROR
                request.finish_detail = "sampled token rejected by the grammar"
                stopped = True
        kv_params = None
        if stopped:
            if running:
                stopped_running.add(req_id)
            else:
                stopped_preempted.append(request)
            kv_params = free_request(state, request)
        prompt_logprobs = mro.prompt_logprobs.get(req_id) if mro.prompt_logprobs else None
        if new_tokens or stopped or prompt_logprobs is not None or kv_params is not None:
            logprobs = mro.logprobs.get(req_id) if mro.logprobs else None
            results.add(
                request.client_index,
                EngineCoreOutput(
                    request_id=req_id,
                    new_token_ids=new_tokens,
                    new_logprobs=_trim_logprobs(logprobs, len(new_tokens)),
                    new_prompt_logprobs=prompt_logprobs,
                    finish_reason=request.get_finished_reason(),
                    stop_reason=request.stop_reason,
                    finish_detail=request.finish_detail,
                    kv_transfer_params=kv_params,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                ),
            )
    if stopped_running:
        state.running = [r for r in state.running if r.request_id not in stopped_running]
    if stopped_preempted:
        state.waiting.remove_requests(stopped_preempted)
    return results
