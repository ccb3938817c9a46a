"""EPD end to end: an encoder producer, a consumer and `paged proxy --encode`, three real
processes on loopback (plus a colocated reference and a "fail"-policy consumer).

The consumer behind the proxy is never told the producer's address (vLLM 0.33's
protocol): the producer's answer names, per mm hash, where it holds the
embeddings (`ec_transfer_params`), the proxy forwards that to the consumer,
which fetches from there. The "fail"-policy consumer keeps the static
`producer_endpoints` option.

The tiny random Gemma3 of the image tests. Chats with 4 images each go through the
proxy: greedy tokens equal the colocated instance's and logprobs agree to 1e-4 (the
producer batches images its own way: float rounding); the consumer's vision
encoder runs zero times, every image is loaded once, a repeated image is not
fetched again, the producer releases what the consumer acknowledged. Faults: a
client that disconnects mid-stream; then the producer is killed and a consumer
encodes locally (recompute, same answer) or fails the request with a clear error
("fail"), each within seconds.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from paged.server.mm_testing import png_data_url, save_tiny_gemma3_model
from tests.conftest import LiveServer, _free_port
from tests.connector_setup import Proxy, metric_total, start_proxy

pytestmark = pytest.mark.slow

MAX_TOKENS = 6
TRANSFER_TIMEOUT_S = 2.0


@dataclass
class EPD:
    model: str
    reference: LiveServer
    producer: LiveServer
    consumer: LiveServer
    strict_consumer: LiveServer  # ec_load_failure_policy "fail", static producer_endpoints
    proxy: Proxy
    zmq_port: int  # where the producer serves its embeddings


@pytest.fixture(scope="module")
def epd(
    launch_server: Callable[..., LiveServer], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EPD]:
    model = save_tiny_gemma3_model(tmp_path_factory.mktemp("tiny-gemma3-epd"))
    common = [str(model), "--max-model-len", "256", "--limit-mm-per-prompt", '{"image": 4}']
    kv = ["--kv-cache-memory", "64MiB"]
    zmq_port = _free_port()

    def consumer(policy: str, endpoints: list[str]) -> list[str]:
        extra: dict[str, Any] = {"transfer_timeout": TRANSFER_TIMEOUT_S}
        if endpoints:
            extra["producer_endpoints"] = endpoints
        config = {
            "ec_connector": "ECZmqConnector",
            "ec_role": "ec_consumer",
            "ec_load_failure_policy": policy,
            "ec_connector_extra_config": extra,
        }
        return [*kv, "--ec-transfer-config", json.dumps(config)]

    producer = [
        "--ec-role", "producer",
        "--ec-connector-extra-config", json.dumps({"listen_port": zmq_port, "hold_timeout": 120}),
    ]  # fmt: skip
    # The proxy's consumer knows no producer: requests name it (ec_transfer_params).
    configs = [
        kv,
        producer,
        consumer("recompute", []),
        consumer("fail", [f"127.0.0.1:{zmq_port}"]),
    ]
    # Started together: most of a start-up is imports and the engine spawn.
    with ThreadPoolExecutor(len(configs)) as pool:
        reference, prod, cons, strict = pool.map(
            lambda extra: launch_server(*common, *extra), configs
        )
    proxy = start_proxy(
        tmp_path_factory.mktemp("proxy"), "--encode", prod.base_url, "--decode", cons.base_url
    )
    yield EPD(str(model), reference, prod, cons, strict, proxy, zmq_port)
    proxy.stop()


def chat(epd: EPD, seeds: list[int], **extra: Any) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": "describe this image please"}]
    content += [{"type": "image_url", "image_url": {"url": png_data_url(s)}} for s in seeds]
    return {
        "model": epd.model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "logprobs": True,
        "top_logprobs": 3,
        **extra,
    }


def answer(base_url: str, body: dict[str, Any]) -> tuple[list[str], list[float]]:
    resp = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    content = resp.json()["choices"][0]["logprobs"]["content"]
    return [t["token"] for t in content], [t["logprob"] for t in content]


def metrics(server: LiveServer) -> str:
    return httpx.get(server.base_url + "/metrics", timeout=10).text


def counter(server: LiveServer, name: str) -> float:
    return metric_total(metrics(server), name + "_total")


def wait_for_counter(server: LiveServer, name: str, value: float, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while (got := counter(server, name)) < value:
        assert time.monotonic() < deadline, f"{name}: {got} < {value}"
        time.sleep(0.2)


def same_answer(epd: EPD, got: tuple[list[str], list[float]], body: dict[str, Any]) -> None:
    ref_tokens, ref_logprobs = answer(epd.reference.base_url, body)
    assert got[0] == ref_tokens
    assert got[1] == pytest.approx(ref_logprobs, abs=1e-4)


def test_chats_through_the_proxy_equal_the_colocated_instance(epd: EPD) -> None:
    bodies = [chat(epd, [10 * i + k for k in range(4)]) for i in range(3)]
    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda b: answer(epd.proxy.base_url, b), bodies))
    for g, body in zip(got, bodies, strict=True):
        same_answer(epd, g, body)
    # The consumer never ran its vision encoder: 12 images, each loaded once.
    assert counter(epd.consumer, "paged:mm_encoder_items_computed") == 0
    assert counter(epd.consumer, "paged:ec_connector_loaded_items") == 12
    assert counter(epd.producer, "paged:mm_encoder_items_computed") == 12
    # The producer freed each output once the consumer had acknowledged it (its
    # hold_timeout is 120 s, so nothing here is an expiry).
    wait_for_counter(epd.producer, "paged:ec_connector_released_items", 12)

    # A repeated image (and one new one): only the new one crosses over.
    again = chat(epd, [0, 1, 2, 99])
    same_answer(epd, answer(epd.proxy.base_url, again), again)
    assert counter(epd.consumer, "paged:ec_connector_loaded_items") == 13
    assert counter(epd.consumer, "paged:mm_encoder_items_computed") == 0


def test_text_only_chats_skip_the_encoder(epd: EPD) -> None:
    body = {"model": epd.model, "messages": [{"role": "user", "content": "hello world"}],
            "max_tokens": MAX_TOKENS, "temperature": 0.0}  # fmt: skip
    before = counter(epd.producer, "paged:prompt_tokens")
    resp = httpx.post(epd.proxy.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200
    assert resp.json()["choices"][0]["message"]["content"]
    assert counter(epd.producer, "paged:prompt_tokens") == before  # never sent there


def test_a_client_that_disconnects_mid_stream_leaves_the_cluster_serving(epd: EPD) -> None:
    body = chat(epd, [200, 201, 202, 203], stream=True, max_tokens=64)
    body["ignore_eos"] = True
    with httpx.stream(
        "POST", epd.proxy.base_url + "/v1/chat/completions", json=body, timeout=60
    ) as resp:
        assert resp.status_code == 200
        for _ in resp.iter_lines():
            break  # the first event, then hang up
    deadline = time.monotonic() + 20
    while metric_total(metrics(epd.consumer), "paged:num_requests_running") > 0:
        assert time.monotonic() < deadline, "the consumer kept the aborted request"
        time.sleep(0.2)
    follow = chat(epd, [300])
    same_answer(epd, answer(epd.proxy.base_url, follow), follow)


def test_a_dead_producer_is_recomputed_or_fails_clearly_by_config(epd: EPD) -> None:
    body = chat(epd, [400, 401])
    # The producer's answer names where it holds each image (vLLM 0.33's shape).
    encoded = httpx.post(epd.producer.base_url + "/v1/chat/completions",
                         json={**body, "max_tokens": 1}, timeout=120)  # fmt: skip
    assert encoded.status_code == 200, encoded.text
    announced = encoded.json()["ec_transfer_params"]
    assert len(announced) == 2
    for index, entry in enumerate(announced.values()):
        assert entry == {"modality": "image", "item_indices": [index], "metadata": {},
                         "peer_host": "127.0.0.1", "peer_port": epd.zmq_port}  # fmt: skip
    epd.producer.process.send_signal(signal.SIGKILL)
    epd.producer.process.wait(timeout=30)
    # recompute: the consumer asks the producer the params name, which is gone; after
    # transfer_timeout it encodes the images itself, with the same answer.
    start = time.monotonic()
    got = answer(epd.consumer.base_url, {**body, "ec_transfer_params": announced})
    # It did ask (and wait for) the announced producer, then gave up in time.
    assert TRANSFER_TIMEOUT_S <= time.monotonic() - start < TRANSFER_TIMEOUT_S + 15
    same_answer(epd, got, body)
    assert counter(epd.consumer, "paged:mm_encoder_items_computed") == 2
    # fail: an OpenAI-style error naming the cause, within seconds; the engine lives on.
    start = time.monotonic()
    resp = httpx.post(
        epd.strict_consumer.base_url + "/v1/chat/completions", json=chat(epd, [402]), timeout=60
    )
    assert time.monotonic() - start < TRANSFER_TIMEOUT_S + 15
    assert resp.status_code >= 400 or resp.json()["choices"][0]["finish_reason"] == "error", (
        resp.text
    )
    assert "encoder cache load failed" in resp.text
    text_only = {"model": epd.model, "messages": [{"role": "user", "content": "hi"}],
                 "max_tokens": 2}  # fmt: skip
    ok = httpx.post(epd.strict_consumer.base_url + "/v1/chat/completions", json=text_only)
    assert ok.status_code == 200
    # The proxy reports the dead encoder as a 502 and /health as unhealthy.
    resp = httpx.post(epd.proxy.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 502 and "is unreachable" in resp.json()["error"]["message"]
    assert httpx.get(epd.proxy.base_url + "/health", timeout=10).status_code == 503
