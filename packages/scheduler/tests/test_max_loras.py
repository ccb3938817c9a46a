"""`max_loras`: at most that many distinct LoRA adapters among the running requests.

vLLM 0.33 (vllm/v1/core/sched/scheduler.py:1038-1101, 1563-1564): the adapters of
every running request count (scheduled this step or not); a waiting request with
an adapter not among them is skipped when they already number max_loras, later
requests may still go, and the skipped one goes back to the head of the queue.
"""

from __future__ import annotations

import msgspec
import pytest

from paged.scheduler.boundary import EngineCoreRequest
from paged.scheduler.config import SchedulerConfig
from paged.scheduler.scheduler import Scheduler
from paged.scheduler.testing import (
    FakeRunner,
    make_request,
    make_scheduler,
    run_to_completion,
)


def lora_request(
    rid: str, adapter: str | None, prompt: int = 6, max_tokens: int = 8
) -> EngineCoreRequest:
    request = make_request(rid, prompt, max_tokens=max_tokens)
    if adapter is None:
        return request
    return msgspec.structs.replace(request, lora_request=adapter, lora_path=f"/loras/{adapter}")


def scheduled_ids(sched: Scheduler) -> list[str]:
    return list(sched.schedule().num_scheduled_tokens)


def test_a_third_adapter_waits_while_base_and_known_adapters_go() -> None:
    sched = make_scheduler(max_loras=2)
    for rid, adapter in [("a", "A"), ("b", "B"), ("c", "C"), ("d", None), ("e", "A")]:
        sched.add_request(lora_request(rid, adapter))
    so = sched.schedule()
    # "c" (a third adapter) is skipped; the base request and A's second one go.
    assert list(so.num_scheduled_tokens) == ["a", "b", "d", "e"]
    assert {r.req_id: r.lora_request for r in so.scheduled_new_reqs} == {
        "a": "A",
        "b": "B",
        "d": None,
        "e": "A",
    }
    assert so.scheduled_new_reqs[0].lora_path == "/loras/A"
    # The skipped request is back at the head of the waiting queue.
    assert [r.request_id for r in sched.state.waiting] == ["c"]
    stats = sched.make_stats()
    assert stats is not None
    assert stats.running_lora_adapters == {"A": 2, "B": 1}
    assert stats.waiting_lora_adapters == {"C": 1}


def test_skipped_adapter_runs_once_a_slot_frees_and_every_step_keeps_the_limit() -> None:
    sched = make_scheduler(max_loras=2)
    sched.add_request(lora_request("a", "A", max_tokens=2))
    sched.add_request(lora_request("b", "B", max_tokens=20))
    sched.add_request(lora_request("c", "C", max_tokens=2))
    sched.add_request(lora_request("d", "D", max_tokens=2))
    first_step: dict[str, int] = {}
    steps = 0

    def check(s: Scheduler, so: object) -> None:
        nonlocal steps
        steps += 1
        running = {r.lora_name for r in s.state.running}
        assert len(running) <= 2, running
        for r in s.state.running:
            first_step.setdefault(r.request_id, steps)

    outputs = run_to_completion(sched, FakeRunner(), on_step=check)
    assert set(outputs) == {"a", "b", "c", "d"}
    # C only after A finished, D only after C finished (B runs throughout).
    assert first_step["a"] == first_step["b"] == 1
    assert first_step["a"] < first_step["c"] < first_step["d"]


def test_adapters_admitted_in_earlier_steps_count() -> None:
    # A budget of 8 tokens: "a" (8-token prompt) takes the whole first step.
    sched = make_scheduler(max_loras=1, max_num_batched_tokens=8, max_num_seqs=4)
    sched.add_request(lora_request("a", "A", prompt=8))
    assert scheduled_ids(sched) == ["a"]
    sched.add_request(lora_request("b", "B", prompt=4))
    sched.add_request(lora_request("c", None, prompt=4))
    so = sched.schedule()
    assert "b" not in so.num_scheduled_tokens
    assert "c" in so.num_scheduled_tokens


def test_without_max_loras_adapters_are_not_limited() -> None:
    sched = make_scheduler()
    for i in range(5):
        sched.add_request(lora_request(f"r{i}", f"L{i}"))
    assert len(scheduled_ids(sched)) == 5


def test_max_loras_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_loras must be >= 1"):
        SchedulerConfig(max_model_len=64, max_loras=0)


def test_lora_names_in_use_are_those_of_unfinished_requests() -> None:
    sched = make_scheduler(max_loras=1)
    sched.add_request(lora_request("a", "A", max_tokens=1))
    sched.add_request(lora_request("b", "B", max_tokens=1))
    sched.add_request(lora_request("c", None, max_tokens=1))
    # Waiting ones count too: an unload must wait for them as well.
    assert sched.lora_names_in_use() == {"A", "B"}
    run_to_completion(sched, FakeRunner())
    assert sched.lora_names_in_use() == set()
