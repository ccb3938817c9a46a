"""`EngineCore`: schedule -> execute -> sample -> update, one step at a time.

    step()
      scheduler.schedule()                  -> SchedulerOutput
      executor.execute_model(so)            -> ModelRunnerOutput | None (None: sample next)
      scheduler.get_grammar_bitmask(so)     -> GrammarOutput | None     (structured output;
                                               on a helper thread, during execute_model)
      executor.sample_tokens(grammar)       -> ModelRunnerOutput
      scheduler.update_from_output(so, mro) -> {client index: EngineCoreOutputs}

`step_with_batch_queue()` (batch_queue_size > 1) runs the executor on one
worker thread and schedules step N+1 while step N executes: it only waits
for the oldest batch when the queue is full or nothing new can be scheduled.
The scheduler stays on the caller's thread; requests whose tokens are in
flight are not scheduled again (the scheduler advances their computed
tokens when it schedules them), so overlapping batches never collide.
With pipeline parallelism the queue holds PP batches (vLLM's
`max_concurrent_batches`) and the executor itself takes them without
blocking (`batch_submit.PipelineSubmitter`), one batch per stage.

`kv_cache_metrics_sample` (vLLM's --kv-cache-metrics-sample) gives the
scheduler a `KVCacheMetricsCollector`; its eviction events ride in each
`SchedulerStats` to the frontend's Prometheus histograms.

Construction sizes the KV cache: the executor's per-layer specs and the byte
budget (`CacheConfig.kv_cache_memory_bytes`, else the executor's measurement)
go through `paged.kvcache.get_kv_cache_config`; the executor allocates it and
the scheduler gets the same `KVCacheConfig`.

With `kv_events_config` enabled, the core holds an `EventPublisher` (built
here, stopped in `shutdown`) and, after each step that updated the
scheduler, publishes the KV cache events that step produced as one batch.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import msgspec

from paged.connectors.events import EventPublisher, KVEventsConfig, make_event_publisher
from paged.kvcache import (
    KVCacheConfig,
    KVCacheMetricsCollector,
    get_hash_fn_by_name,
    get_kv_cache_config,
)
from paged.multimodal.processor_cache import ReceiverCache
from paged.runner.config import EngineConfig
from paged.scheduler.boundary import (
    EngineCoreOutputs,
    EngineCoreRequest,
    GrammarOutput,
    ModelRunnerOutput,
    SchedulerOutput,
)
from paged.scheduler.config import SchedulerConfig
from paged.scheduler.request import RequestStatus
from paged.scheduler.scheduler import Scheduler
from paged.scheduler.structured_output import StructuredOutputProvider
from paged.server.ec_transfer import ec_load_failure_policy, make_scheduler_ec_connector
from paged.server.encode_only import is_encode_only
from paged.server.engine.batch_submit import PipelineSubmitter, ThreadedSubmitter
from paged.server.engine.interfaces import EngineCoreFactory, ExecutorInterface, SchedulerInterface
from paged.server.engine.lora import EngineLoRAs
from paged.server.engine.mask_overlap import GrammarMaskOverlap
from paged.server.engine.messages import UTILITY_RESULT_TYPES, EngineCoreInfo, EngineCoreStats
from paged.server.kv_transfer import (
    kv_bytes_per_block,
    kv_load_failure_policy,
    make_scheduler_connector,
)
from paged.server.mm_frontend import MultiModalEngineOptions, mm_tokens_per_item
from paged.server.structured_output.factory import StructuredOutputConfig

if TYPE_CHECKING:
    from paged.connectors.ec import ECConnectorBase
    from paged.connectors.kv import KVConnectorBase

logger = logging.getLogger(__name__)

ExecutorFactory = Callable[[EngineConfig], ExecutorInterface]
SchedulerFactory = Callable[..., SchedulerInterface]


def scheduler_config_from(engine_config: EngineConfig) -> SchedulerConfig:
    """The scheduler limits of `engine_config` as a `SchedulerConfig`."""
    limits = engine_config.scheduler_limits
    spec = engine_config.speculative_config
    return SchedulerConfig(
        max_num_seqs=limits.max_num_seqs,
        max_num_batched_tokens=limits.max_num_batched_tokens,
        max_model_len=engine_config.model_config.max_model_len,
        enable_chunked_prefill=limits.enable_chunked_prefill,
        max_logprobs=limits.max_logprobs,
        policy=limits.policy,
        long_prefill_token_threshold=limits.long_prefill_token_threshold,
        long_prefill_token_threshold_adaptive=limits.long_prefill_token_threshold_adaptive,
        num_lookahead_tokens=spec.num_lookahead_tokens if spec is not None else 0,
        num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0,
        encode_only=is_encode_only(engine_config),
        pipeline_parallel_size=engine_config.parallel_config.pipeline_parallel_size,
        max_loras=lora.max_loras if (lora := engine_config.lora_config) is not None else None,
    )


class EngineCore:
    """The engine's inner loop; driven by `EngineCoreProc` or `InprocClient`.

    `executor_class` builds the executor from the config (default: the runner's
    choice for `parallel_config`); `scheduler_class` builds the scheduler with
    `Scheduler`'s signature; `structured_output` is the grammar provider the
    scheduler consults for bitmasks, or the `StructuredOutputConfig` to build
    it from here (in the engine process: the tokenizer it loads is not
    picklable). Not thread-safe: one driver thread calls everything.
    """

    def __init__(
        self,
        engine_config: EngineConfig,
        executor_class: ExecutorFactory | None = None,
        *,
        scheduler_config: SchedulerConfig | None = None,
        scheduler_class: SchedulerFactory | None = None,
        batch_queue_size: int = 1,
        structured_output: StructuredOutputProvider | StructuredOutputConfig | None = None,
        num_gpu_blocks_override: int | None = None,
        log_stats: bool = True,
        kv_events_config: KVEventsConfig | None = None,
        kv_cache_metrics_sample: float | None = None,
        mm_options: MultiModalEngineOptions | None = None,
    ) -> None:
        if batch_queue_size < 1:
            raise ValueError(f"batch_queue_size must be >= 1, got {batch_queue_size}")
        pp_size = engine_config.parallel_config.pipeline_parallel_size
        batch_queue_size = max(batch_queue_size, pp_size)  # one micro-batch per stage
        if batch_queue_size > 1 and engine_config.speculative_config is not None:
            # Drafts for step N+1 come out of step N's sampling: nothing to overlap.
            raise ValueError(
                "speculative_config: not supported with async scheduling (batch_queue_size > 1)"
            )
        if engine_config.lora_config is not None and batch_queue_size > 1:
            # Adapters load through the executor from this thread; a batch in flight on
            # the submitter's thread would interleave with that load.
            raise ValueError(
                "enable_lora: not supported with async scheduling or pipeline parallelism yet"
            )
        self.engine_config = engine_config
        self.scheduler_config = scheduler_config or scheduler_config_from(engine_config)
        # Gemma3's image tokens attend both ways: the model requires unsplit items.
        unchunked = getattr(engine_config.model_config, "requires_unchunked_mm_input", False)
        if unchunked or (mm_options is not None and mm_options.disable_chunked_mm_input):
            self.scheduler_config = dataclasses.replace(
                self.scheduler_config, disable_chunked_mm_input=True
            )
        # Encoder embeddings of one image (0: a text-only model, which refuses images).
        self.mm_tokens_per_item = mm_tokens_per_item(engine_config.model_config.hf_config)
        # P1's half of the processor cache: restores tensors the frontend did not resend.
        self.mm_receiver: ReceiverCache = (
            mm_options.processor_cache.make_receiver()
            if mm_options is not None and self.mm_tokens_per_item
            else ReceiverCache()
        )
        self.batch_queue_size = batch_queue_size
        self.model_executor = (executor_class or _default_executor_class(engine_config))(
            engine_config
        )
        self._kv_events = kv_events_config is not None and kv_events_config.publishes
        if self._kv_events and not engine_config.cache_config.enable_prefix_caching:
            # As vLLM: events describe the prefix cache; without it none are produced.
            logger.warning("KV cache events are enabled but prefix caching is off: none will come")
        # The scheduler-side KV connector (built with the scheduler; None without one).
        self.kv_connector: KVConnectorBase | None = None
        # The scheduler-side EC connector (None without --ec-transfer-config).
        self.ec_connector: ECConnectorBase | None = None
        try:
            if isinstance(structured_output, StructuredOutputConfig):
                structured_output = structured_output.build()
            self.kv_cache_config, kv_bytes = self._initialize_kv_caches(
                num_gpu_blocks_override, pp_size
            )
            self.scheduler = self._make_scheduler(
                scheduler_class, structured_output, log_stats, kv_cache_metrics_sample
            )
            # Last: a busy endpoint fails start-up before the thread exists.
            self.event_publisher: EventPublisher = make_event_publisher(kv_events_config)
        except BaseException:
            self.model_executor.shutdown()
            raise
        # What start-up found (a KV connector's disk tier) is the first batch, so
        # a subscriber that joins later learns it through replay.
        self._publish_kv_events()
        self._info = EngineCoreInfo(
            num_gpu_blocks=self.kv_cache_config.num_blocks,
            block_size=engine_config.cache_config.block_size,
            max_model_len=engine_config.model_config.max_model_len,
            kv_cache_memory_bytes=kv_bytes,
            batch_queue_size=batch_queue_size,
        )
        # The grammar bitmask overlaps the forward pass (step(); the batch queue
        # overlaps by itself). Only our Scheduler exposes its requests; another
        # scheduler class with a grammar provider is asked every step.
        sched_state = getattr(self.scheduler, "state", None)
        self.mask_overlap = GrammarMaskOverlap(
            self._grammar,
            (lambda: sched_state.requests) if sched_state is not None else None,
            enabled=structured_output is not None,
        )
        # Batches in flight, newest first: (future of the sampled output, its schedule).
        self.batch_queue: deque[tuple[Future[ModelRunnerOutput], SchedulerOutput]] = deque()
        self._submitter: ThreadedSubmitter | PipelineSubmitter | None = None
        if pp_size > 1:
            self._submitter = PipelineSubmitter(self.model_executor, self._grammar)
        elif batch_queue_size > 1:
            self._submitter = ThreadedSubmitter(self.model_executor, self._grammar)
        self._num_steps = self._num_model_steps = 0
        self._num_added = self._num_aborted = 0
        self.loras = EngineLoRAs(
            engine_config.lora_config, self.model_executor, self.scheduler.lora_names_in_use
        )
        self._utilities: dict[str, Callable[..., object]] = {
            "add_lora": self.loras.add_lora,
            "remove_lora": self.loras.remove_lora,
            "list_loras": self.loras.list_loras,
            "reset_prefix_cache": self.reset_prefix_cache,
            "is_healthy": self.is_healthy,
            "get_stats": self.get_stats,
            "get_num_unfinished_requests": self.scheduler.get_num_unfinished_requests,
            "get_info": lambda: self.info,
        }
        assert set(self._utilities) == set(UTILITY_RESULT_TYPES)
        logger.info(
            "KV cache: %d blocks of %d tokens (%d bytes), %d group(s)",
            self._info.num_gpu_blocks,
            self._info.block_size,
            kv_bytes,
            len(self.kv_cache_config.kv_cache_groups),
        )

    def _make_scheduler(
        self,
        scheduler_class: SchedulerFactory | None,
        structured_output: StructuredOutputProvider | None,
        log_stats: bool,
        kv_cache_metrics_sample: float | None,
    ) -> SchedulerInterface:
        cache = self.engine_config.cache_config
        extra: dict[str, Any] = {}
        if structured_output is not None:
            extra["structured_output"] = structured_output
        if self._kv_events:
            extra["enable_kv_cache_events"] = True
        if kv_cache_metrics_sample is not None and log_stats:
            # As in vLLM, residency metrics travel in the scheduler stats, so
            # they need log_stats; the collector samples blocks at allocation.
            extra["kv_metrics_collector"] = KVCacheMetricsCollector(kv_cache_metrics_sample)
        groups = len(self.kv_cache_config.kv_cache_groups)
        self.kv_connector = make_scheduler_connector(
            self.engine_config,
            groups,
            kv_bytes_per_block(self.kv_cache_config),
            self.kv_cache_config,
        )
        scheduler_config = self.scheduler_config
        if self.mm_tokens_per_item:
            extra["max_tokens_per_mm_item"] = self.mm_tokens_per_item
        if self.kv_connector is not None:
            extra["kv_connector"] = self.kv_connector
            # vLLM's scheduler reads kv_load_failure_policy off the transfer config.
            scheduler_config = dataclasses.replace(
                scheduler_config,
                kv_load_failure_policy=kv_load_failure_policy(self.engine_config),
            )
        self.ec_connector = make_scheduler_ec_connector(self.engine_config)
        if self.ec_connector is not None:
            extra["ec_connector"] = self.ec_connector
            extra["ec_load_failure_policy"] = ec_load_failure_policy(self.engine_config)
        return (scheduler_class or Scheduler)(
            scheduler_config,
            self.kv_cache_config,
            cache.block_size,
            enable_caching=cache.enable_prefix_caching,
            log_stats=log_stats,
            # vLLM's algorithm and seed rule: block hashes (and so prefix-cache and
            # connector hits, KV events) agree across processes, restarts and vLLM.
            hash_fn=get_hash_fn_by_name(cache.prefix_caching_hash_algo),
            hash_seed=self.engine_config.block_hash_seed,
            **extra,
        )

    def _initialize_kv_caches(
        self, num_gpu_blocks_override: int | None, pp_size: int = 1
    ) -> tuple[KVCacheConfig, int]:
        if pp_size > 1:
            return self._initialize_pipeline_kv_caches(num_gpu_blocks_override)
        specs = self.model_executor.get_kv_cache_specs()
        if not specs:
            raise ValueError("the model reports no KV cache layers (kv_cache_specs is empty)")
        configured = self.engine_config.cache_config.kv_cache_memory_bytes
        available = (
            configured
            if configured is not None
            else self.model_executor.determine_available_memory()
        )
        kv_cache_config = get_kv_cache_config(
            specs,
            available,
            num_gpu_blocks_override=num_gpu_blocks_override,
            max_model_len=self.engine_config.model_config.max_model_len,
        )
        self.model_executor.initialize_from_config(kv_cache_config)
        return kv_cache_config, available

    def _initialize_pipeline_kv_caches(
        self, num_gpu_blocks_override: int | None
    ) -> tuple[KVCacheConfig, int]:
        """Each stage holds its layers' cache: blocks = the fewest any stage's budget holds."""
        from paged.runner.executor import Executor
        from paged.runner.pipeline.kv import pipeline_kv_cache_config

        executor = self.model_executor
        if not isinstance(executor, Executor):
            raise ValueError("pipeline_parallel_size > 1 needs paged.runner's executor")
        configured = self.engine_config.cache_config.kv_cache_memory_bytes
        available = configured if configured is not None else executor.determine_available_memory()
        kv_cache_config = pipeline_kv_cache_config(
            executor.get_kv_cache_specs_per_stage(),
            available,
            num_gpu_blocks_override=num_gpu_blocks_override,
            max_model_len=self.engine_config.model_config.max_model_len,
        )
        executor.initialize_from_config(kv_cache_config)
        return kv_cache_config, available

    # ---- requests ------------------------------------------------------------
    @property
    def info(self) -> EngineCoreInfo:
        return self._info

    def add_request(self, request: EngineCoreRequest) -> None:
        """Validate and queue a request; `ValueError` naming the field if it can never run.

        A prompt longer than the context is not an error here: the scheduler
        finishes such a request with an output, as the frontend expects.
        """
        if request.mm_features:
            # First, before anything can reject the request: the mirror must see
            # every request the frontend committed, in order (processor_cache.py).
            request = self._restore_mm_data(request)
        if not isinstance(request.request_id, str) or not request.request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request.request_id!r}")
        if not request.prompt_token_ids:
            raise ValueError(f"prompt_token_ids of request {request.request_id!r} is empty")
        vocab_size = self.engine_config.model_config.vocab_size
        ids = request.prompt_token_ids
        # min/max run in C; the offending id is looked up only on failure.
        if min(ids) < 0 or max(ids) >= vocab_size:
            token = next(t for t in ids if not 0 <= t < vocab_size)
            raise ValueError(
                f"prompt_token_ids of request {request.request_id!r} holds token id "
                f"{token}, outside the vocabulary [0, {vocab_size})"
            )
        if request.eos_token_id is not None and not 0 <= request.eos_token_id < vocab_size:
            raise ValueError(
                f"eos_token_id {request.eos_token_id} is outside the vocabulary [0, {vocab_size})"
            )
        request.sampling_params.validate(self.scheduler_config.max_logprobs)
        self.loras.check_request(request.request_id, request.lora_request, request.lora_path)
        if request.kv_transfer_params is not None and self.kv_connector is None:
            # vLLM 0.33.0 (vllm/v1/engine/core.py:541-547) warns and serves the
            # request without transfer: a client's field never fails a request.
            # Dropping the params makes "without transfer" hold for every step.
            logger.warning(
                "Got kv_transfer_params, but no KVConnector found. "
                "Disabling KVTransfer for this request (%s).",
                request.request_id,
            )
            request = msgspec.structs.replace(request, kv_transfer_params=None)
        self.scheduler.add_request(request)
        self._num_added += 1

    def _restore_mm_data(self, request: EngineCoreRequest) -> EngineCoreRequest:
        features = self.mm_receiver.fill(request.mm_features or [])
        if not self.mm_tokens_per_item:
            raise ValueError(
                f"request {request.request_id!r} carries multimodal inputs but the model "
                f"{self.engine_config.model_config.architecture} is text-only"
            )
        return msgspec.structs.replace(request, mm_features=features)

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        """Finish these requests as aborted and free their blocks (unknown ids are ignored)."""
        if request_ids:
            self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)
            self._num_aborted += len(request_ids)

    def has_work(self) -> bool:
        return self.scheduler.has_requests() or bool(self.batch_queue)

    # ---- stepping --------------------------------------------------------------
    def run_step(self) -> dict[int, EngineCoreOutputs]:
        return self.step_with_batch_queue() if self._submitter is not None else self.step()

    def step(self) -> dict[int, EngineCoreOutputs]:
        """Schedule, execute, sample and update once; outputs keyed by client index."""
        if not self.scheduler.has_requests():
            return {}
        scheduler_output = self.scheduler.schedule()
        mask = self.mask_overlap.start(scheduler_output)
        try:
            model_output = self.model_executor.execute_model(scheduler_output)
        finally:
            grammar = mask.result()  # before anything mutates the scheduler again
        if model_output is None:
            model_output = self.model_executor.sample_tokens(grammar)
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        if model_output.draft_token_ids:
            # After the update: only requests still running take the drafts.
            self.scheduler.update_draft_token_ids(model_output.draft_token_ids)
        self._count_step(scheduler_output)
        self._publish_kv_events()
        return outputs

    def step_with_batch_queue(self) -> dict[int, EngineCoreOutputs]:
        """Queue a new batch if one can be scheduled; finish the oldest when needed.

        Returns {} while it only queued work (the caller loops again), else the
        outputs of the oldest batch.
        """
        assert self._submitter is not None, "step_with_batch_queue needs batch_queue_size > 1"
        scheduler_output = self.scheduler.schedule() if self.scheduler.has_requests() else None
        if scheduler_output is not None and not (
            self.batch_queue and _carries_nothing(scheduler_output)
        ):
            sampled = self._submitter.submit(scheduler_output)
            self.batch_queue.appendleft((sampled, scheduler_output))
            if (
                scheduler_output.total_num_scheduled_tokens > 0
                and len(self.batch_queue) < self.batch_queue_size
                and not self.batch_queue[-1][0].done()
            ):
                return {}
        elif not self.batch_queue:
            return {}
        sampled, scheduler_output = self.batch_queue.pop()
        outputs = self.scheduler.update_from_output(scheduler_output, sampled.result())
        self._count_step(scheduler_output)
        self._publish_kv_events()
        return outputs

    def _grammar(self, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        return self.scheduler.get_grammar_bitmask(scheduler_output)

    def _publish_kv_events(self) -> None:
        """One batch with the events since the last call (none: nothing is sent)."""
        if self._kv_events:
            events = self.scheduler.take_kv_cache_events()
            if events:
                self.event_publisher.publish(events)

    def _count_step(self, scheduler_output: SchedulerOutput) -> None:
        self._num_steps += 1
        if scheduler_output.total_num_scheduled_tokens > 0:
            self._num_model_steps += 1
        self.loras.after_step()

    # ---- utilities -------------------------------------------------------------
    def call_utility(self, method: str, args: Sequence[Any]) -> object:
        fn = self._utilities.get(method)
        if fn is None:
            raise ValueError(f"method {method!r} is not an engine utility")
        return fn(*args)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block not in use; False while running requests hold blocks."""
        done = self.scheduler.reset_prefix_cache()
        # An idle engine may not step again soon: send AllBlocksCleared now.
        self._publish_kv_events()
        return done

    def is_healthy(self) -> bool:
        try:
            self.model_executor.check_health()
        except Exception:
            logger.exception("executor health check failed")
            return False
        return True

    def get_stats(self) -> EngineCoreStats:
        return EngineCoreStats(
            num_steps=self._num_steps,
            num_model_steps=self._num_model_steps,
            num_requests_added=self._num_added,
            num_requests_aborted=self._num_aborted,
            num_gpu_blocks=self._info.num_gpu_blocks,
            scheduler=self.scheduler.make_stats(),
        )

    def shutdown(self) -> None:
        if self._submitter is not None:
            self._submitter.shutdown()
        self.batch_queue.clear()
        self.mask_overlap.shutdown()
        self.event_publisher.shutdown()
        self.model_executor.shutdown()
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
        if self.ec_connector is not None:
            self.ec_connector.shutdown()


def _carries_nothing(scheduler_output: SchedulerOutput) -> bool:
    """No tokens and no news for the workers: every request is in flight (batch queue).

    Such a step is not sent (with pipeline parallelism it would be a round trip
    through every stage); the engine waits for the oldest batch instead.
    """
    so = scheduler_output
    return (
        so.total_num_scheduled_tokens == 0
        and not so.finished_req_ids
        and not so.preempted_req_ids
        and not so.free_encoder_mm_hashes
        and so.kv_connector_metadata is None
        and so.ec_connector_metadata is None
    )


def _default_executor_class(engine_config: EngineConfig) -> ExecutorFactory:
    # Imported here: the executors pull in torch models, which the IPC-only
    # users of this module (and its tests) do not need.
    from paged.runner.executor.factory import create_executor

    return create_executor


def make_engine_core_factory(
    engine_config: EngineConfig, executor_class: ExecutorFactory | None = None, **kwargs: Any
) -> EngineCoreFactory:
    """A picklable factory building `EngineCore(engine_config, executor_class, **kwargs)`.

    What `SyncMPClient` / `AsyncMPClient` take to build the core in the engine process.
    """
    return functools.partial(EngineCore, engine_config, executor_class, **kwargs)
