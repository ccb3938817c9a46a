"""PipelineSubmitter: one future per batch, settled by the executor's own futures."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from paged.scheduler.boundary import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from paged.server.engine.batch_submit import PipelineSubmitter


class AsyncExecutor:
    """Hands out unsettled futures; the test settles them like the executor's reply thread."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []
        self.futures: list[Future[ModelRunnerOutput | None]] = []

    def execute_model_async(
        self, scheduler_output: SchedulerOutput
    ) -> Future[ModelRunnerOutput | None]:
        self.calls.append(("execute", scheduler_output))
        self.futures.append(Future())
        return self.futures[-1]

    def sample_tokens_async(
        self, grammar_output: GrammarOutput | None = None
    ) -> Future[ModelRunnerOutput]:
        self.calls.append(("sample", grammar_output))
        future: Future[ModelRunnerOutput] = Future()
        self.futures.append(future)  # type: ignore[arg-type]  # same objects, narrower type
        return future

    # The rest of ExecutorInterface (unused by the submitter).
    def get_kv_cache_specs(self) -> dict[str, object]:
        return {}

    def determine_available_memory(self) -> int:
        return 0

    def initialize_from_config(self, kv_cache_config: object) -> None: ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        raise AssertionError("the pipeline path never blocks on execute_model")

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        raise AssertionError("the pipeline path never blocks on sample_tokens")

    def check_health(self) -> None: ...

    def shutdown(self) -> None: ...


def test_batches_stay_in_flight_until_the_workers_answer() -> None:
    executor = AsyncExecutor()
    grammars: list[SchedulerOutput] = []

    def grammar(so: SchedulerOutput) -> GrammarOutput | None:
        grammars.append(so)
        return None

    submitter = PipelineSubmitter(executor, grammar)  # type: ignore[arg-type]
    first, second = SchedulerOutput(total_num_scheduled_tokens=1), SchedulerOutput()
    a = submitter.submit(first)
    b = submitter.submit(second)
    # Both batches were handed over before any answer: execute, sample, execute, sample.
    assert [c[0] for c in executor.calls] == ["execute", "sample", "execute", "sample"]
    assert grammars == [first, second] and not a.done() and not b.done()
    sampled = ModelRunnerOutput(req_ids=["r"], sampled_token_ids=[[7]])
    executor.futures[0].set_result(None)  # the forward ran; sampling gives the tokens
    executor.futures[1].set_result(sampled)
    assert a.result(timeout=0) == sampled and not b.done()
    early = ModelRunnerOutput()  # nothing to forward: execute_model's own output wins
    executor.futures[2].set_result(early)
    executor.futures[3].set_result(ModelRunnerOutput(req_ids=["x"], sampled_token_ids=[[1]]))
    assert b.result(timeout=0) is early


def test_a_worker_failure_fails_the_batch() -> None:
    executor = AsyncExecutor()
    submitter = PipelineSubmitter(executor, lambda so: None)  # type: ignore[arg-type]
    batch = submitter.submit(SchedulerOutput())
    executor.futures[0].set_exception(RuntimeError("worker 1 died"))
    executor.futures[1].set_exception(RuntimeError("worker 1 died"))
    with pytest.raises(RuntimeError, match="worker 1 died"):
        batch.result(timeout=0)


def test_an_executor_without_futures_is_refused() -> None:
    class Blocking:
        pass

    with pytest.raises(ValueError, match="needs an executor with execute_model_async"):
        PipelineSubmitter(Blocking(), lambda so: None)  # type: ignore[arg-type]
