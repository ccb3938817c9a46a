"""LoRA on the quantised CPU path: the default GGUF model (weights kept quantised, bfloat16).

The reference is the same GGUF dequantised to float32 (`dtype="float32"`)
with the adapters in float32. Base rows and two random adapters share the
steps (chunked prefill); tokens must agree within the quantised path's
documented agreement (test_quantized_engine.py: a divergence is only allowed
at a near-tie, the chosen token in the reference's top 2 within 0.25 nats).
Steps with LoRA rows take the per-op path (the fused C layers skip module
forwards; packages/runner/tests/test_lora_manager.py checks the switch).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from paged.kvcache import get_kv_cache_config
from paged.runner.config import CacheConfig, EngineConfig, ModelConfig, SchedulerLimits
from paged.runner.executor import UniProcExecutor
from paged.runner.lora.config import LoRAConfig
from paged.scheduler.boundary import EngineCoreRequest
from paged.scheduler.config import SchedulerConfig
from paged.scheduler.sampling_params import SamplingParams
from paged.scheduler.scheduler import Scheduler

pytestmark = pytest.mark.slow

BLOCK = 16
MAX_LEN = 128
N = 12
Result = dict[str, tuple[list[int], list[dict[int, float]]]]


def random_adapter(path: Path, cfg: ModelConfig, rank: int, seed: int, targets: list[str]) -> str:
    """A PEFT-format adapter for every layer of the default model (B != 0)."""
    hf = cfg.text_config
    hidden, inter = int(hf.hidden_size), int(hf.intermediate_size)
    head = hidden // int(hf.num_attention_heads)
    kv = int(hf.num_key_value_heads) * head
    dims = {
        "q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
        "o_proj": (hidden, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(int(hf.num_hidden_layers)):
        for name in targets:
            part = "self_attn" if name[0] in "qkvo" else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            n_in, n_out = dims[name]
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) / n_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * 0.05
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"r": rank, "lora_alpha": 2 * rank, "target_modules": targets}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return str(path)


def run(
    cfg: ModelConfig, jobs: dict[str, tuple[str | None, list[int]]], paths: dict[str, str]
) -> Result:
    config = EngineConfig(
        model_config=cfg,
        cache_config=CacheConfig(block_size=BLOCK, kv_cache_memory_bytes=64 << 20),
        scheduler_limits=SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=32),
        lora_config=LoRAConfig(max_loras=2, max_lora_rank=8),
    )
    out: Result = {rid: ([], []) for rid in jobs}
    with UniProcExecutor(config) as executor:
        kv = get_kv_cache_config(
            executor.get_kv_cache_specs(),
            executor.determine_available_memory(),
            num_gpu_blocks_override=64,
        )
        executor.initialize_from_config(kv)
        scheduler = Scheduler(
            SchedulerConfig(max_model_len=MAX_LEN, max_num_seqs=8, max_num_batched_tokens=32),
            kv,
            BLOCK,
        )
        params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, logprobs=2)
        for i, (rid, (name, prompt)) in enumerate(jobs.items()):
            path = paths[name] if name is not None else None
            scheduler.add_request(
                EngineCoreRequest(
                    rid, prompt, params, None, float(i), lora_request=name, lora_path=path
                )
            )
        while scheduler.has_requests():
            so = scheduler.schedule()
            result = executor.execute_model(so)
            if result is None:
                result = executor.sample_tokens(None)
            for outputs in scheduler.update_from_output(so, result).values():
                for o in outputs.outputs:
                    out[o.request_id][0].extend(o.new_token_ids)
                    assert o.new_logprobs is not None
                    for ids, lps in zip(
                        o.new_logprobs.token_ids, o.new_logprobs.logprobs, strict=True
                    ):
                        out[o.request_id][1].append(dict(zip(ids, lps, strict=True)))
    return out


def test_quantized_base_with_adapters_agrees_with_float32(tmp_path: Path) -> None:
    quant = ModelConfig.from_pretrained(None, max_model_len=MAX_LEN)
    assert quant.keeps_weights_quantized and quant.dtype == torch.bfloat16
    exact = ModelConfig.from_pretrained(None, dtype="float32", max_model_len=MAX_LEN)
    paths = {
        "attn": random_adapter(tmp_path / "attn", quant, 8, 1, ["q_proj", "v_proj", "o_proj"]),
        "mlp": random_adapter(tmp_path / "mlp", quant, 4, 2, ["gate_proj", "up_proj", "down_proj"]),
    }
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 20000) for _ in range(n)] for n in (40, 23, 31)]
    jobs: dict[str, tuple[str | None, list[int]]] = {
        "base": (None, prompts[0]),
        "attn": ("attn", prompts[0]),
        "mlp": ("mlp", prompts[1]),
        "attn2": ("attn", prompts[2]),
    }
    reference = run(exact, jobs, paths)
    got = run(quant, jobs, paths)
    assert reference["attn"][0] != reference["base"][0], "the adapter must change the tokens"
    identical = 0
    for rid, (ref_tokens, ref_lps) in reference.items():
        tokens = got[rid][0]
        first = next(
            (i for i, (a, b) in enumerate(zip(ref_tokens, tokens, strict=True)) if a != b), None
        )
        if first is None:
            identical += 1
            continue
        top = ref_lps[first]
        assert tokens[first] in top, f"{rid} token {first}: {tokens[first]} not in the top 2"
        gap = top[ref_tokens[first]] - top[tokens[first]]
        assert gap < 0.25, f"{rid} token {first}: diverged with a {gap:.3f} nat margin"
    assert identical >= 2
