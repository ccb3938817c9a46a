"""OffloadingConnector through the real engine: host tier, disk tier across a restart, corruption.

Each test runs a 37-token prompt (two 16-token chunks and five tokens) on a
tiny random llama. The reference is the greedy output of an engine with no
connector; every run with the connector must give exactly those tokens,
whether the prefix was computed, loaded from host memory, loaded from disk
by a new engine, or recomputed after a corrupt chunk was detected. One test
runs the issue's full scenario with a 2,048-token prompt through real
`paged serve` processes (host tier, disk tier after a restart, corruption).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from paged.connectors.kv.offloading import OffloadingConnector
from paged.server.llm import LLM
from tests.connector_setup import (
    complete,
    greedy,
    greedy_body,
    offloading_config,
    scheduler_connector,
    small_cpu_engine,
    small_cpu_serve_args,
)

CHUNK = 16
PROMPT = [(5 * i + 11) % 120 + 5 for i in range(37)]
HIT = 32  # two full chunks; the last block boundary before token 36 is 32


@pytest.fixture(scope="module")
def tiny_model(tiny_word_llama: Path) -> Path:
    return tiny_word_llama


def _chunked(extra: dict[str, Any]) -> dict[str, Any]:
    """An OffloadingConnector config of `CHUNK`-token chunks and the options in `extra`."""
    return offloading_config({"chunk_size": CHUNK, **extra})


def _connector(llm: LLM) -> OffloadingConnector:
    conn = scheduler_connector(llm)
    assert isinstance(conn, OffloadingConnector)
    return conn


@pytest.fixture(scope="module")
def expected(tiny_model: Path) -> list[int]:
    with small_cpu_engine(tiny_model) as baseline:
        tokens, _ = greedy(baseline, PROMPT)
    return tokens


@pytest.mark.slow
def test_host_tier_serves_the_prefix_after_a_device_cache_reset(
    tiny_model: Path, expected: list[int]
) -> None:
    config = _chunked({"kv_bytes_per_rank": 1 << 20})
    with small_cpu_engine(tiny_model, kv_transfer_config=config) as llm:
        first, first_cached = greedy(llm, PROMPT)
        assert first == expected and first_cached == 0
        host = _connector(llm).scheduler_side.host
        assert host is not None and len(host) == 2  # both full chunks saved
        assert llm.reset_prefix_cache()
        second, second_cached = greedy(llm, PROMPT)
        assert second_cached == HIT  # all from the host tier: the device cache was empty
        assert second == expected


@pytest.mark.slow
def test_disk_tier_serves_a_new_engine_on_the_same_directory(
    tiny_model: Path, expected: list[int], tmp_path: Path
) -> None:
    config = _chunked({"disk_path": str(tmp_path / "kv")})
    with small_cpu_engine(tiny_model, kv_transfer_config=config) as first:
        tokens, cached = greedy(first, PROMPT)
        assert tokens == expected and cached == 0
    # (leaving the block shut the engine down, which flushed the background writer)
    assert len(list((tmp_path / "kv").glob("*.kvchunk"))) == 2
    with small_cpu_engine(tiny_model, kv_transfer_config=config) as second:
        tokens, cached = greedy(second, PROMPT)
        assert cached == HIT and tokens == expected


@pytest.mark.slow
def test_a_corrupt_chunk_is_recomputed_with_identical_tokens(
    tiny_model: Path, expected: list[int], tmp_path: Path
) -> None:
    config = _chunked({"disk_path": str(tmp_path / "kv")})
    with small_cpu_engine(tiny_model, kv_transfer_config=config) as first:
        greedy(first, PROMPT)
    files = sorted((tmp_path / "kv").glob("*.kvchunk"))
    assert len(files) == 2
    damaged: dict[Path, bytes] = {}
    for path in files:  # damage both: one payload byte each, the header stays valid
        data = bytearray(path.read_bytes())
        data[-100] ^= 0x40
        path.write_bytes(bytes(data))
        damaged[path] = bytes(data)
    with small_cpu_engine(tiny_model, kv_transfer_config=config) as second:
        tokens, _ = greedy(second, PROMPT)
        assert tokens == expected  # recomputed, not loaded
        assert llm_round_trip(second) == expected  # the recomputed chunks were saved again
    for path, bad in damaged.items():
        assert path.read_bytes() != bad  # the corrupt files were replaced


def llm_round_trip(llm: LLM) -> list[int]:
    """Run the prompt (saving it), reset the device cache, run it again from the tiers."""
    greedy(llm, PROMPT)
    assert llm.reset_prefix_cache()
    tokens, cached = greedy(llm, PROMPT)
    assert cached == HIT
    return tokens


@pytest.mark.slow
def test_http_host_tier_and_its_metrics(
    tiny_model: Path, expected: list[int], launch_server: Callable[..., Any]
) -> None:
    server = launch_server(
        *small_cpu_serve_args(tiny_model),
        "--kv-transfer-config",
        json.dumps(_chunked({"kv_bytes_per_rank": 1 << 20})),
    )
    body = greedy_body(tiny_model, PROMPT)
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        first = client.post("/v1/completions", json=body)
        assert first.status_code == 200, first.text
        assert client.post("/reset_prefix_cache").status_code == 200
        second = client.post("/v1/completions", json=body)
        assert second.status_code == 200, second.text
        assert second.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == HIT
        metrics = client.get("/metrics").text
    hits = re.search(r'paged:kv_offload_hits_tokens_total\{[^}]*tier="host"[^}]*\} (\S+)', metrics)
    assert hits is not None and float(hits.group(1)) == HIT, metrics
    saved = re.search(r'paged:kv_offload_saved_bytes_total\{[^}]*tier="host"[^}]*\} (\S+)', metrics)
    # Two chunks of 2 blocks x 2 layers x K/V x 8 tokens x 2 heads x 16 dims x 4 bytes.
    assert saved is not None and float(saved.group(1)) == 2 * 2 * 2 * 2 * 8 * 2 * 16 * 4


LONG_PROMPT = [(7 * i + 3) % 124 + 3 for i in range(2048)]
LONG_HIT = 2032  # eight full chunks saved; a hit stops one block short (the last token is computed)


def _stop(server: Any) -> None:
    """SIGINT and wait: the engine shuts down, flushing the disk tier's writer."""
    import signal

    server.process.send_signal(signal.SIGINT)
    server.process.wait(timeout=60)


@pytest.mark.slow
def test_http_2048_token_prompt_host_tier_disk_restart_and_corruption(
    tiny_model: Path, launch_server: Callable[..., Any], tmp_path: Path
) -> None:
    # The scenario through real `paged serve` processes on loopback: a 2,048-token
    # prompt, reset, host-tier hit; a new server on the same directory, disk-tier hit;
    # every chunk corrupted, a new server recomputes: identical greedy tokens each time.
    config = offloading_config(
        {
            "chunk_size": 256,
            "kv_bytes_per_rank": 64 << 20,
            "disk_path": str(tmp_path / "kv"),
            "disk_bytes_per_rank": 256 << 20,
        }
    )
    args = ["--device", "cpu", "--max-model-len", "2200", "--kv-cache-memory", "64MiB"]
    args += ["--kv-transfer-config", json.dumps(config)]
    body = greedy_body(tiny_model, LONG_PROMPT)

    def run(server: Any) -> tuple[str, int]:
        return complete(server.base_url, body)

    reference = launch_server(str(tiny_model), "--device", "cpu", "--max-model-len", "2200")
    expected, _ = run(reference)
    _stop(reference)

    first = launch_server(str(tiny_model), *args)
    assert run(first) == (expected, 0)
    with httpx.Client(base_url=first.base_url, timeout=60) as client:
        assert client.post("/reset_prefix_cache").status_code == 200
    assert run(first) == (expected, LONG_HIT)  # from host memory
    _stop(first)
    files = sorted((tmp_path / "kv").rglob("*.kvchunk"))
    assert len(files) == 8  # every full chunk of the prompt, written through to disk

    second = launch_server(str(tiny_model), *args)
    assert run(second) == (expected, LONG_HIT)  # from disk, after a restart
    _stop(second)

    for path in files:  # one payload byte each; the headers stay valid
        data = bytearray(path.read_bytes())
        data[-100] ^= 0x40
        path.write_bytes(bytes(data))
    third = launch_server(str(tiny_model), *args)
    text, _ = run(third)
    assert text == expected  # the checksums failed: recomputed, never wrong tokens
    _stop(third)


@pytest.mark.slow
def test_vllm_docs_multi_tier_config_is_accepted_and_serves(
    tiny_model: Path, expected: list[int], tmp_path: Path
) -> None:
    # vLLM 0.33 docs/features/kv_offloading_usage.md "Multi-Tier Setup", as written
    # there but for the sizes: host tier + fs secondary tier (paged's disk tier).
    extra = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 1 << 20,
        "block_size": CHUNK,
        "eviction_policy": "lru",
        "secondary_tiers": [
            {
                "type": "fs",
                "root_dir": str(tmp_path / "kv"),
                "n_read_threads": 32,
                "n_write_threads": 16,
            }
        ],
    }
    with small_cpu_engine(tiny_model, kv_transfer_config=offloading_config(extra)) as llm:
        tokens, cached = greedy(llm, PROMPT)
        assert tokens == expected and cached == 0
        conn = _connector(llm)
        assert conn.offload_config.disk_path == tmp_path / "kv"
        host = conn.scheduler_side.host
        assert host is not None and len(host) == 2
        assert llm.reset_prefix_cache()
        tokens, cached = greedy(llm, PROMPT)
        assert cached == HIT and tokens == expected
    assert len(list((tmp_path / "kv").glob("*.kvchunk"))) == 2
