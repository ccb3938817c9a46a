"""PAGED_STEP_TRACE: the engine process's per-step timeline (prefill vs decode, idle, bytes)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from paged.scheduler.boundary import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    SchedulerStats,
)
from paged.scheduler.sampling_params import SamplingParams
from paged.server.engine.client import SyncMPClient
from paged.server.engine.core import make_engine_core_factory
from paged.server.engine.step_trace import ENV_VAR, StepTrace

pytestmark = pytest.mark.timeout(120)


def _outputs(scheduled: int, running: int, tokens: int) -> dict[int, EngineCoreOutputs]:
    outs = [EngineCoreOutput(request_id=f"r{i}", new_token_ids=[7]) for i in range(tokens)]
    stats = SchedulerStats(num_running_reqs=running, num_scheduled_tokens=scheduled)
    return {0: EngineCoreOutputs(outputs=outs, scheduler_stats=stats)}


def test_summary_splits_prefill_and_decode_steps(tmp_path: Path) -> None:
    trace = StepTrace(str(tmp_path / "t.json"))
    trace.begin_step()
    trace.end_step(_outputs(scheduled=40, running=2, tokens=1))  # a prefill chunk + 1 decode
    trace.add_idle(0.25)
    for running in (2, 2, 1):  # the last one finished a request
        trace.begin_step()
        trace.end_step(_outputs(scheduled=2, running=running, tokens=2))
    trace.begin_step()
    trace.end_step({})  # nothing came out: not a step
    trace.add_sent(0.001, 100)
    trace.add_sent(0.001, 60)
    s = trace.summary()
    assert (s["steps"], s["prefill_steps"], s["pure_decode_steps"]) == (4, 1, 3)
    assert s["new_tokens"] == 7 and s["output_bytes"] == 160 and s["output_messages"] == 2
    assert s["idle_between_steps_s"] == 0.25
    assert s["decode_batch_p50"] == 2.0 and s["prefill_tokens_per_step_p50"] == 40.0
    trace.write()
    doc = json.loads((tmp_path / "t.json").read_text())
    assert len(doc["steps"]) == 4 and doc["summary"] == s


def test_unwritable_path_is_logged_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trace = StepTrace(str(tmp_path / "missing-dir" / "t.json"))
    trace.write()
    assert "cannot write the step trace" in caplog.text


def test_from_env_is_off_without_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert StepTrace.from_env() is None


@pytest.mark.slow
def test_engine_process_writes_its_trace_at_shutdown(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    engine_config_factory: Any,
    fake_executor_cls: Any,
) -> None:
    path = tmp_path / "steps.json"
    monkeypatch.setenv(ENV_VAR, str(path))  # inherited by the spawned engine process
    factory = make_engine_core_factory(engine_config_factory(), fake_executor_cls)
    client = SyncMPClient(factory, startup_timeout_s=60)
    try:
        for rid in ("a", "b"):
            client.add_request(
                EngineCoreRequest(
                    request_id=rid,
                    prompt_token_ids=list(range(1, 41)),
                    sampling_params=SamplingParams(max_tokens=6),
                    eos_token_id=None,
                    arrival_time=time.time(),
                )
            )
        done: set[str] = set()
        tokens = 0
        while done != {"a", "b"}:
            batch = client.get_output(timeout=30)
            tokens += sum(len(o.new_token_ids) for o in batch.outputs)
            done |= {o.request_id for o in batch.outputs if o.finished}
    finally:
        client.shutdown()
    summary = json.loads(path.read_text())["summary"]
    assert summary["new_tokens"] == tokens == 12
    assert summary["prefill_steps"] >= 1 and summary["pure_decode_steps"] >= 4
    assert summary["output_bytes"] > 0 and summary["output_messages"] >= summary["steps"]
