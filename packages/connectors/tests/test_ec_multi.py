"""MultiECConnector (vLLM's gap 5): loads tried in child order, saves to every child."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from paged.connectors.ec import ECConnectorRole, ECTransferConfigError
from paged.connectors.ec.example import ECExampleConnector
from paged.connectors.ec.multi import MultiECConnector
from paged.connectors.ec.testing import HIDDEN, DictEncoderCache, image_request, make_connector
from paged.scheduler.boundary import SchedulerOutput
from paged.scheduler.request import Request


def _config(a: Path, b: Path, role: str = "both") -> dict[str, object]:
    return {
        "ec_connector": "MultiECConnector",
        "ec_role": role,
        "ec_connector_extra_config": {
            "connectors": [
                {
                    "ec_connector": "ECExampleConnector",
                    "ec_connector_extra_config": {"shared_storage_path": str(a)},
                },
                {
                    "ec_connector": "ECExampleConnector",
                    "ec_connector_extra_config": {"shared_storage_path": str(b)},
                },
            ]
        },
    }


def _pair(a: Path, b: Path, role: str = "both") -> tuple[MultiECConnector, MultiECConnector]:
    sched = make_connector(_config(a, b, role), ECConnectorRole.SCHEDULER)
    worker = make_connector(_config(a, b, role), ECConnectorRole.WORKER)
    assert isinstance(sched, MultiECConnector) and isinstance(worker, MultiECConnector)
    return sched, worker


def _children(conn: MultiECConnector) -> list[ECExampleConnector]:
    children = [c for c in conn.children if isinstance(c, ECExampleConnector)]
    assert len(children) == len(conn.children)
    return children


def test_saves_go_to_every_child(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    _, worker = _pair(a, b)
    cache = DictEncoderCache()
    worker.register_caches(cache)
    assert all(c.registered_cache is cache for c in worker.children)
    cache.store("x", torch.randn(4, HIDDEN))
    worker.save_caches(cache, "x")
    assert (a / "x").is_dir() and (b / "x").is_dir()


def _step(sched: MultiECConnector, worker: MultiECConnector, request: Request) -> DictEncoderCache:
    for i, feature in enumerate(request.mm_features):
        if sched.has_cache_item(feature.identifier):
            assert not sched.is_async_load(feature.identifier)
            sched.update_state_after_alloc(request, i)
    cache = DictEncoderCache()
    worker.bind_connector_metadata(
        msgspec.msgpack.encode(sched.build_connector_meta(SchedulerOutput()))
    )
    worker.start_load_caches(cache)
    worker.clear_connector_metadata()
    return cache


def test_loads_are_tried_in_child_order(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    in_a, in_b = torch.randn(4, HIDDEN), torch.randn(4, HIDDEN)
    only_b = torch.randn(4, HIDDEN)
    for path, tensor in ((a, in_a), (b, in_b)):  # "both" in both stores, different content
        producer = make_connector(_config(path, path, "producer"), ECConnectorRole.WORKER)
        cache = DictEncoderCache()
        cache.store("both", tensor)
        producer.save_caches(cache, "both")
    producer_b = make_connector(_config(b, b, "producer"), ECConnectorRole.WORKER)
    cache = DictEncoderCache()
    cache.store("only-b", only_b)
    producer_b.save_caches(cache, "only-b")

    sched, worker = _pair(a, b, "consumer")
    assert not sched.has_cache_item("nowhere")
    loaded = _step(sched, worker, image_request("r", ["both", "only-b", "nowhere"]))
    first, second = _children(worker)
    both, from_b = loaded.get("both"), loaded.get("only-b")
    assert both is not None and torch.equal(both, in_a)  # the first child wins
    assert from_b is not None and torch.equal(from_b, only_b)  # the second fills in
    assert (first.num_loaded, second.num_loaded) == (1, 1)
    assert "nowhere" not in loaded
    assert worker.get_failed_loads() == set()


def test_failed_loads_are_the_union_of_the_children(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for path, name in ((a, "x"), (b, "y")):
        producer = make_connector(_config(path, path, "producer"), ECConnectorRole.WORKER)
        cache = DictEncoderCache()
        cache.store(name, torch.randn(4, HIDDEN))
        producer.save_caches(cache, name)
    sched, worker = _pair(a, b, "consumer")
    request = image_request("r", ["x", "y"])
    for i in range(2):
        assert sched.has_cache_item(request.mm_features[i].identifier)
        sched.update_state_after_alloc(request, i)
    (a / "x" / "encoder_cache.safetensors").write_bytes(b"broken")
    (b / "y" / "encoder_cache.safetensors").unlink()
    worker.bind_connector_metadata(
        msgspec.msgpack.encode(sched.build_connector_meta(SchedulerOutput()))
    )
    worker.start_load_caches(DictEncoderCache())
    assert worker.get_failed_loads() == {"x", "y"}
    output = worker.build_connector_output(set())
    assert output.failed_recving == [] and output.finished_recving == []


def test_request_finished_and_shutdown_reach_every_child(tmp_path: Path) -> None:
    sched, _ = _pair(tmp_path / "a", tmp_path / "b")
    assert sched.request_finished(image_request("r", ["x"])) == (False, None)
    sched.shutdown()


@pytest.mark.parametrize(
    ("connectors", "message"),
    [
        (None, "non-empty list"),
        ([], "non-empty list"),
        (["ECExampleConnector"], r"connectors\[0\] must be an object"),
        ([{"ec_connector": "MultiECConnector"}], "cannot nest"),
        ([{"ec_connector": "ECExampleConnector", "ec_role": "bad"}], r"connectors\[0\]"),
    ],
)
def test_bad_child_configs_name_the_index(connectors: object, message: str) -> None:
    config: dict[str, object] = {"ec_connector": "MultiECConnector", "ec_role": "both"}
    if connectors is not None:
        config["ec_connector_extra_config"] = {"connectors": connectors}
    with pytest.raises(ECTransferConfigError, match=message):
        make_connector(config, ECConnectorRole.SCHEDULER)
