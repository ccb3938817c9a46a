"""`Scheduler`: continuous batching over paged.kvcache (seed: コアループ, Scheduler と KVCache).

One step, as EngineCore drives it:

    so  = scheduler.schedule()                       # running first, then waiting, then output
    mro = executor.execute_model(so) / sample_tokens(scheduler.get_grammar_bitmask(so))
    out = scheduler.update_from_output(so, mro)      # dict[client_index, EngineCoreOutputs]
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Mapping, Sequence

from paged.kvcache import KVCacheConfig, KVCacheManager, get_request_block_hasher, init_none_hash
from paged.kvcache.events import KVCacheEvent
from paged.kvcache.hashing import HashFn, sha256
from paged.kvcache.metrics import KVCacheMetricsCollector
from paged.kvcache.specs import CrossAttentionSpec, FullAttentionSpec
from paged.multimodal.encoder_cache import EncoderCacheManager, compute_mm_encoder_budget
from paged.scheduler.admission import ignored_output, unservable_reason, validate_request
from paged.scheduler.boundary import (
    EngineCoreOutputs,
    EngineCoreRequest,
    GrammarOutput,
    KVCacheEvictionEvent,
    ModelRunnerOutput,
    PrefixCacheStats,
    SchedulerOutput,
    SchedulerStats,
)
from paged.scheduler.budget import StepBudget
from paged.scheduler.config import SchedulerConfig
from paged.scheduler.connectors import ECConnectorScheduler, KVConnectorScheduler
from paged.scheduler.ec_transfer import ECTransferState
from paged.scheduler.queue import RequestQueue, create_request_queue
from paged.scheduler.remote_kv import add_counters, process_connector_output
from paged.scheduler.request import FINISHED_STATUSES, Request, RequestStatus
from paged.scheduler.spec_stats import SpecDecodingCounter
from paged.scheduler.state import SchedulerState, StepPlan
from paged.scheduler.steps.output import advance_after_schedule, build_scheduler_output
from paged.scheduler.steps.running import schedule_running
from paged.scheduler.steps.waiting import schedule_waiting
from paged.scheduler.structured_output import (
    DraftTokenValidator,
    GrammarCompileGate,
    StructuredOutputProvider,
)
from paged.scheduler.update import (
    StepResults,
    fail_ec_loads,
    fail_kv_loads,
    finish_requests,
    update_requests,
)


class Scheduler:
    """Decides, each step, which requests compute how many tokens on which blocks.

    `block_size` is the block size of the (single or hash) KV group used for
    prefix hashing. `max_tokens_per_mm_item` sizes the encoder budgets (0 for
    text-only models). Connectors and the structured-output provider are
    optional plug-ins (Protocols in connectors.py / structured_output.py).
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        kv_cache_config: KVCacheConfig,
        block_size: int,
        *,
        enable_caching: bool = True,
        kv_connector: KVConnectorScheduler | None = None,
        ec_connector: ECConnectorScheduler | None = None,
        structured_output: StructuredOutputProvider | None = None,
        log_stats: bool = True,
        hash_fn: HashFn = sha256,
        hash_seed: int | str | None = None,
        max_tokens_per_mm_item: int = 0,
        enable_kv_cache_events: bool = False,
        include_finished_set: bool = False,
        kv_metrics_collector: KVCacheMetricsCollector | None = None,
        ec_load_failure_policy: str = "recompute",
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if ec_load_failure_policy not in ("recompute", "fail"):
            raise ValueError(
                "ec_load_failure_policy must be 'recompute' or 'fail', "
                f"got {ec_load_failure_policy!r}"
            )
        config = scheduler_config
        if config.disable_chunked_mm_input and max_tokens_per_mm_item > (
            config.max_num_batched_tokens
        ):
            # vLLM's check: an item that may not be split must fit one step.
            raise ValueError(
                f"disable_chunked_mm_input is set but max_tokens_per_mm_item "
                f"({max_tokens_per_mm_item}) is larger than max_num_batched_tokens "
                f"({config.max_num_batched_tokens}); increase max_num_batched_tokens"
            )
        kv = KVCacheManager(
            kv_cache_config,
            config.max_model_len,
            enable_caching=enable_caching,
            hash_block_size=block_size,
            enable_kv_cache_events=enable_kv_cache_events,
            log_stats=log_stats,
            metrics_collector=kv_metrics_collector,
        )
        self.kv_metrics_collector = kv_metrics_collector
        budget = compute_mm_encoder_budget(
            config.resolved_max_num_encoder_input_tokens,
            config.resolved_encoder_cache_size,
            max_tokens_per_mm_item,
        )
        self.config = config
        self.kv_cache_config = kv_cache_config
        self.log_stats = log_stats
        self.include_finished_set = include_finished_set
        self.structured_output = structured_output
        self.encoder_compute_budget = budget.encoder_compute_budget
        self.max_tokens_in_kv_cache = _max_tokens_per_request(kv_cache_config, block_size)
        self.spec_decoding_counter = (
            SpecDecodingCounter(config.num_speculative_tokens)
            if config.num_speculative_tokens and log_stats
            else None
        )
        self._block_hasher = None
        if enable_caching or kv_connector is not None:
            init_none_hash(hash_fn, hash_seed)
            self._block_hasher = get_request_block_hasher(block_size, hash_fn)
        self.state = SchedulerState(
            config=config,
            kv=kv,
            encoder_cache=EncoderCacheManager(budget.encoder_cache_size),
            waiting=create_request_queue(config.policy),
            block_size=block_size,
            num_kv_cache_groups=len(kv_cache_config.kv_cache_groups),
            kv_connector=kv_connector,
            ec_connector=ec_connector,
            max_tokens_in_kv_cache=self.max_tokens_in_kv_cache,
            grammar_ready=(
                structured_output.grammar_ready
                if isinstance(structured_output, GrammarCompileGate)
                else None
            ),
            ec_transfer=ECTransferState(load_failure_policy=ec_load_failure_policy),
        )

    # -- requests in ------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; ValueError (naming the field) if it is malformed.

        A valid request that can never run (prompt beyond max_model_len or the
        whole KV cache, an encoder item beyond the encoder budget) is finished
        at once and reported by the next `update_from_output`.
        """
        state = self.state
        validate_request(request, self.config, state.requests)
        unservable = unservable_reason(
            request,
            self.config,
            self.max_tokens_in_kv_cache,
            state.encoder_cache.cache_size,
            self.encoder_compute_budget,
        )
        if unservable is not None:
            reason, detail = unservable
            output = ignored_output(request, reason, detail)
            state.pending_outputs.append((request.client_index, output))
            state.finished_req_ids_per_client.setdefault(request.client_index, set()).add(
                request.request_id
            )
            return
        req = Request.from_engine_core_request(
            request, max_model_len=self.config.max_model_len, block_hasher=self._block_hasher
        )
        state.requests[req.request_id] = req
        state.waiting.add_request(req)

    def finish_requests(
        self, request_ids: str | Iterable[str], finished_status: RequestStatus
    ) -> None:
        """Finish requests from outside (aborts). Unknown or finished ids are ignored."""
        if finished_status not in FINISHED_STATUSES:
            raise ValueError(f"finished_status must be a finished status, got {finished_status}")
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        finish_requests(self.state, ids, finished_status, self.structured_output)

    def update_draft_token_ids(self, draft_token_ids: Mapping[str, Sequence[int]]) -> None:
        """Draft tokens (speculative decoding) to verify in the next step.

        A constrained request keeps only the drafts its grammar accepts (vLLM's
        `validate_tokens` truncation): a forbidden draft could never be accepted,
        so verifying it would only waste a position.
        """
        validator = (
            self.structured_output
            if isinstance(self.structured_output, DraftTokenValidator)
            else None
        )
        for req_id, drafts in draft_token_ids.items():
            req = self.state.requests.get(req_id)
            if req is not None and req.status is RequestStatus.RUNNING:
                kept = list(drafts)
                if kept and validator is not None and req.sampling_params.structured_outputs:
                    kept = kept[: validator.validate_draft_tokens(req_id, kept)]
                req.spec_token_ids = kept

    # -- one step -----------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        state = self.state
        config = self.config
        # Mamba states cached while the previous step was allocated are written now.
        state.kv.new_step_starts()
        plan = StepPlan(StepBudget(config.max_num_batched_tokens, self.encoder_compute_budget))
        # vLLM: the threshold only matters when requests compete for the step.
        num_eligible = len(state.running) + len(state.waiting)
        threshold = config.long_prefill_token_threshold if num_eligible > 1 else 0
        if threshold > 0 and config.long_prefill_token_threshold_adaptive:
            # vLLM 0.33 (scheduler.py:764-769): never cut a chunk below a fair share.
            threshold = max(threshold, config.max_num_batched_tokens // num_eligible)
        schedule_running(state, plan, threshold)
        if not plan.preempted:
            schedule_waiting(state, plan, threshold)
        output = build_scheduler_output(state, plan)
        advance_after_schedule(state, output)
        if output.scheduled_encoder_inputs:
            state.num_encoder_items_computed_since_stats += sum(
                len(items) for items in output.scheduled_encoder_inputs.values()
            )
        return output

    def get_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """Grammar masks for this step (between execute_model and sample_tokens)."""
        if self.structured_output is None or not scheduler_output.num_scheduled_tokens:
            return None
        requests = self.state.requests
        scheduled = [requests[r] for r in scheduler_output.num_scheduled_tokens if r in requests]
        return self.structured_output.grammar_bitmask(scheduled, scheduler_output)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        state = self.state
        failed: set[str] = set()
        kv_out = model_runner_output.kv_connector_output
        if kv_out is not None:
            failed = process_connector_output(state, kv_out, scheduler_output.num_scheduled_tokens)
            if failed and self.config.kv_load_failure_policy == "fail":
                fail_kv_loads(state, failed, self.structured_output)
                failed = set()
        ec_out = model_runner_output.ec_connector_output
        if ec_out is not None:
            state.num_encoder_items_loaded_since_stats += len(ec_out.finished_recving)
            state.num_encoder_items_released_since_stats += len(ec_out.finished_sending)
            if state.ec_connector is not None:
                state.ec_connector.update_connector_output(ec_out)
            ec_failed = state.ec_transfer.process_output(ec_out, state.encoder_cache)
            if ec_failed:
                fail_ec_loads(state, ec_failed, self.structured_output)
        if self.spec_decoding_counter is not None:
            self.spec_decoding_counter.observe(scheduler_output, model_runner_output)
        results = update_requests(
            state, scheduler_output, model_runner_output, failed, self.structured_output
        )
        if self.structured_output is not None:
            for req_id in state.finished_req_ids:
                self.structured_output.remove_request(req_id)
        return self._collect_outputs(results)

    def _collect_outputs(self, results: StepResults) -> dict[int, EngineCoreOutputs]:
        state = self.state
        by_client = results.outputs
        for client, pending in state.pending_outputs:
            by_client.setdefault(client, []).append(pending)
        state.pending_outputs = []
        finished = state.finished_req_ids_per_client
        clients = set(by_client) | (set(finished) if self.include_finished_set else set())
        stats = self.make_stats()
        if stats is not None and not clients:
            clients = {0}
        now = time.monotonic()
        out: dict[int, EngineCoreOutputs] = {}
        for n, client in enumerate(sorted(clients)):
            done = finished.get(client) if self.include_finished_set else None
            out[client] = EngineCoreOutputs(
                outputs=by_client.get(client, []),
                scheduler_stats=stats if n == 0 else None,
                timestamp=now,
                finished_requests=sorted(done) if done else None,
            )
        finished.clear()
        return out

    # -- vLLM-named views of the state (read-only; the steps own the state) --------
    @property
    def requests(self) -> dict[str, Request]:
        """Unfinished requests (and finished ones awaiting a delayed free), by id."""
        return self.state.requests

    @property
    def running(self) -> list[Request]:
        """RUNNING requests in running order."""
        return self.state.running

    @property
    def waiting(self) -> RequestQueue:
        """The waiting queue (FCFS deque or priority heap), in service order."""
        return self.state.waiting

    @property
    def kv_cache_manager(self) -> KVCacheManager:
        return self.state.kv

    @property
    def encoder_cache_manager(self) -> EncoderCacheManager:
        return self.state.encoder_cache

    @property
    def finished_req_ids(self) -> set[str]:
        """Ids finished since the last `schedule()` (reported in its `finished_req_ids`)."""
        return self.state.finished_req_ids

    @property
    def max_num_encoder_input_tokens(self) -> int:
        """The per-step encoder compute budget, in embeddings."""
        return self.encoder_compute_budget

    # -- queries ------------------------------------------------------------------
    def get_num_unfinished_requests(self) -> int:
        return len(self.state.waiting) + len(self.state.running)

    def has_finished_requests(self) -> bool:
        state = self.state
        return bool(
            state.finished_req_ids
            or state.pending_outputs
            or state.delayed_free_req_ids
            or state.ec_transfer.has_pending()
        )

    def has_requests(self) -> bool:
        """Whether EngineCore must keep stepping (work, unreported finishes, pending transfers)."""
        return self.get_num_unfinished_requests() > 0 or self.has_finished_requests()

    def get_request_counts(self) -> tuple[int, int]:
        return len(self.state.running), len(self.state.waiting)

    def reset_prefix_cache(self) -> bool:
        return self.state.kv.reset_prefix_cache()

    def take_kv_cache_events(self) -> list[KVCacheEvent]:
        """KV cache events from the manager and the connector since the last call."""
        events = list(self.state.kv.take_events())
        if self.state.kv_connector is not None:
            events.extend(self.state.kv_connector.take_events())
        return events

    def lora_names_in_use(self) -> set[str]:
        """The LoRA adapters of unfinished requests (an adapter is unloaded only when unused)."""
        return {
            r.lora_name
            for r in self.state.requests.values()
            if r.lora_name is not None and r.status not in FINISHED_STATUSES
        }

    def make_stats(self) -> SchedulerStats | None:
        if not self.log_stats:
            return None
        state = self.state
        kv_stats = state.kv.make_prefix_cache_stats()
        prefix = PrefixCacheStats()
        if kv_stats is not None:
            prefix = PrefixCacheStats(
                reset=kv_stats.reset,
                requests=kv_stats.requests,
                queries=kv_stats.queries,
                hits=kv_stats.hits,
            )
        stats = SchedulerStats(
            num_running_reqs=len(state.running),
            num_waiting_reqs=len(state.waiting),
            kv_cache_usage=state.kv.usage,
            prefix_cache_stats=prefix,
            num_preempted_reqs=state.num_preempted_since_stats,
            num_scheduled_tokens=state.last_num_scheduled_tokens,
            kv_cache_eviction_events=self._take_eviction_events(),
            kv_connector_stats=self._take_kv_connector_stats(),
            spec_decoding_stats=(
                self.spec_decoding_counter.take() if self.spec_decoding_counter else None
            ),
            num_encoder_items_computed=state.num_encoder_items_computed_since_stats,
            num_encoder_items_loaded=state.num_encoder_items_loaded_since_stats,
            num_encoder_items_released=state.num_encoder_items_released_since_stats,
            waiting_lora_adapters=_count_by_lora(state.waiting),
            running_lora_adapters=_count_by_lora(state.running),
        )
        state.num_preempted_since_stats = 0
        state.num_encoder_items_computed_since_stats = 0
        state.num_encoder_items_loaded_since_stats = 0
        state.num_encoder_items_released_since_stats = 0
        return stats

    def _take_eviction_events(self) -> list[KVCacheEvictionEvent]:
        if self.kv_metrics_collector is None:
            return []
        return [
            KVCacheEvictionEvent(e.lifetime_seconds, e.idle_seconds, e.reuse_gaps_seconds)
            for e in self.kv_metrics_collector.drain_events()
        ]

    def _take_kv_connector_stats(self) -> dict[str, float]:
        state = self.state
        counters, state.kv_connector_stats = state.kv_connector_stats, {}
        if state.kv_connector is not None:
            add_counters(counters, state.kv_connector.get_kv_connector_stats())
        return counters

    def check_integrity(self) -> None:
        """Raise AssertionError if a request sits in two places or in the wrong one."""
        state = self.state
        running_ids = [r.request_id for r in state.running]
        waiting_ids = [r.request_id for r in state.waiting]
        assert len(set(running_ids)) == len(running_ids), "duplicate in running"
        assert len(set(waiting_ids)) == len(waiting_ids), "duplicate in waiting"
        assert not set(running_ids) & set(waiting_ids), "request in two queues"
        assert len(running_ids) <= self.config.max_num_seqs
        for r in state.running:
            assert r.status is RequestStatus.RUNNING, f"{r} in running"
        for r in state.waiting:
            assert not r.is_finished() and r.status is not RequestStatus.RUNNING, f"{r} waiting"
        for req_id, r in state.requests.items():
            if r.is_finished():
                assert req_id in state.delayed_free_req_ids, f"{r} finished but kept"
            else:
                assert req_id in running_ids or req_id in waiting_ids, f"{r} in no queue"
        state.encoder_cache.check_integrity()


def _count_by_lora(requests: Iterable[Request]) -> dict[str, int]:
    """Requests per adapter name; base-model requests are not counted."""
    counts: dict[str, int] = {}
    for request in requests:
        if request.lora_name is not None:
            counts[request.lora_name] = counts.get(request.lora_name, 0) + 1
    return counts


def _max_tokens_per_request(kv_cache_config: KVCacheConfig, block_size: int) -> int:
    """Most prompt tokens one request can hold if it had every block (null block excluded).

    Only groups that keep every token (full attention and its variants) are
    counted: sliding-window, chunked-local and mamba groups hold a bounded
    number of blocks, so leaving them out gives an upper bound and a prompt is
    never wrongly declared unservable.
    """
    usable = max(kv_cache_config.num_blocks - 1, 0)
    full = [
        g.kv_cache_spec.block_size
        for g in kv_cache_config.kv_cache_groups
        if isinstance(g.kv_cache_spec, FullAttentionSpec | CrossAttentionSpec)
    ]
    if not full:
        return sys.maxsize
    # Blocks per token-block across the full groups; all groups draw from one pool.
    per_group = usable // len(full)
    return per_group * min(full)
