"""A hybrid model (Gemma 3: sliding-window and global layers) through every KV connector.

A tiny random Gemma 3 text checkpoint (layers sliding / full / sliding,
window 12, block 8) answers one 61-token prompt greedily. Its KV comes back
from the OffloadingConnector's host tier after the device prefix cache is
reset, from the SharedStorageConnector, and from a prefill engine over P/D
(two `paged serve` processes): the greedy tokens must equal the colocated
engine's, and the sliding-window group must have stored only the chunks near
the prompt's end.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from paged.connectors.kv.offloading import OffloadingConnector
from paged.connectors.kv.offloading.chunks import ChunkKey, split_group_key
from paged.connectors.kv.shared_storage import SharedStorageConnector
from tests.conftest import LiveServer
from tests.connector_setup import (
    greedy,
    greedy_body,
    offloading_config,
    scheduler_connector,
    shared_storage_config,
    small_cpu_engine,
    small_cpu_serve_args,
    zmq_config,
)

WINDOW = 12
CHUNK = 16
PROMPT = [(11 * i + 7) % 120 + 5 for i in range(61)]
OFFLOAD_HIT = 48  # three full chunks; the window of token 48 is in chunk 2
STORAGE_HIT = 56  # the last block boundary before the last prompt token


def _build_tiny_gemma3(path: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, PreTrainedTokenizerFast

    config = Gemma3TextConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        query_pre_attn_scalar=24,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    config.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(0)
    model: Any = Gemma3ForCausalLM(config)
    model.float().save_pretrained(str(path))
    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast_cls: Any = PreTrainedTokenizerFast  # untyped in transformers
    fast_cls(tokenizer_object=tk, bos_token="w1", eos_token="w2").save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3-text"))


@pytest.mark.slow
def test_offload_and_shared_storage_serve_gemma3_with_colocated_tokens(
    gemma3: Path, tmp_path: Path
) -> None:
    with small_cpu_engine(gemma3) as baseline:
        expected, _ = greedy(baseline, PROMPT)

    offload_config = offloading_config({"chunk_size": CHUNK, "kv_bytes_per_rank": 1 << 20})
    with small_cpu_engine(gemma3, kv_transfer_config=offload_config) as offload:
        first, first_cached = greedy(offload, PROMPT)
        assert first == expected and first_cached == 0
        conn = scheduler_connector(offload)
        assert isinstance(conn, OffloadingConnector)
        host = conn.scheduler_side.host
        assert host is not None
        keys = host.keys_lru_first()
        # Three KV cache groups of one layer each (the global layer, two sliding ones; the
        # engine picks their order): the global group stores all 3 chunks, each sliding
        # group only the 2 that a resume near the prompt's end needs.
        per_group = Counter(split_group_key(ChunkKey(k))[1] for k in keys)
        assert sorted(per_group.values()) == [2, 2, 3], keys
        assert offload.reset_prefix_cache()
        second, second_cached = greedy(offload, PROMPT)
        assert second_cached == OFFLOAD_HIT  # from the host tier: the device cache was empty
        assert second == expected

    storage_config = shared_storage_config(tmp_path / "kv")
    with small_cpu_engine(gemma3, kv_transfer_config=storage_config) as storage:
        first, _ = greedy(storage, PROMPT)
        assert first == expected
        assert storage.reset_prefix_cache()
        second, second_cached = greedy(storage, PROMPT)
        assert second_cached == STORAGE_HIT
        assert second == expected
        conn = scheduler_connector(storage)
        assert isinstance(conn, SharedStorageConnector) and conn.stats.num_hits == 1


@pytest.mark.slow
def test_pd_producer_to_consumer_gives_gemma3_colocated_tokens(
    gemma3: Path, launch_server: Callable[..., LiveServer]
) -> None:
    args = small_cpu_serve_args(gemma3)
    # Started together: most of a start-up is waiting on imports and the engine spawn.
    with ThreadPoolExecutor(2) as pool:
        prefill, decode = pool.map(
            lambda role: launch_server(*args, "--kv-transfer-config", zmq_config(role)),
            ["kv_producer", "kv_consumer"],
        )
    body = greedy_body(gemma3, PROMPT)
    with (
        httpx.Client(base_url=prefill.base_url, timeout=120) as p,
        httpx.Client(base_url=decode.base_url, timeout=120) as d,
    ):
        # Colocated: the decode engine computes a request without remote params itself.
        colocated = d.post("/v1/completions", json=body)
        assert colocated.status_code == 200, colocated.text
        assert d.post("/reset_prefix_cache").status_code == 200

        first = p.post(
            "/v1/completions",
            json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        )
        assert first.status_code == 200, first.text
        params = first.json()["kv_transfer_params"]
        # vLLM's hybrid form: one block list per KV cache group (8 blocks cover 61 tokens).
        assert [len(ids) for ids in params["remote_block_ids"]] == [8, 8, 8]

        second = d.post("/v1/completions", json={**body, "kv_transfer_params": params})
        assert second.status_code == 200, second.text
        assert second.json()["choices"][0]["text"] == colocated.json()["choices"][0]["text"]
        cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == len(PROMPT) - 1  # every prompt token but the last came from P
