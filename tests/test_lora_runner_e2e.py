"""LoRA through the scheduler + executor + runner, against transformers + peft (fp32).

Tiny random Llama and Gemma 3 text checkpoints, four random PEFT adapters
(init_lora_weights=False so B != 0: different ranks, one rsLoRA, one with
q/v only, one with a per-module rank_pattern) and base requests, all in one
batch, under chunked prefill, preemption (few KV blocks) and prefix-cache
hits (the same prompt under several adapters and twice under one). Every
request's greedy tokens and their logprobs must equal transformers + peft for
its own adapter.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from paged.kvcache import get_kv_cache_config
from paged.runner.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerLimits,
)
from paged.runner.executor import Executor, MultiprocExecutor, UniProcExecutor
from paged.runner.lora.config import LoRAAdapterSpec, LoRAConfig
from paged.scheduler.boundary import EngineCoreRequest
from paged.scheduler.config import SchedulerConfig
from paged.scheduler.sampling_params import SamplingParams
from paged.scheduler.scheduler import Scheduler

# peft 0.18 reads transformers' deprecated alias (a FutureWarning, an error under filterwarnings).
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")

BLOCK = 4
MAX_LEN = 96
# llama.cpp's converter (benchmarks/build_llamacpp.sh puts it here; LLAMA_CPP_DIR overrides).
CONVERTER = (
    Path(os.environ.get("LLAMA_CPP_DIR", "/work/llamacpp-build/src/vendor/llama.cpp"))
    / "convert_lora_to_gguf.py"
)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> LoraConfig keywords (peft)
ADAPTERS: dict[str, dict[str, Any]] = {
    "r8": {"r": 8, "lora_alpha": 16, "target_modules": ALL},
    "rs16": {"r": 16, "lora_alpha": 8, "use_rslora": True, "target_modules": ALL},
    "qv4": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    "pat2": {
        "r": 2,
        "lora_alpha": 4,
        "target_modules": ["o_proj", "down_proj", "gate_proj", "k_proj"],
        "rank_pattern": {"down_proj": 6},
        "alpha_pattern": {"o_proj": 10},
    },
}


def _llama(path: Path, **overrides: Any) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    kwargs: dict[str, Any] = {
        "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
    }  # fmt: skip
    config = LlamaConfig(**{**kwargs, **overrides})
    torch.manual_seed(0)
    model: Any = LlamaForCausalLM(config)
    model = model.float()
    model.save_pretrained(str(path))
    return path


def _gemma3(path: Path) -> Path:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        query_pre_attn_scalar=24, sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        bos_token_id=2, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    config.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(0)
    model: Any = Gemma3ForCausalLM(config)
    model = model.float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.randn_like(param) * 0.3)
    model.save_pretrained(str(path))
    return path


def _hf_base(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    auto: Any = AutoModelForCausalLM
    return auto.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()


def _save_peft(base: Path, out: Path, kwargs: dict[str, Any]) -> None:
    from peft import LoraConfig, get_peft_model

    peft_model: Any = get_peft_model(_hf_base(base), LoraConfig(init_lora_weights=False, **kwargs))
    with torch.no_grad():  # PEFT's random B is small; make the deltas count
        for pname, param in peft_model.named_parameters():
            if "lora_B" in pname:
                param.mul_(20.0)
    peft_model.save_pretrained(str(out))


def to_gguf(base: Path, adapter: Path, out: Path) -> Path:
    subprocess.run(
        [sys.executable, str(CONVERTER), "--base", str(base), "--outtype", "f32",
         "--outfile", str(out), str(adapter)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return out


def make_adapters(base: Path, out: Path) -> dict[str, Path]:
    """Random PEFT adapters of `base` saved under `out` (B != 0)."""
    dirs = {}
    for i, (name, kwargs) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + i)
        dirs[name] = out / name
        _save_peft(base, dirs[name], kwargs)
    return dirs


def hf_greedy(model: Any, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            token = int(logits.argmax())
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            ids.append(token)
    return ids[len(prompt) :], logprobs


def hf_reference(
    base: Path, adapters: dict[str, Path], jobs: dict[str, tuple[str | None, list[int]]], n: int
) -> dict[str, tuple[list[int], list[float]]]:
    from peft import PeftModel

    out = {}
    for rid, (adapter, prompt) in jobs.items():
        model = _hf_base(base)
        if adapter is not None:
            # a GGUF copy ("<name>.gguf") is checked against the PEFT adapter it came from
            peft_dir = adapters[adapter.removesuffix(".gguf")]
            model = PeftModel.from_pretrained(model, str(peft_dir)).eval()
        out[rid] = hf_greedy(model, prompt, n)
    return out


def paged_run(
    executor: Executor,
    jobs: dict[str, tuple[str | None, list[int]]],
    adapters: dict[str, Path],
    n: int,
    num_blocks: int,
) -> tuple[dict[str, tuple[list[int], list[float]]], int, dict[str, int]]:
    """The engine loop: each request's tokens and logprobs, the preemption count, and each
    request's prefix-cache hit (tokens, at its first output)."""
    kv = get_kv_cache_config(
        executor.get_kv_cache_specs(),
        executor.determine_available_memory(),
        num_gpu_blocks_override=num_blocks,
    )
    executor.initialize_from_config(kv)
    scheduler = Scheduler(
        SchedulerConfig(max_model_len=MAX_LEN, max_num_seqs=8, max_num_batched_tokens=24),
        kv,
        BLOCK,
    )
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)
    for i, (rid, (adapter, prompt)) in enumerate(jobs.items()):
        path = str(adapters[adapter]) if adapter is not None else None
        request = EngineCoreRequest(
            rid, prompt, params, None, float(i), lora_request=adapter, lora_path=path
        )
        scheduler.add_request(request)
    results: dict[str, tuple[list[int], list[float]]] = {rid: ([], []) for rid in jobs}
    preempted = 0
    cached: dict[str, int] = {}
    for _ in range(2000):
        if not scheduler.has_requests():
            break
        so = scheduler.schedule()
        preempted += len(so.preempted_req_ids)
        out = executor.execute_model(so)
        if out is None:
            out = executor.sample_tokens(None)
        for outputs in scheduler.update_from_output(so, out).values():
            for o in outputs.outputs:
                results[o.request_id][0].extend(o.new_token_ids)
                cached.setdefault(o.request_id, o.num_cached_tokens)
                assert o.new_logprobs is not None
                results[o.request_id][1].extend(row[0] for row in o.new_logprobs.logprobs)
    return results, preempted, cached


def _jobs(seed: int) -> dict[str, tuple[str | None, list[int]]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 128) for _ in range(9)]
    own = [[rng.randrange(3, 128) for _ in range(k)] for k in (13, 5, 18, 7)]
    return {
        "base0": (None, shared + own[0]),
        "r8a": ("r8", shared + own[0]),  # same prompt as base0: no cross-adapter hit
        "r8b": ("r8", shared + own[0]),  # same prompt and adapter: a prefix-cache hit
        "rs16": ("rs16", shared + own[1]),
        "qv4": ("qv4", own[2]),
        "pat2": ("pat2", shared + own[3]),
        "base1": (None, own[1]),
    }


def engine_config(base: Path, tp: int = 1) -> EngineConfig:
    return EngineConfig(
        model_config=ModelConfig.from_pretrained(str(base), max_model_len=MAX_LEN),
        cache_config=CacheConfig(block_size=BLOCK, kv_cache_memory_bytes=1 << 20),
        scheduler_limits=SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=24),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        lora_config=LoRAConfig(
            max_loras=5, max_lora_rank=16, max_cpu_loras=5, lora_dtype="float32"
        ),
    )


def check_against(
    expected: dict[str, tuple[list[int], list[float]]],
    got: dict[str, tuple[list[int], list[float]]],
) -> None:
    for rid, (tokens, logprobs) in expected.items():
        assert got[rid][0] == tokens, rid
        close = [
            math.isclose(a, b, abs_tol=1e-4) for a, b in zip(got[rid][1], logprobs, strict=True)
        ]
        assert all(close), rid
    # the adapters change the output (else the comparison proves nothing)
    assert expected["r8a"] != expected["base0"]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_mixed_adapters_match_transformers_peft(tmp_path: Path, family: str) -> None:
    base = (_llama if family == "llama" else _gemma3)(tmp_path / "base")
    adapters = make_adapters(base, tmp_path / "adapters")
    jobs = _jobs(1)
    if family == "llama" and CONVERTER.is_file():
        # llama.cpp's GGUF LoRA of qv4 (q rows permuted in the file, undone on load)
        adapters["qv4.gguf"] = to_gguf(base, adapters["qv4"], tmp_path / "qv4.gguf")
        jobs["qv4g"] = ("qv4.gguf", jobs["qv4"][1][:11])
    n = 6
    expected = hf_reference(base, adapters, jobs, n)
    with UniProcExecutor(engine_config(base)) as executor:
        executor.add_lora(LoRAAdapterSpec("r8", str(adapters["r8"]), 1))
        assert executor.list_loras() == ["r8"]
        # the others load from each request's lora_path on first use
        got, preempted, cached = paged_run(executor, jobs, adapters, n, num_blocks=26)
        assert sorted(executor.list_loras()) == sorted({a for a, _ in jobs.values() if a})
    assert preempted > 0, "the run was meant to preempt"
    # prefix caching per adapter: r8b hits r8a's blocks; r8a, same prompt as base0, does not
    assert cached["r8b"] >= BLOCK and cached["r8a"] == 0
    check_against(expected, got)


@pytest.mark.slow  # two worker processes importing torch
def test_tensor_parallel_2_matches_transformers_peft(tmp_path: Path) -> None:
    """TP=2 over gloo (mp executor): adapters sharded like the base, row deltas before the sum."""
    base = _llama(tmp_path / "base")
    adapters = make_adapters(base, tmp_path / "adapters")
    jobs = _jobs(2)
    expected = hf_reference(base, adapters, jobs, 4)
    with MultiprocExecutor(engine_config(base, tp=2)) as executor:
        # add_lora reaches every worker; a refusal comes back as the worker's ValueError
        executor.add_lora(LoRAAdapterSpec("r8", str(adapters["r8"]), 1))
        with pytest.raises(ValueError, match="'r8' is already loaded"):
            executor.add_lora(LoRAAdapterSpec("r8", str(adapters["r8"]), 1))
        with pytest.raises(ValueError, match="does not exist"):
            executor.add_lora(LoRAAdapterSpec("bad", str(tmp_path / "nowhere"), 2))
        assert executor.list_loras() == ["r8"]
        got, _, _ = paged_run(executor, jobs, adapters, 4, num_blocks=64)
        assert executor.remove_lora("rs16") is True and executor.remove_lora("rs16") is False
    check_against(expected, got)
