"""OffloadingConnector with `use_layerwise` through the real engine: same greedy tokens.

A 37-token prompt (two 16-token chunks and five tokens) on the tiny random
llama; the reference is an engine with no connector. With layer-wise loads
(each layer copied by a thread while the forward runs, the forward waiting
per layer) and saves (per layer, during the forward) the tokens must not
change, whether the prefix was computed, loaded from host memory, or
recomputed after a corrupt chunk failed its layer-wise load.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from tests.connector_setup import greedy, offloading_config, small_cpu_engine

CHUNK = 16
PROMPT = [(5 * i + 11) % 120 + 5 for i in range(37)]
HIT = 32


def _layerwise(extra: dict[str, Any]) -> dict[str, Any]:
    """A layer-wise OffloadingConnector config of `CHUNK`-token chunks and `extra`'s options."""
    return offloading_config({"chunk_size": CHUNK, "use_layerwise": True, **extra})


@pytest.mark.slow
def test_layerwise_host_and_disk_loads_and_a_failed_layer_load_keep_greedy_tokens(
    tiny_word_llama: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with small_cpu_engine(tiny_word_llama) as baseline:
        expected, _ = greedy(baseline, PROMPT)
    disk = tmp_path / "kv"
    config = _layerwise({"kv_bytes_per_rank": 1 << 20, "disk_path": str(disk)})
    with small_cpu_engine(tiny_word_llama, kv_transfer_config=config) as llm:
        assert greedy(llm, PROMPT) == (expected, 0)  # computed; saved layer by layer
        assert llm.reset_prefix_cache()
        assert greedy(llm, PROMPT) == (expected, HIT)  # loaded layer by layer from host memory
    files = sorted(disk.glob("*.kvchunk"))
    assert len(files) == 2
    data = bytearray(files[1].read_bytes())
    data[-100] ^= 0x40  # one payload byte: the checksum fails in the load thread
    files[1].write_bytes(bytes(data))
    restart_config = _layerwise({"disk_path": str(disk)})
    with small_cpu_engine(tiny_word_llama, kv_transfer_config=restart_config) as restarted:
        with caplog.at_level(logging.WARNING, logger="paged.connectors.kv.layerwise"):
            tokens, _ = greedy(restarted, PROMPT)
        assert tokens == expected  # chunk 1's blocks were recomputed, not read
        # ... because its load failed in the layer-wise load thread (the worker runs
        # in this process with the offline LLM).
        assert any("layer-wise load of chunk" in r.getMessage() for r in caplog.records)
        assert restarted.reset_prefix_cache()
        assert greedy(restarted, PROMPT) == (expected, HIT)  # the recomputed chunk was saved again
