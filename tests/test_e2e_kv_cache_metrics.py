"""End to end: `paged serve --kv-cache-metrics` publishes block residency histograms.

The KV cache is kept small (16MiB: ~22 blocks of the default model) so that a
handful of distinct prompts cycle the whole pool and every sampled block
(rate 1) is reallocated; the first prompt is sent twice so its cached blocks
are touched again (a reuse gap). The server without the flag exposes none of
these series (checked in test_e2e_server.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING

import httpx
import pytest

if TYPE_CHECKING:
    from tests.conftest import LiveServer

pytestmark = pytest.mark.slow

WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india")


def _prompt(n: int) -> str:
    # ~60 distinct tokens per prompt: no two prompts share a block.
    return " ".join(f"{WORDS[(n + i) % len(WORDS)]}{n}-{i}" for i in range(20))


def _count(text: str, name: str) -> float:
    match = re.search(rf"^paged:{name}_count\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match is not None, f"{name} missing from /metrics"
    return float(match.group(1))


def test_residency_histograms_fill_after_evictions(
    launch_server: Callable[..., LiveServer],
) -> None:
    server = launch_server(
        "--max-model-len", "256", "--kv-cache-memory", "16MiB",
        "--kv-cache-metrics", "--kv-cache-metrics-sample", "1",
    )  # fmt: skip
    with httpx.Client(base_url=server.base_url, timeout=120) as h:
        for n in [0, 0, *range(1, 8)]:
            body = {"model": "SmolLM2-135M-Instruct", "prompt": _prompt(n), "max_tokens": 2}
            assert h.post("/v1/completions", json=body).status_code == 200
        text = h.get("/metrics").text
    assert _count(text, "kv_block_lifetime_seconds") > 0
    assert _count(text, "kv_block_idle_before_evict_seconds") > 0
    assert _count(text, "kv_block_reuse_gap_seconds") > 0
