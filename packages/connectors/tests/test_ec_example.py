"""ECExampleConnector: producer saves, scheduler checks existence, worker loads into the cache.

A corrupt (checksum, truncation, wrong shape, not safetensors) or missing
file is a failed load: reported once, nothing reserved in the cache.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import safetensors.torch
import torch

from paged.connectors.ec import ECConnectorRole, ECConnectorRoleError
from paged.connectors.ec.example import (
    FILE_NAME,
    ECExampleConnector,
    ECExampleConnectorMetadata,
    MMMeta,
)
from paged.connectors.ec.testing import HIDDEN, DictEncoderCache, image_request, make_connector
from paged.scheduler.boundary import SchedulerOutput


def _pair(storage: Path, role: str) -> tuple[ECExampleConnector, ECExampleConnector]:
    config = {
        "ec_connector": "ECExampleConnector",
        "ec_role": role,
        "ec_connector_extra_config": {"shared_storage_path": str(storage)},
    }
    sched = make_connector(config, ECConnectorRole.SCHEDULER)
    worker = make_connector(config, ECConnectorRole.WORKER)
    assert isinstance(sched, ECExampleConnector) and isinstance(worker, ECExampleConnector)
    return sched, worker


def _produce(storage: Path, outputs: dict[str, torch.Tensor]) -> None:
    _, producer = _pair(storage, "producer")
    cache = DictEncoderCache()
    for mm_hash, output in outputs.items():
        cache.store(mm_hash, output)
        producer.save_caches(cache, mm_hash)
    assert producer.num_saved == len(outputs)


def _load_step(
    sched: ECExampleConnector,
    worker: ECExampleConnector,
    hashes: list[str],
    cache: DictEncoderCache,
) -> set[str]:
    """One consumer step: schedule every item it has, load, report failures."""
    request = image_request("r", hashes)
    for i, mm_hash in enumerate(hashes):
        if sched.has_cache_item(mm_hash):
            sched.update_state_after_alloc(request, i)
    worker.bind_connector_metadata(
        msgspec.msgpack.encode(sched.build_connector_meta(SchedulerOutput()))
    )
    worker.start_load_caches(cache)
    worker.clear_connector_metadata()
    return worker.get_failed_loads()


def test_saved_outputs_load_back_bit_exact(tmp_path: Path) -> None:
    outputs = {"img-a": torch.randn(4, HIDDEN), "img-b": torch.randn(4, HIDDEN)}
    _produce(tmp_path, outputs)
    # vLLM's layout: {path}/{mm_hash}/encoder_cache.safetensors with key "ec_cache".
    on_disk = safetensors.torch.load_file(str(tmp_path / "img-a" / FILE_NAME))
    torch.testing.assert_close(on_disk["ec_cache"], outputs["img-a"], rtol=0, atol=0)
    sched, worker = _pair(tmp_path, "consumer")
    assert sched.has_cache_item("img-a") and not sched.has_cache_item("img-c")
    cache = DictEncoderCache()
    assert _load_step(sched, worker, ["img-a", "img-b"], cache) == set()
    for mm_hash, output in outputs.items():
        loaded = cache.get(mm_hash)
        assert loaded is not None
        torch.testing.assert_close(loaded, output, rtol=0, atol=0)
    assert worker.num_loaded == 2
    # The scheduler side reset its per-step state: an empty step loads nothing.
    meta = sched.build_connector_meta(SchedulerOutput())
    assert isinstance(meta, ECExampleConnectorMetadata) and meta.mm_datas == []


def test_metadata_names_hash_and_embeds(tmp_path: Path) -> None:
    sched, _ = _pair(tmp_path, "consumer")
    request = image_request("r", ["x", "y"], embeds=3)
    sched.update_state_after_alloc(request, 1)
    meta = sched.build_connector_meta(SchedulerOutput())
    assert meta == ECExampleConnectorMetadata(mm_datas=[MMMeta("y", 3)])


def _corrupt_checksum(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:-4] + bytes(b ^ 0x5A for b in data[-4:]))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:40])


def _not_safetensors(path: Path) -> None:
    path.write_bytes(b"garbage, not a safetensors file at all")


def _wrong_shape(path: Path) -> None:
    safetensors.torch.save_file({"ec_cache": torch.randn(3, HIDDEN)}, str(path))


def _wrong_key(path: Path) -> None:
    safetensors.torch.save_file({"other": torch.randn(4, HIDDEN)}, str(path))


@pytest.mark.parametrize(
    "damage", [_corrupt_checksum, _truncate, _not_safetensors, _wrong_shape, _wrong_key]
)
def test_damaged_file_is_a_failed_load_with_nothing_reserved(
    tmp_path: Path, damage: object
) -> None:
    _produce(tmp_path, {"good": torch.randn(4, HIDDEN), "bad": torch.randn(4, HIDDEN)})
    assert callable(damage)
    damage(tmp_path / "bad" / FILE_NAME)
    sched, worker = _pair(tmp_path, "consumer")
    cache = DictEncoderCache()
    assert _load_step(sched, worker, ["good", "bad"], cache) == {"bad"}
    assert "good" in cache and "bad" not in cache
    assert worker.get_failed_loads() == set()  # reported once


def test_file_removed_after_the_check_is_a_failed_load(tmp_path: Path) -> None:
    _produce(tmp_path, {"gone": torch.randn(4, HIDDEN)})
    sched, worker = _pair(tmp_path, "consumer")
    request = image_request("r", ["gone"])
    assert sched.has_cache_item("gone")
    sched.update_state_after_alloc(request, 0)
    (tmp_path / "gone" / FILE_NAME).unlink()
    worker.bind_connector_metadata(
        msgspec.msgpack.encode(sched.build_connector_meta(SchedulerOutput()))
    )
    cache = DictEncoderCache()
    worker.start_load_caches(cache)
    assert worker.get_failed_loads() == {"gone"} and "gone" not in cache
    assert not sched.has_cache_item("gone")


def test_a_vllm_file_without_checksum_is_accepted(tmp_path: Path) -> None:
    tensor = torch.randn(4, HIDDEN)
    (tmp_path / "v").mkdir()
    safetensors.torch.save_file({"ec_cache": tensor}, str(tmp_path / "v" / FILE_NAME))
    sched, worker = _pair(tmp_path, "consumer")
    cache = DictEncoderCache()
    assert _load_step(sched, worker, ["v"], cache) == set()
    loaded = cache.get("v")
    assert loaded is not None and torch.equal(loaded, tensor)


def test_roles_gate_saving_and_loading(tmp_path: Path) -> None:
    _, consumer_worker = _pair(tmp_path, "consumer")
    cache = DictEncoderCache()
    cache.store("x", torch.randn(4, HIDDEN))
    consumer_worker.save_caches(cache, "x")  # a consumer does not save
    assert not (tmp_path / "x").exists()
    producer_sched, _ = _pair(tmp_path, "producer")
    _produce(tmp_path, {"x": torch.randn(4, HIDDEN)})
    assert not producer_sched.has_cache_item("x")  # a producer never loads
    with pytest.raises(ECConnectorRoleError, match="worker-side"):
        producer_sched.register_caches(cache)


def test_unsafe_hash_is_kept_inside_the_directory(tmp_path: Path) -> None:
    _, worker = _pair(tmp_path / "ec", "both")
    path = Path(worker.file_path("../../etc/passwd"))
    assert path.resolve().is_relative_to((tmp_path / "ec").resolve())


def test_missing_storage_path_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match="shared_storage_path"):
        make_connector(
            {"ec_connector": "ECExampleConnector", "ec_role": "both"}, ECConnectorRole.WORKER
        )
