"""EngineCore over the real Scheduler and KV sizing, with a deterministic fake executor."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest

from paged.scheduler.boundary import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    GrammarOutput,
    KVTransferParams,
    SchedulerOutput,
)
from paged.scheduler.sampling_params import SamplingParams, StructuredOutputsParams
from paged.scheduler.testing import next_token
from paged.server.engine.core import EngineCore
from paged.server.engine.messages import EngineCoreStats


def req(rid: str, prompt: list[int], max_tokens: int = 5, **params: Any) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, **params),
        eos_token_id=None,
        arrival_time=time.time(),
    )


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


def drain(core: EngineCore, max_iters: int = 1000) -> dict[str, list[EngineCoreOutput]]:
    got: dict[str, list[EngineCoreOutput]] = {}
    for _ in range(max_iters):
        if not core.has_work():
            return got
        for outputs in core.run_step().values():
            for out in outputs.outputs:
                got.setdefault(out.request_id, []).append(out)
    raise AssertionError("engine did not go idle")


def tokens(outs: list[EngineCoreOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


# A constraint the fake providers mask for (their masks allow every token).
ANY_TEXT = StructuredOutputsParams(regex=".*")

PROMPTS = {"a": [5, 6, 7], "b": list(range(1, 41)), "c": [9] * 10}


@pytest.fixture
def core(engine_config_factory: Any, fake_executor_cls: Any) -> EngineCore:
    return EngineCore(engine_config_factory(), fake_executor_cls)


def test_kv_cache_sized_from_specs_and_budget(core: EngineCore) -> None:
    # One layer, page = 2 (K,V) * 4 tokens * 1 head * 8 dims * 4 bytes = 256 B; 16 KiB budget.
    assert core.kv_cache_config.num_blocks == (1 << 14) // 256
    executor: Any = core.model_executor
    assert executor.kv_cache_config is core.kv_cache_config
    assert core.info.num_gpu_blocks == 64 and core.info.block_size == 4
    assert core.info.kv_cache_memory_bytes == 1 << 14 and core.info.max_model_len == 64


def test_budget_measured_by_the_executor_when_not_configured(
    engine_config_factory: Any, fake_executor_cls: Any
) -> None:
    core = EngineCore(engine_config_factory(kv_cache_memory_bytes=None), fake_executor_cls)
    assert core.info.kv_cache_memory_bytes == 1 << 16
    assert core.kv_cache_config.num_blocks == (1 << 16) // 256


def test_too_small_kv_budget_fails_and_shuts_the_executor_down(
    engine_config_factory: Any, fake_executor_cls: Any
) -> None:
    made: list[Any] = []

    def factory(cfg: Any) -> Any:
        made.append(fake_executor_cls(cfg))
        return made[-1]

    with pytest.raises(ValueError, match="max_model_len"):
        EngineCore(engine_config_factory(kv_cache_memory_bytes=256 * 4), factory)
    assert made[0].is_shut_down


def test_steps_produce_the_model_tokens(core: EngineCore) -> None:
    for rid, prompt in PROMPTS.items():
        core.add_request(req(rid, prompt, max_tokens=6))
    got = drain(core)
    for rid, prompt in PROMPTS.items():
        assert tokens(got[rid]) == expected_tokens(prompt, 6)
        assert got[rid][-1].finish_reason is FinishReason.LENGTH
        assert all(o.finish_reason is None for o in got[rid][:-1])
    stats = core.get_stats()
    assert stats.num_requests_added == 3 and stats.num_model_steps >= 6
    assert stats.scheduler is not None and stats.scheduler.kv_cache_usage == 0.0
    assert not core.has_work() and core.run_step() == {}


def test_batch_queue_overlaps_and_gives_the_same_tokens(
    engine_config_factory: Any, fake_executor_cls: Any
) -> None:
    core = EngineCore(engine_config_factory(), fake_executor_cls, batch_queue_size=2)
    assert core.info.batch_queue_size == 2
    executor: Any = core.model_executor
    executor.execute_sleep_s = 0.01
    for rid, prompt in PROMPTS.items():
        core.add_request(req(rid, prompt, max_tokens=6))
    got: dict[str, list[EngineCoreOutput]] = {}
    max_in_flight = 0
    for _ in range(1000):
        if not core.has_work():
            break
        results = core.run_step()
        max_in_flight = max(max_in_flight, len(core.batch_queue) + (0 if results else 1))
        for outputs in results.values():
            for out in outputs.outputs:
                got.setdefault(out.request_id, []).append(out)
    assert not core.has_work()
    # The 40-token prompt is prefilled in chunks of at most 32 tokens: the
    # next chunk is scheduled while the previous one still executes.
    assert max_in_flight == 2
    for rid, prompt in PROMPTS.items():
        assert tokens(got[rid]) == expected_tokens(prompt, 6)
    core.shutdown()
    assert executor.is_shut_down


def test_abort_frees_the_request(core: EngineCore) -> None:
    core.add_request(req("long", [1, 2, 3], max_tokens=50))
    core.add_request(req("short", [4, 5], max_tokens=2))
    core.run_step()
    core.abort_requests(["long", "unknown"])
    core.abort_requests([])
    got = drain(core)
    assert "long" not in got or not any(o.finished for o in got["long"])
    assert tokens(got["short"])[-1:] == expected_tokens([4, 5], 2)[-1:]
    stats = core.call_utility("get_stats", [])
    assert isinstance(stats, EngineCoreStats)
    assert stats.scheduler is not None and stats.scheduler.kv_cache_usage == 0.0
    assert core.call_utility("get_num_unfinished_requests", []) == 0
    executor: Any = core.model_executor
    # The runner heard that the aborted request is gone.
    assert any("long" in so.finished_req_ids for so in executor.executed)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (req("", [1]), "request_id"),
        (req("x", []), "prompt_token_ids"),
        (req("x", [1, 128]), "prompt_token_ids .* token id 128, outside the vocabulary"),
        (req("x", [1], top_p=0.0), "top_p"),
        (req("x", [1], logprobs=50), "logprobs"),
    ],
)
def test_invalid_requests_are_rejected_naming_the_field(
    core: EngineCore, bad: EngineCoreRequest, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        core.add_request(bad)
    assert not core.has_work()


def test_duplicate_id_and_eos_rejected(core: EngineCore) -> None:
    core.add_request(req("x", [1]))
    with pytest.raises(ValueError, match="already in use"):
        core.add_request(req("x", [2]))
    bad_eos = EngineCoreRequest("y", [1], SamplingParams(), eos_token_id=999, arrival_time=0.0)
    with pytest.raises(ValueError, match="eos_token_id"):
        core.add_request(bad_eos)


def test_kv_transfer_params_without_connector_warn_and_serve(
    core: EngineCore, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM 0.33.0 (vllm/v1/engine/core.py:541-547): a warning, then served without transfer."""
    remote = EngineCoreRequest(
        "z",
        [1, 2, 3],
        SamplingParams(max_tokens=3),
        eos_token_id=None,
        arrival_time=0.0,
        kv_transfer_params=KVTransferParams(do_remote_decode=True),
    )
    with caplog.at_level("WARNING", logger="paged.server.engine.core"):
        core.add_request(remote)
    assert "Got kv_transfer_params, but no KVConnector found" in caplog.text
    outs = drain(core)["z"]
    assert tokens(outs) == expected_tokens([1, 2, 3], 3)
    assert outs[-1].finish_reason == FinishReason.LENGTH
    assert all(o.kv_transfer_params is None for o in outs)


def test_prompt_longer_than_the_context_finishes_with_an_output(core: EngineCore) -> None:
    core.add_request(req("huge", list(range(1, 100))))
    got = drain(core)
    (out,) = got["huge"]
    assert out.finished and out.new_token_ids == []
    assert out.finish_detail is not None and "max_model_len" in out.finish_detail


def test_utilities(core: EngineCore) -> None:
    assert core.call_utility("is_healthy", []) is True
    assert core.call_utility("reset_prefix_cache", []) is True
    assert core.call_utility("get_info", []) == core.info
    executor: Any = core.model_executor
    executor.fail_health = True
    assert core.call_utility("is_healthy", []) is False
    with pytest.raises(ValueError, match="not an engine utility"):
        core.call_utility("shutdown", [])


class OneGrammar:
    """A structured-output provider that allows every token for request 'g'."""

    def grammar_bitmask(
        self, requests: Sequence[Any], scheduler_output: SchedulerOutput
    ) -> GrammarOutput | None:
        ids = [r.request_id for r in requests if r.request_id == "g"]
        return GrammarOutput(ids, [[-1] * 4 for _ in ids]) if ids else None

    def accept_tokens(self, request_id: str, token_ids: Sequence[int]) -> bool:
        return True

    def remove_request(self, request_id: str) -> None:
        pass


def test_grammar_bitmask_reaches_sample_tokens(
    engine_config_factory: Any, fake_executor_cls: Any
) -> None:
    core = EngineCore(engine_config_factory(), fake_executor_cls, structured_output=OneGrammar())
    core.add_request(req("g", [1, 2], max_tokens=2, structured_outputs=ANY_TEXT))
    drain(core)
    executor: Any = core.model_executor
    # One mask per step that sampled for "g"; none once it finished.
    masks = [g.structured_output_request_ids for g in executor.grammar_seen if g is not None]
    assert masks == [["g"], ["g"]]


class TimedGrammar(OneGrammar):
    """OneGrammar that takes 50 ms per mask and records when and where it ran."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, float, float]] = []

    def grammar_bitmask(
        self, requests: Sequence[Any], scheduler_output: SchedulerOutput
    ) -> GrammarOutput | None:
        start = time.monotonic()
        time.sleep(0.05)
        self.spans.append((threading.current_thread().name, start, time.monotonic()))
        return super().grammar_bitmask(requests, scheduler_output)


@pytest.mark.parametrize("overlap", [True, False])
def test_grammar_mask_is_computed_while_the_model_runs(
    engine_config_factory: Any, fake_executor_cls: Any, overlap: bool
) -> None:
    forward: list[tuple[float, float]] = []

    class SlowForward(fake_executor_cls):  # type: ignore[misc]
        def execute_model(self, scheduler_output: SchedulerOutput) -> Any:
            start = time.monotonic()
            time.sleep(0.05)
            out = super().execute_model(scheduler_output)
            forward.append((start, time.monotonic()))
            return out

    grammar = TimedGrammar()
    core = EngineCore(engine_config_factory(), SlowForward, structured_output=grammar)
    core.mask_overlap.enabled = overlap
    core.add_request(req("g", [1, 2], max_tokens=3, structured_outputs=ANY_TEXT))
    core.add_request(req("free", [3, 4], max_tokens=3))
    t = time.monotonic()
    got = drain(core)
    elapsed = time.monotonic() - t
    assert tokens(got["free"]) == expected_tokens([3, 4], 3)  # unchanged by the overlap
    # "g" samples in 3 steps; a step without a constrained request computes no mask.
    assert len(grammar.spans) == 3 and len(forward) >= 3
    for (thread, m_start, m_end), (f_start, f_end) in zip(grammar.spans, forward[:3], strict=True):
        if overlap:
            assert thread.startswith("paged-mask") and m_start < f_end and f_start < m_end
        else:
            assert thread == threading.current_thread().name and m_start >= f_end
    # Overlapped, the masks hide behind the forward passes; not, they add up.
    serial = sum(e - s for s, e in forward) + sum(e - s for _, s, e in grammar.spans)
    hidden = sum(e - s for _, s, e in grammar.spans) / 2
    assert (elapsed < serial - hidden) if overlap else (elapsed >= serial)
    core.shutdown()


def test_steps_without_a_constrained_request_skip_the_mask_thread(
    engine_config_factory: Any, fake_executor_cls: Any
) -> None:
    grammar = TimedGrammar()
    core = EngineCore(engine_config_factory(), fake_executor_cls, structured_output=grammar)
    core.add_request(req("free", [3, 4], max_tokens=2))
    drain(core)
    assert grammar.spans == []


def test_bad_batch_queue_size(engine_config_factory: Any, fake_executor_cls: Any) -> None:
    with pytest.raises(ValueError, match="batch_queue_size"):
        EngineCore(engine_config_factory(), fake_executor_cls, batch_queue_size=0)


def test_outputs_are_keyed_by_client_index(core: EngineCore) -> None:
    r = EngineCoreRequest(
        "c1",
        [3, 4],
        SamplingParams(max_tokens=1),
        eos_token_id=None,
        arrival_time=0.0,
        client_index=1,
    )
    core.add_request(r)
    seen: dict[int, list[EngineCoreOutputs]] = {}
    while core.has_work():
        for idx, outs in core.step().items():
            seen.setdefault(idx, []).append(outs)
    assert [o.request_id for b in seen[1] for o in b.outputs] == ["c1"]


def test_batch_queue_abort_while_in_flight(
    engine_config_factory: Any, fake_executor_cls: Any
) -> None:
    core = EngineCore(engine_config_factory(), fake_executor_cls, batch_queue_size=2)
    core.add_request(req("long", list(range(1, 41)), max_tokens=20))
    core.add_request(req("other", [3, 4], max_tokens=4))
    core.run_step()  # the first prefill chunk is in flight
    assert core.batch_queue
    core.abort_requests(["long"])
    got = drain(core)
    assert not any(o.finished for o in got.get("long", []))
    assert tokens(got["other"]) == expected_tokens([3, 4], 4)
    stats = core.get_stats()
    assert stats.scheduler is not None and stats.scheduler.kv_cache_usage == 0.0
    core.shutdown()


@pytest.mark.parametrize("batch_queue_size", [1, 2])
def test_preemption_under_a_tight_kv_budget_keeps_tokens_exact(
    engine_config_factory: Any, fake_executor_cls: Any, batch_queue_size: int
) -> None:
    # 20 blocks of 4 tokens (one is the null block): four requests growing to
    # 30 tokens each cannot all stay resident, so some are preempted.
    cfg = engine_config_factory(kv_cache_memory_bytes=20 * 256, max_model_len=32)
    core = EngineCore(cfg, fake_executor_cls, batch_queue_size=batch_queue_size)
    prompts = {f"r{i}": [i + 1] * 10 for i in range(4)}
    for rid, prompt in prompts.items():
        core.add_request(req(rid, prompt, max_tokens=20))
    got = drain(core, max_iters=5000)
    for rid, prompt in prompts.items():
        assert tokens(got[rid]) == expected_tokens(prompt, 20), rid
    executor: Any = core.model_executor
    assert any(so.preempted_req_ids for so in executor.executed)
    core.shutdown()
