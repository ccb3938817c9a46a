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

from paged.scheduler.sampling_params import SamplingParams
from paged.server.input_processor import TokensPrompt
from paged.server.llm import LLM

BLOCK = 8
CHUNK = 16
PROMPT = [(5 * i + 11) % 120 + 5 for i in range(37)]
HIT = 32
MAX_TOKENS = 6


def _engine(model: Path, extra: dict[str, Any] | None) -> LLM:
    options: dict[str, Any] = {}
    if extra is not None:
        options["kv_transfer_config"] = {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"chunk_size": CHUNK, "use_layerwise": True, **extra},
        }
    return LLM(
        str(model),
        device="cpu",
        block_size=BLOCK,
        kv_cache_memory_bytes=4 << 20,
        max_model_len=128,
        **options,
    )


def _greedy(llm: LLM) -> tuple[list[int], int]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompt: TokensPrompt = {"prompt_token_ids": PROMPT}
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    return list(out.outputs[0].token_ids), out.num_cached_tokens


@pytest.mark.slow
def test_layerwise_host_and_disk_loads_and_a_failed_layer_load_keep_greedy_tokens(
    tiny_word_llama: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    baseline = _engine(tiny_word_llama, None)
    try:
        expected, _ = _greedy(baseline)
    finally:
        baseline.engine_client.shutdown()
    disk = tmp_path / "kv"
    llm = _engine(tiny_word_llama, {"kv_bytes_per_rank": 1 << 20, "disk_path": str(disk)})
    try:
        assert _greedy(llm) == (expected, 0)  # computed; saved layer by layer
        assert llm.reset_prefix_cache()
        assert _greedy(llm) == (expected, HIT)  # loaded layer by layer from host memory
    finally:
        llm.engine_client.shutdown()
    files = sorted(disk.glob("*.kvchunk"))
    assert len(files) == 2
    data = bytearray(files[1].read_bytes())
    data[-100] ^= 0x40  # one payload byte: the checksum fails in the load thread
    files[1].write_bytes(bytes(data))
    restarted = _engine(tiny_word_llama, {"disk_path": str(disk)})
    try:
        with caplog.at_level(logging.WARNING, logger="paged.connectors.kv.layerwise"):
            tokens, _ = _greedy(restarted)
        assert tokens == expected  # chunk 1's blocks were recomputed, not read
        # ... because its load failed in the layer-wise load thread (the worker runs
        # in this process with the offline LLM).
        assert any("layer-wise load of chunk" in r.getMessage() for r in caplog.records)
        assert restarted.reset_prefix_cache()
        assert _greedy(restarted) == (expected, HIT)  # the recomputed chunk was saved again
    finally:
        restarted.engine_client.shutdown()
