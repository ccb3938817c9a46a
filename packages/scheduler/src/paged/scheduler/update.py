"""`update_from_output`: fold one `ModelRunnerOutput` back into the requests.

Per scheduled request: roll back rejected draft tokens, append the sampled
tokens one at a time with a stop check after each (extra tokens after a stop
are dropped), fail requests whose logits held NaNs, free finished requests,
and emit an `EngineCoreOutput` when there is something to report.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from paged.scheduler.boundary import (
    EngineCoreOutput,
    FinishReason,
    KVTransferParams,
    LogprobsLists,
    ModelRunnerOutput,
    SchedulerOutput,
)
from paged.scheduler.remote_kv import connector_finished, release_blocks
from paged.scheduler.request import FINISHED_STATUSES, Request, RequestStatus, finish_reason_of
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


class FinishedParams(NamedTuple):
    """What the connectors returned for a finished request (for its last output)."""

    kv: KVTransferParams | None
    ec: dict[str, Any] | None


def free_request(state: SchedulerState, request: Request) -> FinishedParams:
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
    # vLLM's gap 2: the EC connector hears of every end; it may keep the entries.
    ec_delay, ec_params = state.ec_transfer.request_ended(
        request, state.encoder_cache, state.ec_connector
    )
    if not ec_delay:
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
    return FinishedParams(params, ec_params)


def finish_requests(
    state: SchedulerState,
    request_ids: Iterable[str],
    status: RequestStatus,
    structured: StructuredOutputProvider | None,
) -> list[Request]:
    """Finish requests outside a model step; returns those finished (unknown/finished skipped)."""
    to_finish: list[Request] = []
    for req_id in request_ids:
        req = state.requests.get(req_id)
        if req is not None and not req.is_finished() and req not in to_finish:
            to_finish.append(req)
    if not to_finish:
        return to_finish
    running_gone = {id(r) for r in to_finish if r.status is RequestStatus.RUNNING}
    if running_gone:
        state.running = [r for r in state.running if id(r) not in running_gone]
    state.waiting.remove_requests([r for r in to_finish if r.status is not RequestStatus.RUNNING])
    for req in to_finish:
        req.status = status
        if structured is not None:
            structured.remove_request(req.request_id)
        free_request(state, req)
    return to_finish


def fail_kv_loads(
    state: SchedulerState, request_ids: set[str], structured: StructuredOutputProvider | None
) -> None:
    """kv_load_failure_policy "fail": finish requests whose KV load failed with ERROR.

    As vLLM: FINISHED_ERROR, blocks freed (a still-running async load keeps
    them until the worker reports it done), and one output with no tokens and
    finish_reason ERROR queued for the next `update_from_output` result. The
    bad blocks already left the prefix cache (`process_connector_output`).
    """
    for req in finish_requests(
        state, sorted(request_ids), RequestStatus.FINISHED_ERROR, structured
    ):
        req.finish_detail = "KV cache load failed (kv_load_failure_policy: fail)"
        cached = req.num_cached_tokens
        output = EngineCoreOutput(
            request_id=req.request_id,
            new_token_ids=[],
            finish_reason=FinishReason.ERROR,
            finish_detail=req.finish_detail,
            num_cached_tokens=cached if cached > 0 else 0,
        )
        state.pending_outputs.append((req.client_index, output))


def fail_ec_loads(
    state: SchedulerState, request_ids: set[str], structured: StructuredOutputProvider | None
) -> None:
    """ec_load_failure_policy "fail": finish requests whose encoder-cache load failed."""
    for req in finish_requests(
        state, sorted(request_ids), RequestStatus.FINISHED_ERROR, structured
    ):
        req.finish_detail = "encoder cache load failed (ec_load_failure_policy: fail)"
        cached = req.num_cached_tokens
        output = EngineCoreOutput(
            request_id=req.request_id,
            new_token_ids=[],
            finish_reason=FinishReason.ERROR,
            finish_detail=req.finish_detail,
            num_cached_tokens=cached if cached > 0 else 0,
        )
        state.pending_outputs.append((req.client_index, output))


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
    """Fold `mro` into the scheduled requests; the outputs to send, per client.

    The hot path is a decode step of a few hundred RUNNING requests sampling one
    token each, so the loop avoids per-request work that cannot apply: RUNNING
    is tested by identity before the finished-status set (hashing an Enum is a
    Python-level call), the finish reason is looked up only for requests that
    stopped, and outputs are built positionally. The loop stays one function on
    purpose: a helper call per request costs ~10% of a 256-decode update.
    """
    outputs: dict[int, list[EngineCoreOutput]] = {}
    requests = state.requests
    max_model_len = state.config.max_model_len
    encode_only = state.config.encode_only
    index = {req_id: i for i, req_id in enumerate(mro.req_ids)}
    sampled = mro.sampled_token_ids
    spec = so.scheduled_spec_decode_tokens
    nans = mro.num_nans_in_logits
    logprobs_by_id = mro.logprobs
    prompt_logprobs_by_id = mro.prompt_logprobs
    pooled_by_id = mro.pooler_output
    stopped_running: set[str] = set()
    stopped_preempted: list[Request] = []
    running_status = RequestStatus.RUNNING
    for req_id in so.num_scheduled_tokens:
        request = requests.get(req_id)
        if request is None:
            continue  # freed while the step ran
        running = request.status is running_status
        if not running and request.status in FINISHED_STATUSES:
            continue  # finished (e.g. aborted) while the step ran
        if failed_kv_load and req_id in failed_kv_load:
            continue  # recomputed from the last valid block next step
        i = index.get(req_id)
        generated = sampled[i] if i is not None else []
        if running:
            drafts = spec.get(req_id) if spec else None
            if drafts and generated:
                # One bonus token plus the accepted drafts came back.
                request.num_computed_tokens -= len(drafts) + 1 - len(generated)
            if request.num_computed_tokens < len(request.all_token_ids):
                generated = []  # a partial prefill chunk samples nothing
        # else: preempted after this step was scheduled (pipelined steps). As in
        # vLLM its sampled tokens are kept; it recomputes them with the rest.
        if nans and nans.get(req_id, 0) > 0:
            new_tokens, stopped = _fail_on_nans(request, nans[req_id])
        elif len(generated) == 1:  # the decode case, without append_and_check's loop
            request.append_output_token_ids(generated[0])
            new_tokens, stopped = generated, check_stop(request, max_model_len)
        elif generated:
            new_tokens, stopped = append_and_check(request, generated, max_model_len)
        else:
            new_tokens, stopped = [], False
            pooled = pooled_by_id.get(req_id) if pooled_by_id else None
            if pooled is not None and request.pooling_params is not None:
                # The runner pooled the last prefill chunk: the request is done
                # (vllm/v1/core/sched/scheduler.py:2416, FINISHED_STOPPED).
                request.status = RequestStatus.FINISHED_STOPPED
                stopped = True
            elif (
                encode_only and running and request.num_computed_tokens >= request.num_prompt_tokens
            ):
                # EPD producer: the prompt (so every image) went through the encoder.
                request.status = RequestStatus.FINISHED_LENGTH_CAPPED
                stopped = True
        if (
            structured is not None
            and new_tokens
            and _grammar_rejects(structured, request, req_id, new_tokens)
        ):
            stopped = True  # checked even after a stop token, as the tokens were appended
        kv_params = ec_params = None
        if stopped:
            if running:
                stopped_running.add(req_id)
            else:
                stopped_preempted.append(request)
            kv_params, ec_params = free_request(state, request)
        prompt_logprobs = prompt_logprobs_by_id.get(req_id) if prompt_logprobs_by_id else None
        if new_tokens or stopped or prompt_logprobs is not None:
            logprobs = logprobs_by_id.get(req_id) if logprobs_by_id else None
            if logprobs is not None:
                logprobs = _trim_logprobs(logprobs, len(new_tokens))
            cached = request.num_cached_tokens
            output = EngineCoreOutput(  # positional: field order of EngineCoreOutput
                req_id,
                new_tokens,
                logprobs,
                prompt_logprobs,
                finish_reason_of(request.status) if stopped else None,
                request.stop_reason,
                request.finish_detail,
                kv_params,
                cached if cached > 0 else 0,
                ec_params,
                pooled_by_id.get(req_id) if stopped and pooled_by_id else None,
            )
            bucket = outputs.get(request.client_index)
            if bucket is None:
                outputs[request.client_index] = [output]
            else:
                bucket.append(output)
    if stopped_running:
        state.running = [r for r in state.running if r.request_id not in stopped_running]
    if stopped_preempted:
        state.waiting.remove_requests(stopped_preempted)
    return StepResults(outputs)


def _fail_on_nans(request: Request, num_nans: int) -> tuple[list[int], bool]:
    request.status = RequestStatus.FINISHED_ERROR
    request.num_nans_in_logits = num_nans
    request.finish_detail = f"{num_nans} NaN values in the logits"
    return [], True


def _grammar_rejects(
    structured: StructuredOutputProvider, request: Request, req_id: str, tokens: list[int]
) -> bool:
    if structured.accept_tokens(req_id, tokens):
        return False
    request.status = RequestStatus.FINISHED_ERROR
    request.finish_detail = "sampled token rejected by the grammar"
    return True
