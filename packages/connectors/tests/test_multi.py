"""MultiConnector: the first child with tokens loads, every child saves (vLLM's semantics)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from paged.connectors.kv import (
    KVConnectorContext,
    KVConnectorFactory,
    KVConnectorRole,
    KVTransferConfigError,
    kv_transfer_config_from_dict,
)
from paged.connectors.kv.multi import MultiConnector, MultiConnectorMetadata
from paged.connectors.kv.shared_storage import prefix_key
from paged.connectors.kv.testing import (
    KVWorkerSim,
    ScriptedConnector,
    expected_kv,
    make_kv_caches,
)
from paged.kvcache import KVCacheBlocks
from paged.scheduler.boundary import SchedulerOutput
from paged.scheduler.connectors import KVConnectorScheduler
from paged.scheduler.request import Request
from paged.scheduler.sampling_params import SamplingParams
from paged.scheduler.testing import BLOCK_SIZE, make_request, make_scheduler

CTX = KVConnectorContext(block_size=BLOCK_SIZE)

# mypy proves MultiConnector satisfies the scheduler's Protocol.
_SCHEDULER_SIDE: type[KVConnectorScheduler] = MultiConnector


def _factory() -> KVConnectorFactory:
    factory = KVConnectorFactory.with_builtins()
    factory.register_connector("Scripted", "paged.connectors.kv.testing", "ScriptedConnector")
    return factory


def _multi(children: list[dict[str, Any]], role: KVConnectorRole) -> MultiConnector:
    cfg = kv_transfer_config_from_dict(
        {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "engine_id": "e0",
            "kv_connector_extra_config": {"connectors": children},
        }
    )
    return MultiConnector(cfg, role, CTX, factory=_factory())


def _scripted(name: str, **extra: Any) -> dict[str, Any]:
    return {"kv_connector": "Scripted", "kv_connector_extra_config": {"name": name, **extra}}


def _children(multi: MultiConnector) -> list[ScriptedConnector]:
    subs = multi.sub_connectors
    assert all(isinstance(c, ScriptedConnector) for c in subs)
    return [c for c in subs if isinstance(c, ScriptedConnector)]


def _request(rid: str = "r") -> Request:
    return Request(rid, list(range(1, 20)), SamplingParams(max_tokens=1), None, max_model_len=64)


def test_first_child_with_tokens_is_chosen_and_only_it_sees_them() -> None:
    multi = _multi(
        [_scripted("a", matched=0), _scripted("b", matched=8), _scripted("c", matched=4)],
        KVConnectorRole.SCHEDULER,
    )
    req = _request()
    assert multi.get_num_new_matched_tokens(req, 0) == (8, False)
    multi.update_state_after_alloc(req, KVCacheBlocks(blocks=([],)), 8)
    assert [c.allocs for c in _children(multi)] == [[("r", 0)], [("r", 8)], [("r", 0)]]


def test_async_answer_of_the_chosen_child_is_passed_on() -> None:
    multi = _multi(
        [_scripted("a", matched=4, load_async=True), _scripted("b", matched=8)],
        KVConnectorRole.SCHEDULER,
    )
    assert multi.get_num_new_matched_tokens(_request(), 0) == (4, True)


def test_a_child_that_cannot_tell_yet_makes_the_answer_none() -> None:
    multi = _multi(
        [_scripted("a", matched=8), _scripted("b", matched=None)], KVConnectorRole.SCHEDULER
    )
    assert multi.get_num_new_matched_tokens(_request(), 0) == (None, False)


def test_child_configs_inherit_engine_id_and_role() -> None:
    multi = _multi(
        [_scripted("a"), {**_scripted("b"), "kv_role": "kv_consumer"}], KVConnectorRole.SCHEDULER
    )
    a, b = _children(multi)
    assert a.kv_transfer_config.engine_id == "e0" and b.kv_transfer_config.engine_id == "e0"
    assert a.kv_transfer_config.kv_role == "kv_both"
    assert b.kv_transfer_config.kv_role == "kv_consumer"


def test_metadata_reaches_each_child_in_order() -> None:
    sched_side = _multi([_scripted("a"), _scripted("b")], KVConnectorRole.SCHEDULER)
    worker_side = _multi([_scripted("a"), _scripted("b")], KVConnectorRole.WORKER)
    meta = sched_side.build_connector_meta(SchedulerOutput(num_scheduled_tokens={"x": 1, "y": 2}))
    worker_side.bind_connector_metadata(meta)
    worker_side.start_load_kv()
    worker_side.save_kv_layer("layer.0", torch.zeros(1))
    assert [c.bound for c in _children(worker_side)] == [[["x", "y"]], [["x", "y"]]]
    assert [c.saved_layers for c in _children(worker_side)] == [["layer.0"], ["layer.0"]]
    worker_side.clear_connector_metadata()
    assert not any(c.has_connector_metadata() for c in _children(worker_side))


def test_metadata_for_another_number_of_children_is_rejected() -> None:
    worker_side = _multi([_scripted("a"), _scripted("b")], KVConnectorRole.WORKER)
    bad = msgspec.msgpack.encode(MultiConnectorMetadata(children=[b"\x90"]))
    with pytest.raises(ValueError, match="1 children, 2 connectors"):
        worker_side.bind_connector_metadata(bad)


def test_finished_sending_waits_for_every_delaying_child() -> None:
    sched_side = _multi(
        [_scripted("a", delay_free=True), _scripted("b", delay_free=True)],
        KVConnectorRole.SCHEDULER,
    )
    worker_side = _multi([_scripted("a"), _scripted("b")], KVConnectorRole.WORKER)
    assert sched_side.request_finished(_request("r"), ([1, 2],)) == (True, None)
    worker_side.bind_connector_metadata(sched_side.build_connector_meta(SchedulerOutput()))
    a, b = _children(worker_side)
    a.sending_done = {"r"}
    assert worker_side.get_finished(set()) == (None, None)  # b still sending
    b.sending_done = {"r"}
    assert worker_side.get_finished(set()) == ({"r"}, None)


def test_one_delaying_child_delays_the_free() -> None:
    sched_side = _multi(
        [_scripted("a"), _scripted("b", delay_free=True)], KVConnectorRole.SCHEDULER
    )
    assert sched_side.request_finished(_request("r"), ([1],)) == (True, None)
    assert (
        msgspec.msgpack.decode(
            sched_side.build_connector_meta(SchedulerOutput()), type=MultiConnectorMetadata
        ).extra_async_saves
        == {}
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, "connectors: a non-empty list"),
        ({"connectors": []}, "non-empty list"),
        ({"connectors": ["x"]}, r"connectors\[0\] must be an object"),
        ({"connectors": [{"kv_connector": "Scripted", "bogus": 1}]}, r"connectors\[0\]:.*bogus"),
    ],
)
def test_bad_child_configs_are_named(extra: dict[str, Any], message: str) -> None:
    cfg = kv_transfer_config_from_dict(
        {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
    )
    with pytest.raises(KVTransferConfigError, match=message):
        MultiConnector(cfg, KVConnectorRole.SCHEDULER, CTX, factory=_factory())


def _storage_multi(a: Path, b: Path, role: KVConnectorRole) -> MultiConnector:
    child = "SharedStorageConnector"
    return _multi(
        [
            {"kv_connector": child, "kv_connector_extra_config": {"shared_storage_path": str(a)}},
            {"kv_connector": child, "kv_connector_extra_config": {"shared_storage_path": str(b)}},
        ],
        role,
    )


def test_every_child_saves_and_a_later_request_loads_from_the_one_that_has_it(
    tmp_path: Path,
) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    sched_side = _storage_multi(a, b, KVConnectorRole.SCHEDULER)
    worker_side = _storage_multi(a, b, KVConnectorRole.WORKER)
    sched = make_scheduler(32, kv_connector=sched_side)
    sim = KVWorkerSim(worker_side, make_kv_caches(32, BLOCK_SIZE), BLOCK_SIZE)
    prompt = list(range(5, 16))
    sched.add_request(make_request("first", prompt, max_tokens=1))
    while sched.has_requests():
        so = sched.schedule()
        sched.update_from_output(so, sim.execute(so))
    key = prefix_key(prompt[:8], [])
    assert (a / key / "rank0" / "COMPLETE").is_file()
    assert (b / key / "rank0" / "COMPLETE").is_file()

    # Child a lost its copy: the prefix comes from b.
    (a / key / "rank0" / "COMPLETE").unlink()
    assert sched.reset_prefix_cache()
    for cache in sim.kv_caches.values():
        cache.zero_()
    sched.add_request(make_request("second", prompt, max_tokens=1))
    so = sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8
    sim.execute(so)
    loaded = sim.kv_of("second", 8)
    for name, kv in expected_kv(prompt, 8).items():
        torch.testing.assert_close(loaded[name], kv, rtol=0, atol=0)
