"""The Protocols the engine core is assembled from, and the one it offers.

`EngineCore` satisfies `EngineCoreLike`; the process loop (`EngineCoreProc`)
and `InprocClient` only talk to that Protocol, so the IPC layer can be tested
and reused independently of the model. `EngineCore` in turn needs an
`ExecutorInterface` (paged.runner's executors) and a `SchedulerInterface`
(paged.scheduler's `Scheduler`); both are satisfied structurally.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from paged.kvcache import KVCacheConfig, KVCacheSpec
from paged.kvcache.events import KVCacheEvent
from paged.scheduler.boundary import (
    EngineCoreOutputs,
    EngineCoreRequest,
    GrammarOutput,
    ModelRunnerOutput,
    SchedulerOutput,
    SchedulerStats,
)
from paged.scheduler.request import RequestStatus
from paged.server.engine.messages import EngineCoreInfo


class EngineCoreLike(Protocol):
    """The engine core seen from its driver (a process loop or an in-process client).

    Calls come from one thread. `add_request` raises `ValueError` for a
    request that can never be served (the driver turns that into an error
    output or an exception for the caller); everything else the engine
    rejects later reaches the frontend as a finished `EngineCoreOutput`.
    """

    @property
    def info(self) -> EngineCoreInfo: ...

    def add_request(self, request: EngineCoreRequest) -> None: ...

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        """Finish these requests as aborted; unknown or finished ids are ignored."""
        ...

    def has_work(self) -> bool:
        """True while requests are unfinished or batches are still in flight."""
        ...

    def run_step(self) -> dict[int, EngineCoreOutputs]:
        """One iteration of the busy loop; outputs keyed by client index (may be empty)."""
        ...

    def call_utility(self, method: str, args: Sequence[Any]) -> object:
        """Run one allowlisted utility method (see `messages.UTILITY_RESULT_TYPES`)."""
        ...

    def shutdown(self) -> None: ...


# Builds the engine core inside the engine process. Must be picklable (the
# process is started with `spawn`): a module-level function, a class, or a
# `functools.partial` of those with picklable arguments.
EngineCoreFactory = Callable[[], EngineCoreLike]


class ExecutorInterface(Protocol):
    """What `EngineCore` needs from an executor (`paged.runner.executor`).

    Lifecycle: `get_kv_cache_specs` and `determine_available_memory` before
    `initialize_from_config`; then per step `execute_model` and, when that
    returns None, `sample_tokens`. Calls for one step come in that order and
    from one thread at a time (the batch queue uses one worker thread).
    """

    def get_kv_cache_specs(self) -> Mapping[str, KVCacheSpec]: ...

    def determine_available_memory(self) -> int: ...

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None: ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None: ...

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput: ...

    def check_health(self) -> None: ...

    def shutdown(self) -> None: ...


class SchedulerInterface(Protocol):
    """What `EngineCore` needs from a scheduler (`paged.scheduler.Scheduler`)."""

    def add_request(self, request: EngineCoreRequest) -> None: ...

    def finish_requests(
        self, request_ids: Iterable[str], finished_status: RequestStatus
    ) -> None: ...

    def schedule(self) -> SchedulerOutput: ...

    def get_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarOutput | None: ...

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]: ...

    def update_draft_token_ids(self, draft_token_ids: Mapping[str, Sequence[int]]) -> None:
        """Drafts (speculative decoding) to verify in the next step; non-running ids ignored."""
        ...

    def has_requests(self) -> bool: ...

    def get_num_unfinished_requests(self) -> int: ...

    def reset_prefix_cache(self) -> bool: ...

    def lora_names_in_use(self) -> set[str]:
        """The LoRA adapter names of unfinished requests."""
        ...

    def make_stats(self) -> SchedulerStats | None: ...

    def take_kv_cache_events(self) -> Sequence[KVCacheEvent]:
        """KV cache events (manager, then connector) since the last call; empty if disabled."""
        ...
