"""`Executor`: the engine core's handle on its workers (seed: Executor).

Every method fans one typed call out to all workers (`collective_rpc`) and
returns the output rank's answer (rank 0). `Executor.create(engine_config)`
picks the implementation from `ParallelConfig.executor_backend`:
"uni" (one worker in this process), "mp" (one process per rank) or "ray"
(one Ray actor per rank; ray is imported only then).
"""

from __future__ import annotations

import abc
from typing import Any, cast

from paged.kvcache import KVCacheConfig, KVCacheSpec
from paged.runner.config import EngineConfig
from paged.runner.executor.messages import (
    CheckHealth,
    DetermineAvailableMemory,
    ExecuteModel,
    GetKVCacheSpec,
    InitializeFromConfig,
    SampleTokens,
    WorkerCall,
    kv_config_to_wire,
)
from paged.scheduler.boundary import GrammarOutput, ModelRunnerOutput, SchedulerOutput


class WorkerDiedError(RuntimeError):
    """A worker process (or Ray actor) exited while the executor was using it."""


class WorkerError(RuntimeError):
    """A worker raised while serving a call; the message carries its traceback."""


class Executor(abc.ABC):
    """Runs calls on every worker; see the module docstring."""

    output_rank = 0

    def __init__(self, engine_config: EngineConfig) -> None:
        self.engine_config = engine_config

    @staticmethod
    def create(engine_config: EngineConfig) -> Executor:
        """The executor `engine_config.parallel_config` asks for, started and with models loaded."""
        backend = engine_config.parallel_config.executor_backend
        if backend == "uni":
            from paged.runner.executor.uniproc import UniProcExecutor

            return UniProcExecutor(engine_config)
        if backend == "ray":
            from paged.runner.executor.ray_distributed import RayDistributedExecutor

            return RayDistributedExecutor(engine_config)
        from paged.runner.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(engine_config)

    @abc.abstractmethod
    def collective_rpc(self, call: WorkerCall, timeout: float | None = None) -> list[Any]:
        """Run `call` on every worker; results in rank order. Raises WorkerError/WorkerDiedError."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and free their resources (idempotent)."""

    def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        return cast(dict[str, KVCacheSpec], self.collective_rpc(GetKVCacheSpec())[self.output_rank])

    def determine_available_memory(self) -> int:
        """The smallest budget over the workers (every rank allocates the same blocks)."""
        return min(cast(list[int], self.collective_rpc(DetermineAvailableMemory())))

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        self.collective_rpc(InitializeFromConfig(kv_config_to_wire(kv_cache_config)))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        result = self.collective_rpc(ExecuteModel(scheduler_output))[self.output_rank]
        return cast(ModelRunnerOutput | None, result)

    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput:
        result = self.collective_rpc(SampleTokens(grammar_output))[self.output_rank]
        return cast(ModelRunnerOutput, result)

    def check_health(self) -> None:
        self.collective_rpc(CheckHealth(), timeout=60.0)

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
