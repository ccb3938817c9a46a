"""--kv-cache-dtype in the runner: names, block counts, storage, agreement with "auto".

Figures measured on the tiny random Llama (2 layers, hidden 64, float32,
scales 1.0), teacher-forced over 51 positions: top-1 agreement with the float32
cache 0.961 (fp8_e4m3) / 0.980 (fp8_e5m2), largest logit difference 0.012 /
0.021 on logits of magnitude ~0.5. Greedy decoding (24 tokens) first differs at
token 10 of one prompt and 21 of another, the third agrees throughout: a
random model's logits are nearly flat, so near-ties flip. float16 and bfloat16
caches give the float32 cache's greedy tokens exactly here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from paged.kvcache import get_kv_cache_config
from paged.kvcache.specs import AttentionSpec
from paged.runner.config import CacheConfig, EngineConfig, ModelConfig, SchedulerLimits
from paged.runner.executor import UniProcExecutor
from paged.runner.kv_cache_dtype import (
    BUILT_KV_CACHE_DTYPES,
    VLLM_KV_CACHE_DTYPES,
    check_kv_cache_dtype,
    kv_cache_spec_dtype,
)
from paged.runner.loader import load_model
from paged.runner.model_runner import ModelRunner

BLOCK = 4
BUDGET = 1 << 20
PROMPTS = {"a": [5, 9, 33, 17, 80, 3, 44], "b": [100, 2, 7, 7, 61], "c": list(range(10, 40))}


def test_built_names_pass_and_the_rest_of_vllms_list_is_refused_by_name() -> None:
    for name in BUILT_KV_CACHE_DTYPES:
        assert CacheConfig(cache_dtype=name).cache_dtype == name
    for name in ("fp8_inc", "fp8_ds_mla", "nvfp4", "int8_per_token_head"):
        assert name in VLLM_KV_CACHE_DTYPES
        with pytest.raises(ValueError, match=r"vLLM 0\.33 KV cache format that paged does not"):
            CacheConfig(cache_dtype=name)
    with pytest.raises(ValueError, match="'fp9' is not a KV cache dtype"):
        check_kv_cache_dtype("fp9")


def test_spec_dtype_names() -> None:
    assert kv_cache_spec_dtype("auto", "float32") == "float32"
    assert kv_cache_spec_dtype("float16", "float32") == "float16"
    assert kv_cache_spec_dtype("fp8", "bfloat16") == "float8_e4m3fn"
    assert kv_cache_spec_dtype("fp8_e4m3", "float32") == "float8_e4m3fn"
    assert kv_cache_spec_dtype("fp8_e5m2", "float32") == "float8_e5m2"


def _runner(path: Path, cache_dtype: str) -> ModelRunner:
    runner = ModelRunner(
        ModelConfig.from_pretrained(str(path), max_model_len=128),
        CacheConfig(block_size=BLOCK, kv_cache_memory_bytes=BUDGET, cache_dtype=cache_dtype),
        SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=64),
        "cpu",
    )
    runner.load_model()
    return runner


def test_block_count_grows_as_the_page_shrinks(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("llama")
    blocks: dict[str, int] = {}
    storage = {
        "auto": torch.float32,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "fp8": torch.float8_e4m3fn,
        "fp8_e5m2": torch.float8_e5m2,
    }
    for name, dtype in storage.items():
        runner = _runner(path, name)
        specs = runner.get_kv_cache_spec()
        assert all(isinstance(s, AttentionSpec) for s in specs.values())
        config = get_kv_cache_config(specs, runner.determine_available_memory())
        runner.initialize_kv_cache(config)
        assert {c.dtype for c in runner.kv_caches} == {dtype}
        # The whole budget goes to blocks whatever the dtype: the bytes saved buy blocks.
        used = sum(c.numel() * c.element_size() for c in runner.kv_caches)
        assert BUDGET - used < sum(s.page_size_bytes for s in specs.values())
        blocks[name] = config.num_blocks
    # 2 layers x 2 KV heads x 16 dims x 4 tokens x K,V: 2048 B a block in float32.
    assert blocks == {"auto": 512, "float16": 1024, "bfloat16": 1024, "fp8": 2048, "fp8_e5m2": 2048}


def _greedy(path: Path, cache_dtype: str, executor_greedy: Callable[..., Any]) -> Any:
    config = EngineConfig(
        model_config=ModelConfig.from_pretrained(str(path), max_model_len=128),
        cache_config=CacheConfig(
            block_size=BLOCK, kv_cache_memory_bytes=BUDGET, cache_dtype=cache_dtype
        ),
        scheduler_limits=SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=64),
    )
    with UniProcExecutor(config) as executor:
        return executor_greedy(executor, PROMPTS, 24)


def test_greedy_tokens_with_fp8_and_fp16_caches(
    tiny_checkpoint: Callable[..., Path], executor_greedy: Callable[..., Any]
) -> None:
    path = tiny_checkpoint("llama")
    want = _greedy(path, "auto", executor_greedy)
    # float16 stores K/V within 2**-11 relative: the same tokens throughout.
    assert _greedy(path, "float16", executor_greedy) == want
    assert _greedy(path, "bfloat16", executor_greedy) == want
    for name in ("fp8", "fp8_e5m2"):
        got = _greedy(path, name, executor_greedy)
        for rid in PROMPTS:
            assert got[rid][:9] == want[rid][:9], (name, rid)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_teacher_forced_logits_close_to_the_float32_cache(
    tiny_checkpoint: Callable[..., Path],
    make_driver: Callable[..., Any],
    dtype: torch.dtype,
) -> None:
    path = tiny_checkpoint("llama")
    model = load_model(ModelConfig.from_pretrained(str(path)), "cpu")
    exact, fp8 = make_driver(model, block_size=BLOCK), make_driver(model, block_size=BLOCK)
    fp8.kv_caches = [torch.zeros_like(c, dtype=dtype) for c in fp8.kv_caches]
    agree = total = 0
    worst = 0.0
    for rid, prompt in PROMPTS.items():
        tokens = prompt + [(7 * i + len(prompt)) % 128 for i in range(16)]
        for driver in (exact, fp8):
            driver.add(rid, tokens)
        steps = [len(prompt)] + [1] * 16
        for n in steps:
            a, b = exact.step([(rid, n)]), fp8.step([(rid, n)])
            agree += int((a.argmax(-1) == b.argmax(-1)).sum())
            total += a.shape[0]
            worst = max(worst, float((a - b).abs().max()))
    assert agree / total >= 0.9
    assert 0 < worst < {torch.float8_e4m3fn: 0.03, torch.float8_e5m2: 0.06}[dtype]


SCRIPT = """
import sys, torch
from paged.runner.attention.backends import AttentionMetadataBuilder
from paged.runner.attention.metadata import ForwardContext
from paged.runner.config import ModelConfig
from paged.runner.loader import load_model

dtype = getattr(torch, sys.argv[2])

def run(backend):
    model = load_model(ModelConfig.from_pretrained(sys.argv[1], attention_backend=backend), "cpu")
    caches = [torch.zeros(2, 8, 4, a.num_kv_heads, a.head_size, dtype=dtype)
              for a in model.attention_layers()]
    md = AttentionMetadataBuilder().build(
        num_reqs=2, num_actual_tokens=9,
        query_start_loc=torch.tensor([0, 6, 9], dtype=torch.int32),
        seq_lens=torch.tensor([6, 3], dtype=torch.int32),
        block_table=torch.tensor([[5, 2], [7, 0]], dtype=torch.int32),
        slot_mapping=torch.tensor([20, 21, 22, 23, 8, 9, 28, 29, 30]),
        max_query_len=6, max_seq_len=6,
    )
    ids = torch.tensor([3, 4, 5, 6, 7, 8, 50, 51, 52])
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2])
    with torch.no_grad():
        logits = model.compute_logits(model.forward(ids, positions, ForwardContext(md, caches)))
    return logits, caches

want, want_caches = run("torch")
got, got_caches = run("triton")
for a, b in zip(want_caches, got_caches):
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
diff = (want - got).abs().max().item()
print(diff)
assert diff < 1e-4, diff
"""


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_triton_backend_fp8_cache_matches_torch_backend(
    tiny_checkpoint: Callable[..., Path], dtype: str
) -> None:
    path = tiny_checkpoint("llama")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(path), dtype],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_nodes_with_other_cache_dtypes_are_refused(tiny_checkpoint: Callable[..., Path]) -> None:
    from paged.runner.executor.node_wire import Fingerprint

    model = ModelConfig.from_pretrained(str(tiny_checkpoint("llama")), max_model_len=64)

    def of(name: str) -> Fingerprint:
        return Fingerprint.of(
            EngineConfig(model_config=model, cache_config=CacheConfig(cache_dtype=name))
        )

    assert of("fp8").differences(of("auto")) == ["kv_cache_dtype: 'fp8' here vs 'auto' there"]
    assert of("fp8").differences(of("fp8")) == []
