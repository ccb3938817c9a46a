"""Two `paged serve` engines on one Redis: B answers A's long prompt from the Redis tier.

The default model (SmolLM2-135M-Instruct GGUF) in two engine processes whose
only offloading tier is `{"type": "redis"}` on a private redis-server. A
computes a 1,024-token prompt and writes its chunks; B, which never saw the
prompt, finds them, loads them and answers with A's greedy text. B's KV
events say which tier served the prompt (BlockStored, medium STORAGE,
locality REMOTE, ownership "redis") and its metrics count the hits.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import redis

from paged.connectors.events import KVEventSubscriber
from paged.connectors.events.wire import BlockStored
from paged.connectors.kv.offloading.redis_server import RedisServer
from tests.conftest import _free_port
from tests.connector_setup import complete, offloading_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = [(7 * i + 3) % 4000 + 100 for i in range(1024)]
CHUNK = 256
HIT = 1008  # the last block boundary (16 tokens) before the last prompt token
MAX_TOKENS = 8


@pytest.fixture
def redis_url() -> Iterator[str]:
    with RedisServer() as server:
        yield server.url


def _args(redis_url: str, events: tuple[str, str]) -> list[str]:
    transfer = offloading_config(
        {
            "spec_name": "TieringOffloadingSpec",
            "block_size": CHUNK,
            "secondary_tiers": [{"type": "redis", "url": redis_url, "enable_kv_events": True}],
        }
    )
    kv_events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": events[0],
        "replay_endpoint": events[1],
    }
    return [
        "--max-model-len", "1200", "--kv-cache-memory", "128MiB",
        "--kv-transfer-config", json.dumps(transfer),
        "--kv-events-config", json.dumps(kv_events),
    ]  # fmt: skip


def _complete(server: Any) -> tuple[str, int]:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    return complete(server.base_url, body)


def _wait_for_chunks(url: str, n: int) -> None:
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 60
    while len(client.keys("paged:kv:*")) < n:
        assert time.monotonic() < deadline, "engine A's chunks never reached Redis"
        time.sleep(0.2)


def _events(endpoints: tuple[str, str]) -> list[Any]:
    sub = KVEventSubscriber(endpoints[0], endpoints[1])
    try:
        deadline = time.monotonic() + 30
        events: list[Any] = []
        while time.monotonic() < deadline:
            batches = sub.catch_up(timeout_ms=2000)
            events.extend(e for _, batch in batches for e in batch.events)
            if any(isinstance(e, BlockStored) and e.ownership == "redis" for e in events):
                break
        return events
    finally:
        sub.close()


def test_engine_b_answers_engine_a_prompt_from_redis(
    redis_url: str, launch_server: Callable[..., Any]
) -> None:
    ends = [
        (f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}") for _ in range(2)
    ]
    with ThreadPoolExecutor(2) as pool:
        a, b = pool.map(lambda e: launch_server(*_args(redis_url, e)), ends)
    text_a, cached_a = _complete(a)
    assert cached_a == 0
    _wait_for_chunks(redis_url, 4)  # A's writer thread sends them in the background
    text_b, cached_b = _complete(b)
    assert (text_b, cached_b) == (text_a, HIT)  # served by Redis, the same greedy text
    with httpx.Client(base_url=b.base_url, timeout=60) as client:
        metrics = client.get("/metrics").text
    hits = re.search(r'paged:kv_offload_hits_tokens_total\{[^}]*tier="redis"[^}]*\} (\S+)', metrics)
    assert hits is not None and float(hits.group(1)) == HIT, metrics
    served = [e for e in _events(ends[1]) if isinstance(e, BlockStored) and e.ownership == "redis"]
    # Four 256-token chunks, reported by B as served from remote storage.
    assert len(served) == 4
    assert {(e.medium, e.locality) for e in served} == {("STORAGE", "REMOTE")}
    assert [t for e in served for t in e.token_ids] == PROMPT[:1024]
