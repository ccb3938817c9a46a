"""The engine core's LoRA utilities (add_lora / remove_lora / list_loras) and request checks.

A fake executor stands for paged.runner's (the contract: add_lora(spec) raises
ValueError with the cause, remove_lora(name) -> bool, list_loras() -> names).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import msgspec
import pytest

from paged.runner.config import EngineConfig
from paged.runner.lora.config import LoRAAdapterSpec, LoRAConfig
from paged.scheduler.boundary import EngineCoreOutput, EngineCoreRequest
from paged.scheduler.sampling_params import SamplingParams
from paged.server.engine.client import _OutputDispatch
from paged.server.engine.core import EngineCore
from paged.server.engine.messages import UtilityResult


class LoRAMethods:
    """The executor's LoRA methods, over the FakeExecutor fixture's class (below).

    Loads "adapters" that are existing paths; a path containing "rank64" is too wide.
    """

    def __init__(self, engine_config: EngineConfig) -> None:
        super().__init__(engine_config)  # type: ignore[call-arg]  # FakeExecutor's
        self.loaded: dict[str, LoRAAdapterSpec] = {}
        self.removed: list[str] = []

    def add_lora(self, spec: LoRAAdapterSpec) -> None:
        if not os.path.exists(spec.path):
            raise ValueError(f"{spec.path!r}: no adapter_config.json")
        if "rank64" in spec.path:
            raise ValueError("adapter rank 64 is above max_lora_rank 16")
        self.loaded[spec.name] = spec

    def remove_lora(self, name: str) -> bool:
        self.removed.append(name)
        return self.loaded.pop(name, None) is not None

    def list_loras(self) -> list[str]:
        return list(self.loaded)


@pytest.fixture
def executor_cls(fake_executor_cls: type[Any]) -> type[Any]:
    return type("FakeLoRAExecutor", (LoRAMethods, fake_executor_cls), {})


@pytest.fixture
def make_core(engine_config_factory: Any, executor_cls: type[Any]) -> Any:
    def make(*, lora: bool = True, batch_queue_size: int = 1) -> EngineCore:
        config = engine_config_factory()
        if lora:
            config = dataclasses.replace(config, lora_config=LoRAConfig(max_loras=1))
        return EngineCore(config, executor_cls, batch_queue_size=batch_queue_size)

    return make


def req(rid: str, adapter: str | None, path: str | None, max_tokens: int = 3) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=[5, 6, 7],
        sampling_params=SamplingParams(max_tokens=max_tokens),
        eos_token_id=None,
        arrival_time=time.time(),
        lora_request=adapter,
        lora_path=path,
    )


def step_ids(core: EngineCore) -> list[str]:
    core.run_step()
    executor: Any = core.model_executor
    return list(executor.executed[-1].num_scheduled_tokens)


def drain(core: EngineCore) -> dict[str, list[EngineCoreOutput]]:
    got: dict[str, list[EngineCoreOutput]] = {}
    for _ in range(200):
        if not core.has_work():
            return got
        for outputs in core.run_step().values():
            for out in outputs.outputs:
                got.setdefault(out.request_id, []).append(out)
    raise AssertionError("engine did not go idle")


@pytest.fixture
def core(make_core: Any) -> EngineCore:
    core: EngineCore = make_core()
    return core


def test_add_list_remove_through_the_utilities(core: EngineCore, tmp_path: Any) -> None:
    executor: Any = core.model_executor
    assert core.call_utility("add_lora", ["a", str(tmp_path), 1]) is None
    assert executor.loaded["a"] == LoRAAdapterSpec("a", str(tmp_path), 1)
    assert core.call_utility("list_loras", []) == ["a"]
    with pytest.raises(ValueError, match="'a' is already loaded"):
        core.call_utility("add_lora", ["a", str(tmp_path), 2])
    # The executor's cause reaches the caller as a ValueError.
    with pytest.raises(ValueError, match=r"no adapter_config\.json"):
        core.call_utility("add_lora", ["b", str(tmp_path / "missing"), 2])
    (tmp_path / "rank64").mkdir()
    with pytest.raises(ValueError, match="rank 64"):
        core.call_utility("add_lora", ["c", str(tmp_path / "rank64"), 3])
    assert core.call_utility("list_loras", []) == ["a"]
    assert core.call_utility("remove_lora", ["a"]) is True
    assert core.call_utility("remove_lora", ["a"]) is False
    assert executor.removed == ["a"] and core.call_utility("list_loras", []) == []


def test_max_loras_reaches_the_scheduler(core: EngineCore, tmp_path: Any) -> None:
    assert core.scheduler_config.max_loras == 1
    core.add_request(req("x", "a", str(tmp_path)))
    core.add_request(req("y", "b", str(tmp_path)))
    core.add_request(req("z", None, None))
    # max_loras 1: "y" (a second adapter) waits, the base request goes.
    assert step_ids(core) == ["x", "z"]
    outs = drain(core)
    assert outs["y"][-1].finish_reason is not None


def test_removing_an_adapter_in_use_waits_for_its_requests(core: EngineCore, tmp_path: Any) -> None:
    executor: Any = core.model_executor
    core.call_utility("add_lora", ["a", str(tmp_path), 1])
    core.add_request(req("x", "a", str(tmp_path), max_tokens=4))
    first = [o for outs in core.run_step().values() for o in outs.outputs]
    assert core.call_utility("remove_lora", ["a"]) is True
    # Gone for new users at once; the weights stay while "x" runs.
    assert core.call_utility("list_loras", []) == [] and executor.removed == []
    outs = first + drain(core)["x"]
    assert len([t for o in outs for t in o.new_token_ids]) == 4  # finished in full
    assert executor.removed == ["a"] and "a" not in executor.loaded


def test_reloading_a_name_being_removed(core: EngineCore, tmp_path: Any) -> None:
    other = tmp_path / "other"
    other.mkdir()
    core.call_utility("add_lora", ["a", str(tmp_path), 1])
    core.add_request(req("x", "a", str(tmp_path), max_tokens=4))
    core.run_step()
    core.call_utility("remove_lora", ["a"])
    with pytest.raises(ValueError, match="still use its previous weights"):
        core.call_utility("add_lora", ["a", str(other), 2])
    core.call_utility("add_lora", ["a", str(tmp_path), 2])  # the same weights: kept
    drain(core)
    executor: Any = core.model_executor
    assert executor.removed == [] and core.call_utility("list_loras", []) == ["a"]


def test_requests_naming_an_adapter_need_lora_enabled(make_core: Any, tmp_path: Any) -> None:
    plain = make_core(lora=False)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        plain.add_request(req("x", "a", str(tmp_path)))
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        plain.call_utility("add_lora", ["a", str(tmp_path), 1])
    core = make_core()
    with pytest.raises(ValueError, match="without a path"):
        core.add_request(req("x", "a", None))


def test_lora_with_async_scheduling_is_refused(make_core: Any) -> None:
    with pytest.raises(ValueError, match="enable_lora: not supported with async scheduling"):
        make_core(batch_queue_size=2)


def test_a_utility_value_error_reaches_the_client_as_value_error() -> None:
    dispatch = _OutputDispatch()
    failed = UtilityResult(call_id=1, error="adapter rank 64 is above 16", value_error=True)
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(failed), type=UtilityResult)
    with pytest.raises(ValueError, match="adapter rank 64 is above 16"):
        dispatch.utility_result(wire, "add_lora", [])
    other = UtilityResult(call_id=2, error="RuntimeError: boom")
    with pytest.raises(RuntimeError, match="engine utility 'add_lora' failed"):
        dispatch.utility_result(other, "add_lora", [])
    ok = UtilityResult(call_id=3, result=msgspec.Raw(msgspec.msgpack.encode(["a", "b"])))
    assert dispatch.utility_result(ok, "list_loras", []) == ["a", "b"]


def test_kv_events_carry_the_adapter_and_prefixes_stay_apart(
    engine_config_factory: Any, executor_cls: type[Any], tmp_path: Any
) -> None:
    from paged.connectors.events import KVEventsConfig, KVEventSubscriber
    from paged.connectors.events.wire import BlockStored

    cfg = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"ipc://{tmp_path}/kv-pub",
        replay_endpoint=f"ipc://{tmp_path}/kv-replay",
        topic="kv",
    )
    config = dataclasses.replace(engine_config_factory(), lora_config=LoRAConfig(max_loras=2))
    core = EngineCore(config, executor_cls, kv_events_config=cfg)
    try:
        core.call_utility("add_lora", ["a", str(tmp_path), 1])
        prompt = list(range(1, 10))  # two full blocks of 4
        core.add_request(
            msgspec.structs.replace(req("x", "a", str(tmp_path)), prompt_token_ids=prompt)
        )
        drain(core)
        core.add_request(msgspec.structs.replace(req("y", None, None), prompt_token_ids=prompt))
        outs = drain(core)
        # The base request found nothing of the adapter's prefix in the cache.
        assert outs["y"][-1].num_cached_tokens == 0
        with KVEventSubscriber(cfg.endpoint, cfg.replay_endpoint, topic=cfg.topic) as sub:
            stored = [
                e for _, batch in sub.catch_up() for e in batch.events if isinstance(e, BlockStored)
            ]
        by_adapter = {e.lora_name: e for e in stored if e.token_ids[:4] == [1, 2, 3, 4]}
        assert set(by_adapter) == {"a", None}
        assert by_adapter["a"].block_hashes[0] != by_adapter[None].block_hashes[0]
    finally:
        core.shutdown()
