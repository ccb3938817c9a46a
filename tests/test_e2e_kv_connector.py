"""KV transfer through the real engine: SharedStorageConnector, offline and over HTTP.

A prompt of several blocks runs once (its prefix KV is saved to the shared
storage directory), the device prefix cache is reset, and the same prompt
runs again: its prefix must now come from storage (the engine reports it as
cached, the connector counts a hit) and the greedy tokens must equal those
of an engine started without any connector.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from paged.connectors.kv.shared_storage import SharedStorageConnector, prefix_key
from paged.runner.kv_connector import KVConnectorWorkerFactory
from paged.scheduler.sampling_params import SamplingParams
from paged.server.input_processor import TokensPrompt
from paged.server.kv_transfer import KVConnectorBuilder
from paged.server.llm import LLM
from tests.connector_setup import (
    MAX_TOKENS,
    greedy,
    greedy_body,
    scheduler_connector,
    shared_storage_config,
    small_cpu_engine,
    small_cpu_serve_args,
)

PROMPT = [(7 * i + 3) % 120 + 5 for i in range(37)]  # 37 tokens: prefix of 4 blocks (32)
PREFIX = 32

# mypy proves the server's builder satisfies the runner's factory Protocol.
_FACTORY_CHECK: type[KVConnectorWorkerFactory] = KVConnectorBuilder


@pytest.fixture(scope="module")
def tiny_model(tiny_word_llama: Path) -> Path:
    return tiny_word_llama


def _storage_connector(llm: LLM) -> SharedStorageConnector:
    conn = scheduler_connector(llm)
    assert isinstance(conn, SharedStorageConnector)
    return conn


@pytest.mark.slow
def test_offline_prefix_comes_back_from_shared_storage(tiny_model: Path, tmp_path: Path) -> None:
    with small_cpu_engine(tiny_model) as baseline:
        expected, _ = greedy(baseline, PROMPT)

    storage = tmp_path / "kv"
    with small_cpu_engine(tiny_model, kv_transfer_config=shared_storage_config(storage)) as llm:
        first, first_cached = greedy(llm, PROMPT)
        assert first == expected and first_cached == 0
        key = prefix_key(PROMPT[:PREFIX], [])
        assert (storage / key / "rank0" / "COMPLETE").is_file()

        assert llm.reset_prefix_cache()
        second, second_cached = greedy(llm, PROMPT)
        stats = _storage_connector(llm).stats
        assert stats.num_hits == 1 and stats.num_hit_tokens == PREFIX
        assert second_cached == PREFIX  # all of it external: the device cache was reset
        assert second == expected


@pytest.mark.slow
def test_http_kv_transfer_params_and_reset_prefix_cache(
    tiny_model: Path, tmp_path: Path, launch_server: Callable[..., Any]
) -> None:
    storage = tmp_path / "kv-http"
    server = launch_server(
        *small_cpu_serve_args(tiny_model),
        "--kv-transfer-config",
        json.dumps(shared_storage_config(storage)),
    )
    url = server.base_url
    body = greedy_body(tiny_model, PROMPT)
    with httpx.Client(base_url=url, timeout=120) as client:
        bad_params = {"remote_port": "not a port"}
        bad = client.post("/v1/completions", json={**body, "kv_transfer_params": bad_params})
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["param"] == "kv_transfer_params"
        assert "remote_port" in bad.json()["error"]["message"]

        # Keys of a router or another connector are kept, not refused (an open dict in vLLM).
        first = client.post("/v1/completions", json={**body, "kv_transfer_params": {"tp_size": 1}})
        assert first.status_code == 200, first.text
        # vLLM's top-level field; SharedStorageConnector returns no params.
        assert "kv_transfer_params" in first.json() and first.json()["kv_transfer_params"] is None
        assert client.post("/reset_prefix_cache").status_code == 200

        second = client.post("/v1/completions", json=body)
        assert second.status_code == 200, second.text
        assert second.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
        usage = second.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == PREFIX

        chat = client.post(
            "/v1/chat/completions",
            json={
                "model": str(tiny_model),
                "messages": [{"role": "user", "content": "w5 w6"}],
                "max_tokens": 2,
                "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
                "kv_transfer_params": {"do_remote_decode": "yes"},
            },
        )
        assert chat.status_code == 400, chat.text
        assert chat.json()["error"]["param"] == "kv_transfer_params"


@pytest.mark.slow
def test_offline_fail_policy_errors_a_corrupt_load_and_keeps_serving(
    tiny_model: Path, tmp_path: Path
) -> None:
    storage = tmp_path / "kv-fail"
    config = shared_storage_config(storage) | {"kv_load_failure_policy": "fail"}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with small_cpu_engine(tiny_model, kv_transfer_config=config) as llm:
        greedy(llm, PROMPT)  # saves the prefix
        rank_dir = storage / prefix_key(PROMPT[:PREFIX], []) / "rank0"
        saved = sorted(rank_dir.glob("*.safetensors"))
        assert saved
        saved[-1].write_bytes(b"junk")  # a layer file the worker can no longer read
        assert llm.reset_prefix_cache()
        corrupt: TokensPrompt = {"prompt_token_ids": PROMPT}
        (failed,) = llm.generate([corrupt], params, use_tqdm=False)
        assert failed.finished and failed.outputs[0].finish_reason == "error"
        assert failed.outputs[0].token_ids == []
        # The engine keeps serving: another prompt runs to its length.
        other: TokensPrompt = {"prompt_token_ids": [p + 1 for p in PROMPT[:20]]}
        (ok,) = llm.generate([other], params, use_tqdm=False)
        assert ok.outputs[0].finish_reason == "length"
        assert len(ok.outputs[0].token_ids) == MAX_TOKENS
