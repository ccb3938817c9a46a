"""The CPU KV cache budget without --kv-cache-memory, and --gpu-memory-utilization on CPU."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from paged.server.cpu_memory import GIB, cpu_kv_cache_bytes
from paged.server.engine_args import EngineArgs


def _meminfo(tmp_path: Path, available_kib: int) -> Path:
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal:       25000000 kB\nMemAvailable:   {available_kib} kB\n")
    return path


def test_a_quarter_of_the_available_memory_by_default(tmp_path: Path) -> None:
    meminfo = _meminfo(tmp_path, 22 * 1024 * 1024)  # 22 GiB available (a 24 GiB machine)
    budget, source = cpu_kv_cache_bytes({}, meminfo)
    assert budget == int(22 * GIB * 0.25)
    assert "available" in source
    # SmolLM2-1.7B at its native 8,192 tokens: 24 layers x 2 x 32 KV heads x 64 x bf16
    assert budget >= 8192 * 24 * 2 * 32 * 64 * 2
    # never below the old fixed 1 GiB; 1 GiB where the memory is unknown
    assert cpu_kv_cache_bytes({}, _meminfo(tmp_path, 1024))[0] == GIB
    assert cpu_kv_cache_bytes({}, tmp_path / "absent")[0] == GIB


def test_vllm_cpu_kvcache_space_overrides_in_gib(tmp_path: Path) -> None:
    meminfo = _meminfo(tmp_path, 22 * 1024 * 1024)
    assert cpu_kv_cache_bytes({"VLLM_CPU_KVCACHE_SPACE": "3"}, meminfo)[0] == 3 * GIB
    assert cpu_kv_cache_bytes({"VLLM_CPU_KVCACHE_SPACE": "0"}, meminfo)[0] == int(22 * GIB / 4)
    for bad in ("-1", "2.5", "lots"):
        with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE"):
            cpu_kv_cache_bytes({"VLLM_CPU_KVCACHE_SPACE": bad}, meminfo)


def test_kv_cache_memory_wins_and_gpu_memory_utilization_warns_on_cpu(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    with caplog.at_level(logging.WARNING, logger="paged.server.engine_args"):
        assert EngineArgs(kv_cache_memory_bytes=5 << 20)._kv_cache_bytes("cpu") == 5 << 20
        assert not caplog.records
        assert EngineArgs(gpu_memory_utilization=0.5)._kv_cache_bytes("cpu") == 2 * GIB
    assert "--gpu-memory-utilization is ignored on CPU" in caplog.text
    # on CUDA the runner profiles the device: no budget here, no warning
    caplog.clear()
    assert EngineArgs(gpu_memory_utilization=0.5)._kv_cache_bytes("cuda") is None
    assert not caplog.records
