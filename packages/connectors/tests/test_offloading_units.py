"""OffloadingConnector building blocks: chunk format, tier index, disk store, writer, config."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from paged.connectors.kv.offloading.chunks import (
    ChunkError,
    ChunkKey,
    Fingerprint,
    chunk_keys,
    decode_chunk,
    encode_chunk,
)
from paged.connectors.kv.offloading.config import OffloadingConfig
from paged.connectors.kv.offloading.index import TierIndex
from paged.connectors.kv.offloading.storage import (
    ChunkWriter,
    DiskStore,
    HostStore,
    scan_disk,
)

FP = Fingerprint(2, 4, 2, 4, "float32", ("a", "b"))
SHAPE = (2, 2, 2, 4, 2, 4)  # blocks, layers, K/V, block size, heads, head size


def _chunk(seed: float) -> torch.Tensor:
    return torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32).view(SHAPE) + seed


# ------------------------------------------------------------------ chunk format
def test_chunk_keys_are_the_last_block_hash_of_each_full_chunk() -> None:
    hashes = [bytes([i]) * 4 for i in range(7)]
    assert chunk_keys(hashes, 3) == [ChunkKey(hashes[2].hex()), ChunkKey(hashes[5].hex())]
    assert chunk_keys(hashes[:2], 3) == []


def test_chunk_round_trips_and_detects_each_kind_of_damage() -> None:
    payload = bytes(range(200))
    data = encode_chunk(FP, payload)
    assert bytes(decode_chunk(data, FP)) == payload
    flipped = bytearray(data)
    flipped[-7] ^= 1
    with pytest.raises(ChunkError, match="checksum"):
        decode_chunk(bytes(flipped), FP)
    with pytest.raises(ChunkError, match="truncated"):
        decode_chunk(data[:-1], FP)
    with pytest.raises(ChunkError, match="truncated"):
        decode_chunk(data[:5], FP)
    with pytest.raises(ChunkError, match="bad magic"):
        decode_chunk(b"X" + data[1:], FP)
    other = Fingerprint(2, 4, 1, 4, "float32", ("a", "b"))  # another head count
    with pytest.raises(ChunkError, match="foreign"):
        decode_chunk(data, other)
    bad_version = bytearray(data)
    bad_version[8] = 99
    with pytest.raises(ChunkError, match="version 99"):
        decode_chunk(bytes(bad_version), FP)


def test_fingerprint_block_bytes() -> None:
    assert FP.block_bytes == 2 * (2 * 4 * 2 * 4 * 4)
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        _ = Fingerprint(1, 1, 1, 1, "complex64", ("a",)).block_bytes


# ------------------------------------------------------------------ tier index
def test_index_evicts_least_recently_used_first_and_keeps_its_budget() -> None:
    index = TierIndex("host", 300)
    k = [ChunkKey(f"k{i}") for i in range(5)]
    assert index.insert(k[0], 100).evicted == []
    assert index.insert(k[1], 100).evicted == []
    assert index.insert(k[2], 100).evicted == []
    index.touch(k[0])  # k1 is now the least recently used
    assert index.insert(k[3], 100).evicted == [k[1]]
    assert index.keys_lru_first() == [k[2], k[0], k[3]]
    assert index.insert(k[4], 200).evicted == [k[2], k[0]]
    assert index.keys_lru_first() == [k[3], k[4]]
    assert index.used_bytes == 300 and index.num_evictions == 3
    index.check_integrity()
    # A chunk larger than the whole budget is refused and evicts nothing.
    assert index.insert(ChunkKey("big"), 301) == (False, [])
    assert len(index) == 2
    # Re-inserting a present key is a touch.
    assert index.insert(k[3], 100).evicted == [] and index.keys_lru_first() == [k[4], k[3]]
    assert index.remove(k[4]) and not index.remove(k[4])
    assert index.used_bytes == 100
    index.check_integrity()


def test_index_rebuild_trims_the_oldest_over_budget() -> None:
    index = TierIndex("disk", 250)
    evicted = index.rebuild(
        [(ChunkKey("old"), 100), (ChunkKey("mid"), 100), (ChunkKey("new"), 100)]
    )
    assert evicted == [ChunkKey("old")]
    assert index.keys_lru_first() == ["mid", "new"] and index.num_evictions == 0


def test_index_rejects_a_non_positive_budget() -> None:
    with pytest.raises(ValueError, match="host tier budget"):
        TierIndex("host", 0)


# ------------------------------------------------------------------ disk store
def test_disk_store_round_trip_and_scan_order(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, FP)
    for i, name in enumerate(["b", "a", "c"]):
        store.put(ChunkKey(name), _chunk(i))
        os.utime(store.file_of(ChunkKey(name)), (1000 + i, 1000 + i))
    (tmp_path / "unrelated.txt").write_text("x")
    scanned = scan_disk(tmp_path)
    assert [k for k, _ in scanned] == ["b", "a", "c"]  # oldest write first
    assert all(size == store.file_of(k).stat().st_size for k, size in scanned)
    got = store.get(ChunkKey("a"), SHAPE, torch.float32)
    torch.testing.assert_close(got, _chunk(1), rtol=0, atol=0)
    assert scan_disk(tmp_path / "absent") == []


def test_disk_store_missing_truncated_and_corrupt_files_are_chunk_errors(
    tmp_path: Path,
) -> None:
    store = DiskStore(tmp_path, FP)
    with pytest.raises(ChunkError, match="unreadable"):
        store.get(ChunkKey("nothing"), SHAPE, torch.float32)
    store.put(ChunkKey("t"), _chunk(0))
    path = store.file_of(ChunkKey("t"))
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ChunkError, match="truncated"):
        store.get(ChunkKey("t"), SHAPE, torch.float32)
    store.put(ChunkKey("c"), _chunk(0))
    path = store.file_of(ChunkKey("c"))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ChunkError, match="checksum"):
        store.get(ChunkKey("c"), SHAPE, torch.float32)
    # A chunk of another model's layout is refused even with a valid checksum.
    DiskStore(tmp_path, Fingerprint(2, 4, 2, 4, "float16", ("a", "b"))).put(
        ChunkKey("f"), _chunk(0).half()
    )
    with pytest.raises(ChunkError, match="foreign"):
        store.get(ChunkKey("f"), SHAPE, torch.float32)


# ------------------------------------------------------------------ writer
class _SlowDisk(DiskStore):
    def __init__(self, path: Path, gate: threading.Event) -> None:
        super().__init__(path, FP)
        self.gate = gate

    def put(self, key: ChunkKey, chunk: torch.Tensor) -> int:
        assert self.gate.wait(10)
        return super().put(key, chunk)


def test_writer_saves_in_the_background_and_a_load_waits_for_its_own_key(
    tmp_path: Path,
) -> None:
    gate = threading.Event()
    disk = _SlowDisk(tmp_path, gate)
    host = HostStore()
    writer = ChunkWriter(host, disk)
    try:
        start = time.perf_counter()
        writer.put(ChunkKey("k"), _chunk(0), to_host=True, to_disk=True)
        assert time.perf_counter() - start < 1.0  # the caller does not wait for the disk
        assert not disk.file_of(ChunkKey("k")).exists()
        writer.wait_for(ChunkKey("other"))  # nothing queued on it: returns at once
        waiter = threading.Thread(target=writer.wait_for, args=(ChunkKey("k"),))
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive()  # blocked until the write is done
        gate.set()
        waiter.join(10)
        assert not waiter.is_alive()
        assert disk.file_of(ChunkKey("k")).exists() and len(host) == 1
        writer.evict(ChunkKey("k"), host=True, disk=True)
        writer.flush()
        assert not disk.file_of(ChunkKey("k")).exists() and len(host) == 0
        host_c, disk_c = writer.take_counters()
        assert host_c.bytes_saved == _chunk(0).numel() * 4
        assert disk_c.bytes_saved > host_c.bytes_saved  # header included
    finally:
        gate.set()
        writer.close()


def test_writer_survives_a_failed_write(tmp_path: Path) -> None:
    disk = DiskStore(tmp_path, FP)
    writer = ChunkWriter(None, disk)
    try:
        (tmp_path / "blocker").mkdir()
        disk.path = tmp_path / "blocker" / "missing"  # writes now fail
        writer.put(ChunkKey("k"), _chunk(0), to_host=False, to_disk=True)
        writer.flush()
        disk.path = tmp_path
        writer.put(ChunkKey("k2"), _chunk(0), to_host=False, to_disk=True)
        writer.flush()
        assert disk.file_of(ChunkKey("k2")).exists()
    finally:
        writer.close()


# ------------------------------------------------------------------ config
def test_config_defaults_and_errors(tmp_path: Path) -> None:
    cfg = OffloadingConfig.from_extra_config({"kv_bytes_per_rank": 1024.0}, 16)
    assert cfg.chunk_size == 256 and cfg.host_bytes == 1024 and not cfg.has_disk
    cfg = OffloadingConfig.from_extra_config({"disk_path": str(tmp_path), "chunk_size": 32}, 16)
    assert cfg.has_disk and not cfg.has_host and cfg.chunk_size == 32
    with pytest.raises(ValueError, match="multiple of the block size 16"):
        OffloadingConfig.from_extra_config({"kv_bytes_per_rank": 1, "chunk_size": 24}, 16)
    with pytest.raises(ValueError, match="no tier configured"):
        OffloadingConfig.from_extra_config({}, 16)
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config keys"):
        OffloadingConfig.from_extra_config({"kv_bytes_per_rank": 1, "cpu_bytes": 2}, 16)
    with pytest.raises(ValueError, match="must be a number"):
        OffloadingConfig.from_extra_config({"kv_bytes_per_rank": "1GiB"}, 16)
    with pytest.raises(ValueError, match="disk_path"):
        OffloadingConfig.from_extra_config({"disk_path": ""}, 16)


def test_tensor_parallel_ranks_get_their_own_disk_directories(tmp_path: Path) -> None:
    cfg = OffloadingConfig.from_extra_config({"disk_path": str(tmp_path)}, 16)
    assert cfg.rank_disk_path(0, 1) == tmp_path
    assert cfg.rank_disk_path(1, 2) == tmp_path / "rank1"
    host_only = OffloadingConfig.from_extra_config({"kv_bytes_per_rank": 1}, 16)
    assert host_only.rank_disk_path(0, 2) is None
