"""How the engine core's batch queue hands a scheduled batch to the executor.

Both return a future of the batch's sampled `ModelRunnerOutput`, and compute
the grammar bitmask (structured output) on the caller's thread between the
forward's submission and the sampling's, so the mask overlaps the model.

- `ThreadedSubmitter` (async scheduling, `batch_queue_size > 1`): the
  executor's blocking calls run on one helper thread, so step N+1 is
  scheduled while step N executes; one batch is in the executor at a time.
- `PipelineSubmitter` (pipeline parallelism): the executor's own
  `execute_model_async` / `sample_tokens_async` return before the workers
  answer, so up to PP batches are inside the pipeline at once, one per stage.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol, runtime_checkable

from paged.scheduler.boundary import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from paged.server.engine.interfaces import ExecutorInterface

GrammarFn = Callable[[SchedulerOutput], GrammarOutput | None]


@runtime_checkable
class PipelineExecutorInterface(Protocol):
    """An executor that takes calls without waiting for them (paged.runner's `Executor`)."""

    def execute_model_async(
        self, scheduler_output: SchedulerOutput
    ) -> Future[ModelRunnerOutput | None]: ...

    def sample_tokens_async(
        self, grammar_output: GrammarOutput | None = None
    ) -> Future[ModelRunnerOutput]: ...


class ThreadedSubmitter:
    def __init__(self, executor: ExecutorInterface, grammar: GrammarFn) -> None:
        self._executor = executor
        self._grammar = grammar
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="EngineCoreExec")

    def submit(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        executed = self._thread.submit(self._executor.execute_model, scheduler_output)
        grammar = self._grammar(scheduler_output)  # while the worker runs the model
        return self._thread.submit(self._sample_after, executed, grammar)

    def _sample_after(
        self, executed: Future[ModelRunnerOutput | None], grammar: GrammarOutput | None
    ) -> ModelRunnerOutput:
        output = executed.result()  # already done: the thread runs tasks in order
        return output if output is not None else self._executor.sample_tokens(grammar)

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)


class PipelineSubmitter:
    def __init__(self, executor: ExecutorInterface, grammar: GrammarFn) -> None:
        if not isinstance(executor, PipelineExecutorInterface):
            raise ValueError(
                "pipeline_parallel_size > 1 needs an executor with execute_model_async / "
                f"sample_tokens_async; {type(executor).__name__} has none"
            )
        self._executor: PipelineExecutorInterface = executor
        self._grammar = grammar

    def submit(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        executed = self._executor.execute_model_async(scheduler_output)
        grammar = self._grammar(scheduler_output)
        sampled = self._executor.sample_tokens_async(grammar)
        result: Future[ModelRunnerOutput] = Future()

        def done(_: Future[ModelRunnerOutput]) -> None:
            # The workers answer in call order: `executed` is settled before `sampled`.
            try:
                early = executed.result(timeout=0)
                result.set_result(early if early is not None else sampled.result(timeout=0))
            except BaseException as exc:
                result.set_exception(exc)

        sampled.add_done_callback(done)
        return result

    def shutdown(self) -> None:
        pass
