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
from paged.scheduler.sampling_params import SamplingParams
from paged.server.input_processor import TokensPrompt
from paged.server.llm import LLM

BLOCK = 8
CHUNK = 16
PROMPT = [(5 * i + 11) % 120 + 5 for i in range(37)]
HIT = 32  # two full chunks; the last block boundary before token 36 is 32
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def tiny_model(tiny_word_llama: Path) -> Path:
    return tiny_word_llama


def _engine(model: Path, extra: dict[str, Any] | None = None) -> LLM:
    options: dict[str, Any] = {}
    if extra is not None:
        options["kv_transfer_config"] = _offload_config(extra)
    return LLM(
        str(model),
        device="cpu",
        block_size=BLOCK,
        kv_cache_memory_bytes=4 << 20,
        max_model_len=128,
        **options,
    )


def _offload_config(extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"chunk_size": CHUNK, **extra},
    }


def _offload_config_chunks(extra: dict[str, Any]) -> dict[str, Any]:
    """`_offload_config` with the chunk size (and everything else) given by `extra`."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def _greedy(llm: LLM) -> tuple[list[int], int]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompt: TokensPrompt = {"prompt_token_ids": PROMPT}
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    return out.outputs[0].token_ids, out.num_cached_tokens


def _connector(llm: LLM) -> OffloadingConnector:
    core: Any = llm.engine_client
    conn = core.core.kv_connector
    assert isinstance(conn, OffloadingConnector)
    return conn


@pytest.fixture(scope="module")
def expected(tiny_model: Path) -> list[int]:
    baseline = _engine(tiny_model)
    try:
        tokens, _ = _greedy(baseline)
    finally:
        baseline.engine_client.shutdown()
    return tokens


@pytest.mark.slow
def test_host_tier_serves_the_prefix_after_a_device_cache_reset(
    tiny_model: Path, expected: list[int]
) -> None:
    llm = _engine(tiny_model, {"kv_bytes_per_rank": 1 << 20})
    try:
        first, first_cached = _greedy(llm)
        assert first == expected and first_cached == 0
        host = _connector(llm).scheduler_side.host
        assert host is not None and len(host) == 2  # both full chunks saved
        assert llm.reset_prefix_cache()
        second, second_cached = _greedy(llm)
        assert second_cached == HIT  # all from the host tier: the device cache was empty
        assert second == expected
    finally:
        llm.engine_client.shutdown()


@pytest.mark.slow
def test_disk_tier_serves_a_new_engine_on_the_same_directory(
    tiny_model: Path, expected: list[int], tmp_path: Path
) -> None:
    extra = {"disk_path": str(tmp_path / "kv")}
    first = _engine(tiny_model, extra)
    try:
        tokens, cached = _greedy(first)
        assert tokens == expected and cached == 0
    finally:
        first.engine_client.shutdown()  # flushes the background writer
    assert len(list((tmp_path / "kv").glob("*.kvchunk"))) == 2
    second = _engine(tiny_model, extra)
    try:
        tokens, cached = _greedy(second)
        assert cached == HIT and tokens == expected
    finally:
        second.engine_client.shutdown()


@pytest.mark.slow
def test_a_corrupt_chunk_is_recomputed_with_identical_tokens(
    tiny_model: Path, expected: list[int], tmp_path: Path
) -> None:
    extra = {"disk_path": str(tmp_path / "kv")}
    first = _engine(tiny_model, extra)
    try:
        _greedy(first)
    finally:
        first.engine_client.shutdown()
    files = sorted((tmp_path / "kv").glob("*.kvchunk"))
    assert len(files) == 2
    damaged: dict[Path, bytes] = {}
    for path in files:  # damage both: one payload byte each, the header stays valid
        data = bytearray(path.read_bytes())
        data[-100] ^= 0x40
        path.write_bytes(bytes(data))
        damaged[path] = bytes(data)
    second = _engine(tiny_model, extra)
    try:
        tokens, _ = _greedy(second)
        assert tokens == expected  # recomputed, not loaded
        assert llm_round_trip(second) == expected  # the recomputed chunks were saved again
    finally:
        second.engine_client.shutdown()
    for path, bad in damaged.items():
        assert path.read_bytes() != bad  # the corrupt files were replaced


def llm_round_trip(llm: LLM) -> list[int]:
    """Run the prompt (saving it), reset the device cache, run it again from the tiers."""
    _greedy(llm)
    assert llm.reset_prefix_cache()
    tokens, cached = _greedy(llm)
    assert cached == HIT
    return tokens


@pytest.mark.slow
def test_http_host_tier_and_its_metrics(
    tiny_model: Path, expected: list[int], launch_server: Callable[..., Any]
) -> None:
    server = launch_server(
        str(tiny_model),
        "--device",
        "cpu",
        "--block-size",
        str(BLOCK),
        "--max-model-len",
        "128",
        "--kv-cache-memory",
        "4MiB",
        "--kv-transfer-config",
        json.dumps(_offload_config({"kv_bytes_per_rank": 1 << 20})),
    )
    body = {"model": str(tiny_model), "prompt": PROMPT, "max_tokens": MAX_TOKENS}
    body |= {"temperature": 0.0, "ignore_eos": True}
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
    config = _offload_config_chunks(
        {
            "chunk_size": 256,
            "kv_bytes_per_rank": 64 << 20,
            "disk_path": str(tmp_path / "kv"),
            "disk_bytes_per_rank": 256 << 20,
        }
    )
    args = ["--device", "cpu", "--max-model-len", "2200", "--kv-cache-memory", "64MiB"]
    args += ["--kv-transfer-config", json.dumps(config)]
    body = {"model": str(tiny_model), "prompt": LONG_PROMPT, "max_tokens": MAX_TOKENS}
    body |= {"temperature": 0.0, "ignore_eos": True}

    def complete(server: Any) -> tuple[str, int]:
        with httpx.Client(base_url=server.base_url, timeout=300) as client:
            resp = client.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            out = resp.json()
            return out["choices"][0]["text"], out["usage"]["prompt_tokens_details"]["cached_tokens"]

    reference = launch_server(str(tiny_model), "--device", "cpu", "--max-model-len", "2200")
    expected, _ = complete(reference)
    _stop(reference)

    first = launch_server(str(tiny_model), *args)
    assert complete(first) == (expected, 0)
    with httpx.Client(base_url=first.base_url, timeout=60) as client:
        assert client.post("/reset_prefix_cache").status_code == 200
    assert complete(first) == (expected, LONG_HIT)  # from host memory
    _stop(first)
    files = sorted((tmp_path / "kv").rglob("*.kvchunk"))
    assert len(files) == 8  # every full chunk of the prompt, written through to disk

    second = launch_server(str(tiny_model), *args)
    assert complete(second) == (expected, LONG_HIT)  # from disk, after a restart
    _stop(second)

    for path in files:  # one payload byte each; the headers stay valid
        data = bytearray(path.read_bytes())
        data[-100] ^= 0x40
        path.write_bytes(bytes(data))
    third = launch_server(str(tiny_model), *args)
    text, _ = complete(third)
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
    llm = LLM(
        str(tiny_model),
        device="cpu",
        block_size=BLOCK,
        kv_cache_memory_bytes=4 << 20,
        max_model_len=128,
        kv_transfer_config=_offload_config_chunks(extra),
    )
    try:
        tokens, cached = _greedy(llm)
        assert tokens == expected and cached == 0
        conn = _connector(llm)
        assert conn.offload_config.disk_path == tmp_path / "kv"
        host = conn.scheduler_side.host
        assert host is not None and len(host) == 2
        assert llm.reset_prefix_cache()
        tokens, cached = _greedy(llm)
        assert cached == HIT and tokens == expected
    finally:
        llm.engine_client.shutdown()
    assert len(list((tmp_path / "kv").glob("*.kvchunk"))) == 2
