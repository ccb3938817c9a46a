"""OutputProcessor: `EngineCoreOutput`s -> user-facing `RequestOutput`s (seed: OutputProcessor).

Runs in the frontend process. Per engine request it keeps a `RequestState`
(detokenizer, logprobs, timing); a user request with `n > 1` is fanned out
into `n` engine requests that a `ParentRequest` gathers back into one
`RequestOutput`. Stop strings are found here, not in the engine, so a request
that hit one is reported in `reqs_to_abort` for the caller to abort.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from paged.scheduler import EngineCoreOutput, EngineCoreRequest, FinishReason, RequestOutputKind
from paged.server.collector import RequestOutputCollector
from paged.server.detokenizer import IncrementalDetokenizer
from paged.server.kv_transfer import kv_transfer_params_to_dict
from paged.server.logprobs import LogprobsProcessor
from paged.server.outputs import CompletionOutput, RequestMetrics, RequestOutput
from paged.server.parent import ParentRequest
from paged.server.pooling_outputs import (
    PoolingOutput,
    PoolingOutputCollector,
    PoolingRequestOutput,
    tensor_from_pooler_output,
)
from paged.server.stats import FinishedRequestStats, IterationStats
from paged.server.tokenizer import TokenizerLike


class RequestState:
    """Frontend state of one engine request (one sample of a user request)."""

    def __init__(
        self,
        request: EngineCoreRequest,
        tokenizer: TokenizerLike,
        prompt: str | None,
        parent: ParentRequest | None,
        index: int,
        queue: RequestOutputCollector | None,
        external_req_id: str | None = None,
    ) -> None:
        params = request.sampling_params
        self.request_id = request.request_id
        # The caller's id, which `RequestOutput.request_id` shows; the engine's ids
        # may add a suffix to it (AsyncLLM) and a child index (n > 1).
        self.external_id = external_req_id or (
            parent.request_id if parent is not None else request.request_id
        )
        self.parent = parent
        self.index = index
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.output_kind = params.output_kind
        self.queue = queue
        self.detokenizer = IncrementalDetokenizer(
            tokenizer,
            request.prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )
        self.logprobs = LogprobsProcessor(tokenizer, params.logprobs, params.prompt_logprobs)
        self.metrics = RequestMetrics(arrival_time=request.arrival_time)
        self.num_cached_tokens = 0
        self.kv_transfer_params: dict[str, Any] | None = None
        self.ec_transfer_params: dict[str, Any] | None = None
        # A pooling request: one PoolingRequestOutput when it finishes (no text).
        self.is_pooling = request.pooling_params is not None
        self.pooling_queue: PoolingOutputCollector | None = None
        self._num_sent_tokens = 0  # token ids already returned (delta mode)
        self._num_sent_logprobs = 0

    def make_completion(
        self, finish: str | None, stop_reason: int | str | None
    ) -> CompletionOutput:
        finished = finish is not None
        delta = self.output_kind == RequestOutputKind.DELTA
        text = self.detokenizer.get_next_output_text(finished, delta)
        token_ids = self.detokenizer.output_token_ids
        logprobs = self.logprobs.logprobs
        if delta:
            token_ids = token_ids[self._num_sent_tokens :]
            self._num_sent_tokens += len(token_ids)
            if logprobs is not None:
                logprobs = logprobs[self._num_sent_logprobs :]
                self._num_sent_logprobs += len(logprobs)
        else:
            token_ids = list(token_ids)
            logprobs = list(logprobs) if logprobs is not None else None
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.logprobs.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=finish,
            stop_reason=stop_reason,
        )

    def make_request_output(
        self, completion: CompletionOutput, finished: bool, detail: str | None
    ) -> RequestOutput:
        prompt_lps = self.logprobs.prompt_logprobs
        return RequestOutput(
            request_id=self.external_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=list(prompt_lps) if prompt_lps is not None else None,
            outputs=[completion],
            finished=finished,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self.metrics,
            error=detail if completion.finish_reason == "error" else None,
            finish_detail=detail,
            kv_transfer_params=self.kv_transfer_params if finished else None,
            ec_transfer_params=self.ec_transfer_params if finished else None,
        )


@dataclass
class OutputProcessorOutput:
    """What one `process_outputs` call produced."""

    request_outputs: list[RequestOutput] = field(default_factory=list)
    # Finished pooling requests without a collector (the in-process LLM).
    pooling_outputs: list[PoolingRequestOutput[PoolingOutput]] = field(default_factory=list)
    reqs_to_abort: list[str] = field(default_factory=list)


class OutputProcessor:
    """Detokenizes engine outputs and routes them to per-request collectors.

    With `AsyncLLM` every request has a `RequestOutputCollector` and outputs
    go there; with `LLM` (no collector) they are returned from
    `process_outputs`. Requests are forgotten once finished or aborted.
    """

    def __init__(self, tokenizer: TokenizerLike) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        parent: ParentRequest | None = None,
        index: int = 0,
        queue: RequestOutputCollector | None = None,
        external_req_id: str | None = None,
        pooling_queue: PoolingOutputCollector | None = None,
    ) -> None:
        if request.request_id in self.request_states:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        state = RequestState(request, self.tokenizer, prompt, parent, index, queue, external_req_id)
        state.pooling_queue = pooling_queue
        self.request_states[request.request_id] = state
        if parent is not None:
            self.parent_requests[parent.request_id] = parent

    def ids_of_external(self, external_ids: Sequence[str]) -> list[str]:
        """The unfinished requests (parent or engine ids) the caller named `external_ids`.

        A scan: only an abort by the caller's id asks (a client going away aborts
        by the engine id its collector holds).
        """
        wanted = set(external_ids)
        found: dict[str, None] = {}
        for state in self.request_states.values():
            if state.external_id in wanted:
                top = state.parent.request_id if state.parent is not None else state.request_id
                found[top] = None
        return list(found)

    def engine_ids_of(self, request_ids: Sequence[str]) -> list[str]:
        """The engine ids still unfinished behind `request_ids` (engine or parent ids)."""
        found: list[str] = []
        for rid in request_ids:
            parent = self.parent_requests.get(rid)
            ids = parent.child_ids() if parent is not None else [rid]
            found.extend(child for child in ids if child in self.request_states)
        return found

    def abort_requests(
        self, request_ids: list[str], iteration_stats: IterationStats | None = None
    ) -> list[str]:
        """Forget requests (engine ids or parent ids); return the engine ids removed.

        Each removed request is counted as finished with reason ABORT.
        """
        removed: list[str] = []
        now = time.time()
        for rid in request_ids:
            parent = self.parent_requests.pop(rid, None)
            ids = parent.child_ids() if parent is not None else [rid]
            for child in ids:
                state = self.request_states.get(child)
                if state is not None:
                    removed.append(child)
                    self._finish(state, FinishReason.ABORT, now, iteration_stats)
                    if state.parent is not None:
                        self.parent_requests.pop(state.parent.request_id, None)
        return removed

    def propagate_error(
        self, error: BaseException, iteration_stats: IterationStats | None = None
    ) -> None:
        """Fail every in-flight request (the engine died): nothing may hang.

        Each one is counted as finished with reason ERROR: the engine will
        never report them, so the stats would otherwise show them forever.
        """
        now = time.time()
        for state in list(self.request_states.values()):
            if state.queue is not None:
                state.queue.put_error(error)
            if state.pooling_queue is not None:
                state.pooling_queue.put_error(error)
            self._finish(state, FinishReason.ERROR, now, iteration_stats)
        self.request_states.clear()
        self.parent_requests.clear()

    def process_outputs(
        self,
        outputs: list[EngineCoreOutput],
        engine_timestamp: float | None = None,
        iteration_stats: IterationStats | None = None,
    ) -> OutputProcessorOutput:
        result = OutputProcessorOutput()
        now = time.time()
        for out in outputs:
            state = self.request_states.get(out.request_id)
            if state is None:
                continue  # aborted by the frontend meanwhile
            if state.is_pooling:
                self._process_pooling(state, out, now, result, iteration_stats)
                continue
            self._update_stats(state, out, now, iteration_stats)
            finish, stop_reason = out.finish_reason, out.stop_reason
            engine_finished = finish is not None
            stop_str = state.detokenizer.update(out.new_token_ids, engine_finished)
            state.logprobs.update_sample(out.new_logprobs)
            state.logprobs.update_prompt(out.new_prompt_logprobs)
            if out.kv_transfer_params is not None:
                state.kv_transfer_params = kv_transfer_params_to_dict(out.kv_transfer_params)
            if out.ec_transfer_params is not None:
                state.ec_transfer_params = out.ec_transfer_params
            if stop_str is not None:
                state.logprobs.truncate(len(state.detokenizer.output_token_ids))
                finish, stop_reason = FinishReason.STOP, stop_str
                if not engine_finished:
                    result.reqs_to_abort.append(out.request_id)
            request_output = self._make_output(state, finish, stop_reason, out.finish_detail)
            if request_output is not None:
                if state.queue is not None:
                    state.queue.put(request_output)
                else:
                    result.request_outputs.append(request_output)
            if finish is not None:
                self._finish(state, finish, now, iteration_stats)
        return result

    def _process_pooling(
        self,
        state: RequestState,
        out: EngineCoreOutput,
        now: float,
        result: OutputProcessorOutput,
        stats: IterationStats | None,
    ) -> None:
        """A pooling request reports once, finished: its pooled tensor or its error."""
        if out.finish_reason is None:
            return
        if stats is not None:
            stats.num_prompt_tokens += len(state.prompt_token_ids)
            stats.num_pooling_requests += 1
        error = None
        data = None
        if out.pooling_output is not None:
            data = tensor_from_pooler_output(out.pooling_output)
        else:
            error = out.finish_detail or f"pooling request finished with {out.finish_reason}"
        import torch

        output: PoolingRequestOutput[PoolingOutput] = PoolingRequestOutput(
            state.external_id,
            PoolingOutput(data if data is not None else torch.empty(0)),
            list(state.prompt_token_ids),
            out.num_cached_tokens,
            True,
            error=error,
        )
        if state.pooling_queue is not None:
            state.pooling_queue.put(output)
        else:
            result.pooling_outputs.append(output)
        self._finish(state, out.finish_reason, now, stats)

    def _make_output(
        self,
        state: RequestState,
        finish: FinishReason | None,
        stop_reason: int | str | None,
        detail: str | None,
    ) -> RequestOutput | None:
        finished = finish is not None
        if state.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        completion = state.make_completion(str(finish) if finish is not None else None, stop_reason)
        if state.parent is None:
            return state.make_request_output(completion, finished, detail)
        outputs, all_finished = state.parent.get_outputs(completion)
        if not outputs:
            return None
        out = state.make_request_output(completion, all_finished, detail)
        out.outputs = outputs
        return out

    def _update_stats(
        self, state: RequestState, out: EngineCoreOutput, now: float, stats: IterationStats | None
    ) -> None:
        num_new = len(out.new_token_ids)
        if num_new == 0:
            return
        m = state.metrics
        if m.first_token_time is None:
            m.first_token_time = now
            state.num_cached_tokens = out.num_cached_tokens
            if stats is not None:
                stats.time_to_first_tokens.append(now - m.arrival_time)
                stats.num_prompt_tokens += len(state.prompt_token_ids)
        elif stats is not None and m.last_token_time is not None:
            stats.inter_token_latencies.append(now - m.last_token_time)
        m.last_token_time = now
        m.num_generation_tokens += num_new
        if stats is not None:
            stats.num_generation_tokens += num_new

    def _finish(
        self, state: RequestState, finish: FinishReason, now: float, stats: IterationStats | None
    ) -> None:
        self.request_states.pop(state.request_id, None)
        if state.parent is not None and state.parent.all_finished():
            self.parent_requests.pop(state.parent.request_id, None)
        state.metrics.finished_time = now
        if stats is not None:
            stats.finished_requests.append(
                FinishedRequestStats(
                    finish_reason=finish,
                    e2e_latency=now - state.metrics.arrival_time,
                    num_prompt_tokens=len(state.prompt_token_ids),
                    num_generation_tokens=state.metrics.num_generation_tokens,
                )
            )
