"""The scheduler's shared state and the plan one `schedule()` call builds.

`SchedulerState` is what the step modules read and mutate (queues, managers,
connectors); `StepPlan` accumulates one step's decisions until the output
step turns it into a `SchedulerOutput`. Keeping them as plain records lets
each step be a function of (state, plan) instead of a method on a god class.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from paged.kvcache import KVCacheManager
from paged.multimodal.encoder_cache import EncoderCacheManager
from paged.scheduler.boundary import EngineCoreOutput
from paged.scheduler.budget import StepBudget
from paged.scheduler.config import SchedulerConfig
from paged.scheduler.connectors import ECConnectorScheduler, KVConnectorScheduler
from paged.scheduler.ec_transfer import ECTransferState
from paged.scheduler.queue import RequestQueue
from paged.scheduler.request import Request


@dataclass(slots=True)
class SchedulerState:
    """Everything the steps share.

    Invariants (checked by `Scheduler.check_integrity()`): every unfinished
    request is in exactly one of `waiting` / `running`; `running` holds only
    RUNNING requests; finished requests stay in `requests` only while their
    blocks await a delayed free (KV still being sent or received).
    """

    config: SchedulerConfig
    kv: KVCacheManager
    encoder_cache: EncoderCacheManager
    waiting: RequestQueue
    block_size: int
    num_kv_cache_groups: int
    kv_connector: KVConnectorScheduler | None = None
    ec_connector: ECConnectorScheduler | None = None
    requests: dict[str, Request] = field(default_factory=dict)
    running: list[Request] = field(default_factory=list)
    # Finished since the last SchedulerOutput (the runner drops their state).
    finished_req_ids: set[str] = field(default_factory=set)
    # Finished since the last EngineCoreOutputs, per client (frontends' bookkeeping).
    finished_req_ids_per_client: dict[int, set[str]] = field(default_factory=dict)
    # Outputs for requests finished outside a model step, with their client index.
    pending_outputs: list[tuple[int, EngineCoreOutput]] = field(default_factory=list)
    # Most tokens one request can hold with every block (prompts beyond never run).
    max_tokens_in_kv_cache: int = 0
    # WAITING_FOR_REMOTE_KVS requests whose async load finished / failed.
    finished_recving_kv_req_ids: set[str] = field(default_factory=set)
    # Worker-side connector counters not yet reported in SchedulerStats.
    kv_connector_stats: dict[str, float] = field(default_factory=dict)
    failed_recving_kv_req_ids: set[str] = field(default_factory=set)
    # Finished requests whose blocks are kept until the worker finishes a transfer.
    delayed_free_req_ids: set[str] = field(default_factory=set)
    num_preempted_since_stats: int = 0
    # Encoder items scheduled for the local encoder / landed from the EC connector.
    num_encoder_items_computed_since_stats: int = 0
    num_encoder_items_loaded_since_stats: int = 0
    num_encoder_items_released_since_stats: int = 0
    last_num_scheduled_tokens: int = 0
    # Encoder items loading asynchronously through the EC connector, delayed frees.
    ec_transfer: ECTransferState = field(default_factory=ECTransferState)
    # The provider's GrammarCompileGate check (None: grammars are always ready).
    grammar_ready: Callable[[Request], bool] | None = None


@dataclass(slots=True)
class StepPlan:
    """One step's decisions, in the order they were taken."""

    budget: StepBudget
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    scheduled_running: list[Request] = field(default_factory=list)
    scheduled_new: list[Request] = field(default_factory=list)
    scheduled_resumed: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Block ids added this step, per request and group (None: nothing added).
    new_block_ids: dict[str, tuple[list[int], ...] | None] = field(default_factory=dict)
    spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
