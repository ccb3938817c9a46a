"""P/D disaggregation end to end: prefill, decode and proxy as three real processes on loopback.

A tiny random llama (2 layers, 128 words). 32 prompts of 32-1,024 tokens go
through `paged proxy` to a prefill `paged serve` (PagedZmqConnector,
kv_producer) and a decode one (kv_consumer); greedy output must equal a
single colocated instance's, token for token. Then n > 1, streaming, error
pass-through, the prefill's KV usage back at zero and the transfer metrics.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import LiveServer, _free_port
from tests.connector_setup import Proxy, metric_total, start_proxy, zmq_config

BLOCK = 16
MAX_TOKENS = 8
NUM_PROMPTS = 32


def _prompts() -> list[list[int]]:
    rng = random.Random(13)
    lengths = [32, 1024] + [rng.randint(32, 1024) for _ in range(NUM_PROMPTS - 2)]
    return [[rng.randint(3, 127) for _ in range(n)] for n in lengths]


PROMPTS = _prompts()


def _engine_args(model: Path) -> list[str]:
    # 64 MiB of KV: 32 prompts of up to 1,024 tokens take 16 MiB on this model.
    return [str(model), "--device", "cpu", "--block-size", str(BLOCK), "--kv-cache-memory", "64MiB"]


@dataclass
class Cluster:
    prefill: LiveServer
    decode: LiveServer
    reference: LiveServer
    proxy: Proxy
    model: str


@pytest.fixture(scope="module")
def cluster(
    tiny_word_llama: Path,
    launch_server: Callable[..., LiveServer],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Cluster]:
    side_port = _free_port()
    args = _engine_args(tiny_word_llama)
    configs = [
        ["--kv-transfer-config", zmq_config("kv_producer", side_port)],
        ["--kv-transfer-config", zmq_config("kv_consumer")],
        [],  # the single colocated instance the outputs are compared with
    ]
    # Started together: most of a start-up is waiting on imports and the engine spawn.
    with ThreadPoolExecutor(3) as pool:
        prefill, decode, reference = pool.map(lambda extra: launch_server(*args, *extra), configs)
    proxy = start_proxy(
        tmp_path_factory.mktemp("proxy"), "--prefill", prefill.base_url, "--decode", decode.base_url
    )
    yield Cluster(prefill, decode, reference, proxy, str(tiny_word_llama))
    proxy.stop()


def _body(cluster: Cluster, prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {
        "model": cluster.model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": 0,
        **extra,
    }


def _tokens(choice: dict[str, Any]) -> list[str]:
    tokens: list[str] = choice["logprobs"]["tokens"]
    return tokens


@pytest.mark.slow
def test_32_prompts_through_the_proxy_equal_a_single_instance(cluster: Cluster) -> None:
    def complete(base_url: str, prompt: list[int]) -> list[str]:
        with httpx.Client(base_url=base_url, timeout=300) as client:
            resp = client.post("/v1/completions", json=_body(cluster, prompt))
            assert resp.status_code == 200, resp.text
            choice = resp.json()["choices"][0]
            assert choice["finish_reason"] == "length"
            return _tokens(choice)

    with ThreadPoolExecutor(NUM_PROMPTS) as pool:
        disagg = list(pool.map(lambda p: complete(cluster.proxy.base_url, p), PROMPTS))
    with ThreadPoolExecutor(8) as pool:
        single = list(pool.map(lambda p: complete(cluster.reference.base_url, p), PROMPTS))
    assert disagg == single
    assert all(len(t) == MAX_TOKENS for t in disagg)

    # The prefill handed every prompt over and freed all its blocks.
    deadline = time.monotonic() + 10
    while True:
        prefill_metrics = httpx.get(cluster.prefill.base_url + "/metrics").text
        usage = metric_total(prefill_metrics, "paged:kv_cache_usage_perc")
        if usage == 0.0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert usage == 0.0, prefill_metrics
    decode_metrics = httpx.get(cluster.decode.base_url + "/metrics").text
    sent = metric_total(prefill_metrics, "paged:kv_transfer_transfers_total", direction="send")
    assert sent >= 32
    recv = metric_total(decode_metrics, "paged:kv_transfer_transfers_total", direction="recv")
    assert recv >= 32
    moved = metric_total(decode_metrics, "paged:kv_transfer_bytes_total", direction="recv")
    # Every prompt's blocks but the one its last token sits in may be partial:
    # at least (len - 1) tokens x 2 layers x K/V x 2 heads x 16 dims x 4 bytes.
    assert moved >= sum(len(p) - 1 for p in PROMPTS) * 2 * 2 * 2 * 16 * 4
    assert metric_total(decode_metrics, "paged:kv_transfer_requests_waiting") == 0
    assert metric_total(decode_metrics, "paged:kv_transfer_failures_total") == 0  # (runs first)


@pytest.mark.slow
def test_n_greater_than_one_and_streaming(cluster: Cluster) -> None:
    prompt = PROMPTS[5]
    with httpx.Client(timeout=300) as client:
        ref = client.post(
            cluster.reference.base_url + "/v1/completions", json=_body(cluster, prompt)
        )
        assert ref.status_code == 200, ref.text
        expected_text = ref.json()["choices"][0]["text"]

        two = client.post(
            cluster.proxy.base_url + "/v1/completions", json=_body(cluster, prompt, n=2)
        )
        assert two.status_code == 200, two.text
        choices = two.json()["choices"]
        assert [c["index"] for c in choices] == [0, 1]
        assert all(c["text"] == expected_text for c in choices)

        text = ""
        events = 0
        with client.stream(
            "POST",
            cluster.proxy.base_url + "/v1/completions",
            json=_body(cluster, prompt, stream=True, logprobs=None),
        ) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events += 1
                text += json.loads(line[len("data: ") :])["choices"][0]["text"]
        assert text == expected_text and events >= 2

        chat = {
            "model": cluster.model,
            "messages": [{"role": "user", "content": " ".join(f"w{t}" for t in prompt[:64])}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        via_proxy = client.post(cluster.proxy.base_url + "/v1/chat/completions", json=chat)
        direct = client.post(cluster.reference.base_url + "/v1/chat/completions", json=chat)
        assert via_proxy.status_code == direct.status_code
        if direct.status_code == 200:
            assert (
                via_proxy.json()["choices"][0]["message"]["content"]
                == direct.json()["choices"][0]["message"]["content"]
            )


@pytest.mark.slow
def test_errors_pass_through_and_health(cluster: Cluster) -> None:
    with httpx.Client(base_url=cluster.proxy.base_url, timeout=60) as client:
        bad = client.post("/v1/completions", json=_body(cluster, [5, 6, 7], temperature=-1))
        assert bad.status_code == 400
        err = bad.json()["error"]
        assert err["type"] == "invalid_request_error" and "temperature" in err["message"]
        not_json = client.post(
            "/v1/completions", content=b"{", headers={"content-type": "application/json"}
        )
        assert not_json.status_code == 400 and "error" in not_json.json()
        health = client.get("/health")
        assert health.status_code == 200
        assert set(health.json()["upstreams"]) == {
            cluster.prefill.base_url,
            cluster.decode.base_url,
        }


@pytest.mark.slow
def test_dead_prefill_is_recomputed_by_the_decoder(cluster: Cluster) -> None:
    # Params naming a prefill that is gone (nothing listens on the port): the decoder's
    # pull times out (transfer_timeout, 5 s) and, kv_load_failure_policy being
    # "recompute", it computes the prompt itself: same tokens, bounded in time.
    prompt = PROMPTS[3]
    stale = {
        "do_remote_prefill": True,
        "remote_engine_id": "gone",
        "remote_request_id": "cmpl-gone",
        "remote_block_ids": list(range(1, len(prompt) // BLOCK + 2)),
        "remote_host": "127.0.0.1",
        "remote_port": _free_port(),
    }
    with httpx.Client(timeout=120) as client:
        ref = client.post(
            cluster.reference.base_url + "/v1/completions", json=_body(cluster, prompt)
        )
        start = time.monotonic()
        got = client.post(
            cluster.decode.base_url + "/v1/completions",
            json=_body(cluster, prompt, kv_transfer_params=stale),
        )
        elapsed = time.monotonic() - start
        assert got.status_code == 200, got.text
        assert _tokens(got.json()["choices"][0]) == _tokens(ref.json()["choices"][0])
        assert elapsed < 30
        metrics = client.get(cluster.decode.base_url + "/metrics").text
    assert metric_total(metrics, "paged:kv_transfer_failures_total", direction="recv") >= 1
    assert "no reply from the prefill engine" in cluster.decode.log()
