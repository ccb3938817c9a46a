"""`Executor`: the engine core's handle on its workers (seed: Executor).

Every method fans one typed call out to all workers (`collective_rpc`) and
returns the output rank's answer (TP rank 0 of the last pipeline stage, which
samples; rank 0 without PP). `create_executor(engine_config)` (factory.py)
picks the implementation from `ParallelConfig.executor_backend`: "uni" (one
worker in this process), "mp" (one process per rank, TP x PP) or "ray" (one
Ray actor per rank; ray is imported only then).

Pipeline parallelism: `max_concurrent_batches` (= PP size) micro-batches may
be in flight; `execute_model_async` / `sample_tokens_async` return futures
(here: already resolved, computed synchronously; `MultiprocExecutor` with
PP > 1 returns them before the workers answer). Each stage reports the KV
cache specs of its own layers (`get_kv_cache_specs_per_stage`).
"""

from __future__ import annotations

import abc
from concurrent.futures import Future
from typing import Any, cast

from paged.kvcache import KVCacheConfig, KVCacheSpec
from paged.runner.config import EngineConfig
from paged.runner.executor.messages import (
    AddLoRA,
    CheckHealth,
    DetermineAvailableMemory,
    ExecuteModel,
    GetKVCacheSpec,
    InitializeFromConfig,
    ListLoRAs,
    RemoveLoRA,
    SampleTokens,
    WorkerCall,
    kv_config_to_wire,
)
from paged.runner.lora.config import LoRAAdapterSpec
from paged.runner.pipeline.stage import output_rank
from paged.scheduler.boundary import GrammarOutput, ModelRunnerOutput, SchedulerOutput


class WorkerDiedError(RuntimeError):
    """A worker process (or Ray actor) exited while the executor was using it."""


class WorkerError(RuntimeError):
    """A worker raised while serving a call; the message carries its traceback."""


class Executor(abc.ABC):
    """Runs calls on every worker; see the module docstring."""

    def __init__(self, engine_config: EngineConfig) -> None:
        self.engine_config = engine_config
        parallel = engine_config.parallel_config
        self.tp_size = parallel.tensor_parallel_size
        self.pp_size = parallel.pipeline_parallel_size
        self.output_rank = output_rank(self.tp_size, self.pp_size)

    @property
    def max_concurrent_batches(self) -> int:
        """Micro-batches the engine may keep in flight: one per pipeline stage (vLLM)."""
        return self.pp_size

    @abc.abstractmethod
    def collective_rpc(self, call: WorkerCall, timeout: float | None = None) -> list[Any]:
        """Run `call` on every worker; results in rank order. Raises WorkerError/WorkerDiedError."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and free their resources (idempotent)."""

    def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        """Every layer's spec, in layer order (the stages' specs joined)."""
        union: dict[str, KVCacheSpec] = {}
        for specs in self.get_kv_cache_specs_per_stage():
            union.update(specs)
        return union

    def get_kv_cache_specs_per_stage(self) -> list[dict[str, KVCacheSpec]]:
        """One dict per pipeline stage (its TP rank 0's), in stage order."""
        results = cast(list[dict[str, KVCacheSpec]], self.collective_rpc(GetKVCacheSpec()))
        return [results[pp * self.tp_size] for pp in range(self.pp_size)]

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

    def collective_rpc_async(self, call: WorkerCall) -> Future[list[Any]]:
        """`collective_rpc` as a future; here it runs to completion first."""
        future: Future[list[Any]] = Future()
        try:
            future.set_result(self.collective_rpc(call))
        except Exception as exc:
            future.set_exception(exc)
        return future

    def execute_model_async(
        self, scheduler_output: SchedulerOutput
    ) -> Future[ModelRunnerOutput | None]:
        """`execute_model` without waiting for the workers (vLLM's non_block=True)."""
        return _pick(self.collective_rpc_async(ExecuteModel(scheduler_output)), self.output_rank)

    def sample_tokens_async(
        self, grammar_output: GrammarOutput | None = None
    ) -> Future[ModelRunnerOutput]:
        """`sample_tokens` without waiting; call after `execute_model_async` of the same step."""
        return _pick(self.collective_rpc_async(SampleTokens(grammar_output)), self.output_rank)

    def check_health(self) -> None:
        self.collective_rpc(CheckHealth(), timeout=60.0)

    # LoRA adapters, on every worker (vLLM's executor add_lora / remove_lora / list_loras).

    def add_lora(self, spec: LoRAAdapterSpec) -> None:
        """Load `spec` on every worker; ValueError with the cause (ranks that loaded undo it)."""
        refusals = cast(list[str | None], self.collective_rpc(AddLoRA(spec)))
        reasons = [r for r in refusals if r is not None]
        if not reasons:
            return
        if len(reasons) < len(refusals):
            self.collective_rpc(RemoveLoRA(spec.name))
        raise ValueError(reasons[0])

    def remove_lora(self, name: str) -> bool:
        """Unload `name` everywhere; False if it was not loaded."""
        return any(cast(list[bool], self.collective_rpc(RemoveLoRA(name))))

    def list_loras(self) -> list[str]:
        """The adapters loaded (every rank holds the same set)."""
        return cast(list[list[str]], self.collective_rpc(ListLoRAs()))[self.output_rank]

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _pick(results: Future[list[Any]], rank: int) -> Future[Any]:
    """A future of one rank's result out of a future of all of them."""
    picked: Future[Any] = Future()

    def done(f: Future[list[Any]]) -> None:
        exc = f.exception()
        if exc is not None:
            picked.set_exception(exc)
        else:
            picked.set_result(f.result()[rank])

    results.add_done_callback(done)
    return picked
