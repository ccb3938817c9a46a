"""Gemma3ForCausalLM against transformers on a tiny random checkpoint built here.

The checkpoint mixes sliding and global layers (own rope bases), sets
query_pre_attn_scalar != head_dim, soft-caps scores and logits, and perturbs
every norm so Gemma's (1 + w) is exercised. Logits are compared through a
paged cache with chunked prefill; greedy tokens through the real scheduler
(two KV cache groups: full and sliding window).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from paged.kvcache import FullAttentionSpec, SlidingWindowSpec, get_kv_cache_config
from paged.runner.config import CacheConfig, EngineConfig, ModelConfig, SchedulerLimits
from paged.runner.executor import UniProcExecutor
from paged.runner.loader import load_model
from paged.scheduler.boundary import EngineCoreRequest
from paged.scheduler.config import SchedulerConfig
from paged.scheduler.sampling_params import SamplingParams
from paged.scheduler.scheduler import Scheduler

ATOL = 1e-4

TEXT_CONFIG: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 24,
    "sliding_window": 6,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    },
    "bos_token_id": 2,
    "eos_token_id": 1,
    "pad_token_id": 0,
}


def make_gemma3_text(path: Path, seed: int = 0, **overrides: Any) -> Path:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(**{**TEXT_CONFIG, **overrides})
    config.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(seed)
    model: Any = Gemma3ForCausalLM(config)
    model = model.float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.randn_like(param) * 0.3)
    model.save_pretrained(str(path))
    return path


def _hf(path: Path) -> Any:
    from transformers import Gemma3ForCausalLM

    hf: Any = Gemma3ForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    )
    return hf.eval()


def _hf_logits(hf: Any, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits: torch.Tensor = hf(torch.tensor([tokens]), use_cache=False).logits[0].float()
    return logits


@pytest.mark.parametrize(
    "overrides",
    [{}, {"final_logit_softcapping": 5.0}],
    ids=["plain", "final_softcap"],
)
def test_chunked_prefill_logits_match_hf(
    tmp_path: Path, make_driver: Any, overrides: dict[str, Any]
) -> None:
    path = make_gemma3_text(tmp_path / "g3", **overrides)
    model = load_model(ModelConfig.from_pretrained(str(path)), "cpu")
    hf = _hf(path)
    prompt = torch.randint(3, 128, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = _hf_logits(hf, prompt)
    driver = make_driver(model, block_size=4)
    driver.add("r", prompt)
    done = 0
    for chunk in (5, 1, 9, 8):  # chunks straddle blocks and the 6-token window
        logits = driver.step([("r", chunk)])
        done += chunk
        torch.testing.assert_close(logits[0], ref[done - 1], atol=ATOL, rtol=0)


def test_kv_cache_specs_follow_layer_types(tmp_path: Path) -> None:
    # transformers' Gemma3 stores attn_logit_softcapping but never applies it (real
    # Gemma 3 configs leave it None); paged applies it, like vLLM, in the kernel.
    path = make_gemma3_text(tmp_path / "g3", attn_logit_softcapping=3.0)
    model: Any = load_model(ModelConfig.from_pretrained(str(path)), "cpu")
    assert {a.logits_soft_cap for a in model.attention_layers()} == {3.0}
    specs = list(model.kv_cache_specs(4).values())
    assert [type(s) for s in specs] == [SlidingWindowSpec, FullAttentionSpec, SlidingWindowSpec]
    assert isinstance(specs[0], SlidingWindowSpec) and specs[0].sliding_window == 6


def test_scheduler_greedy_matches_hf(tmp_path: Path) -> None:
    """Real scheduler + executor, chunked prefill, two requests, sliding blocks freed."""
    path = make_gemma3_text(tmp_path / "g3", seed=3)
    hf = _hf(path)
    config = EngineConfig(
        model_config=ModelConfig.from_pretrained(str(path), max_model_len=128),
        cache_config=CacheConfig(block_size=4, kv_cache_memory_bytes=1 << 20),
        scheduler_limits=SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=7),
    )
    executor = UniProcExecutor(config)
    kv = get_kv_cache_config(
        executor.get_kv_cache_specs(), executor.determine_available_memory(),
        num_gpu_blocks_override=64,
    )  # fmt: skip
    # vLLM groups layers by spec in groups of equal size: here 1 full + 2 sliding = 3.
    spec_types = {type(g.kv_cache_spec) for g in kv.kv_cache_groups}
    assert spec_types == {FullAttentionSpec, SlidingWindowSpec}
    executor.initialize_from_config(kv)
    scheduler = Scheduler(
        SchedulerConfig(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=7), kv, 4
    )
    gen = torch.Generator().manual_seed(5)
    prompts = {f"r{i}": torch.randint(3, 128, (n,), generator=gen).tolist() for i, n in
               enumerate((17, 9))}  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i, (rid, prompt) in enumerate(prompts.items()):
        scheduler.add_request(EngineCoreRequest(rid, prompt, params, None, float(i)))
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    while scheduler.has_requests():
        so = scheduler.schedule()
        out = executor.execute_model(so)
        if out is None:
            out = executor.sample_tokens(None)
        for outputs in scheduler.update_from_output(so, out).values():
            for o in outputs.outputs:
                tokens[o.request_id].extend(o.new_token_ids)
    executor.shutdown()
    for rid, prompt in prompts.items():
        want = hf.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12
        )[0, len(prompt) :].tolist()
        assert tokens[rid] == want, rid
