"""ModelConfig / CacheConfig / ParallelConfig / EngineConfig: resolution and bad input."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from paged.runner.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerLimits,
    default_model_path,
    resolve_dtype,
)


def test_hf_directory_resolves(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("qwen2")
    cfg = ModelConfig.from_pretrained(str(path))
    assert cfg.architecture == "Qwen2ForCausalLM"
    assert cfg.weights_format == "safetensors"
    assert cfg.dtype == torch.float32
    assert cfg.dtype_name == "float32"
    assert cfg.max_model_len == 256
    assert cfg.vocab_size == 128
    assert cfg.eos_token_ids == (2,)
    assert cfg.tokenizer == str(path)
    assert cfg.gguf_file is None
    assert cfg.weights_path == path
    assert cfg.num_hidden_layers == 2


def test_generation_config_eos_list_wins(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("llama")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    cfg = ModelConfig.from_pretrained(str(path), dtype="bf16", max_model_len=100)
    assert cfg.eos_token_ids == (2, 5)
    assert cfg.dtype == torch.bfloat16
    assert cfg.max_model_len == 100


def test_default_model_is_the_smollm2_gguf() -> None:
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    cfg = ModelConfig.from_pretrained(None)
    assert cfg.weights_format == "gguf"
    assert cfg.architecture == "LlamaForCausalLM"
    assert cfg.gguf_file == path.name
    assert cfg.weights_path == path
    assert cfg.vocab_size == 49152
    assert cfg.max_model_len == 8192
    assert cfg.eos_token_ids == (2,)
    hf = cfg.hf_config
    assert (hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads) == (576, 30, 9)
    assert (hf.num_key_value_heads, hf.head_dim, hf.intermediate_size) == (3, 64, 1536)
    assert hf.tie_word_embeddings is True
    assert hf.rope_parameters["rope_theta"] == 100000.0


def _write(path: Path) -> Path:
    path.write_bytes(b"x")
    return path


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "missing", "does not exist"),
        (lambda p: p, "has no config.json"),
        (lambda p: _write(p / "w.bin"), "not a .gguf"),
    ],
)
def test_bad_paths(tmp_path: Path, make: Callable[[Path], Path], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_pretrained(str(make(tmp_path)))


def test_directory_without_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    )
    with pytest.raises(ValueError, match=r"no \*\.safetensors weights"):
        ModelConfig.from_pretrained(str(tmp_path))


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*not supported.*LlamaForCausalLM"):
        ModelConfig.from_pretrained(str(tmp_path))


def test_broken_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_pretrained(str(tmp_path))


def test_truncated_gguf(tmp_path: Path) -> None:
    data = default_model_path().read_bytes()[:4096]
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        ModelConfig.from_pretrained(str(bad))


def test_max_model_len_bounds(tiny_checkpoint: Callable[..., Path]) -> None:
    path = str(tiny_checkpoint("llama"))
    with pytest.raises(ValueError, match="max_model_len: 1000 exceeds"):
        ModelConfig.from_pretrained(path, max_model_len=1000)
    with pytest.raises(ValueError, match="max_model_len: must be positive"):
        ModelConfig.from_pretrained(path, max_model_len=0)


def test_dtype_resolution() -> None:
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("float16", "cpu") == torch.float16
    assert resolve_dtype(torch.bfloat16, "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="dtype: 'int8' is not supported"):
        resolve_dtype("int8", "cpu")
    with pytest.raises(ValueError, match=r"dtype: torch\.int32 is not supported"):
        resolve_dtype(torch.int32, "cpu")
    with pytest.raises(ValueError, match="device: 'mps' is not supported"):
        resolve_dtype("auto", "mps")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_dtype("auto", "cuda")


def test_cache_parallel_scheduler_validation() -> None:
    assert CacheConfig().block_size == 16
    with pytest.raises(ValueError, match="block_size"):
        CacheConfig(block_size=0)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        CacheConfig(kv_cache_memory_bytes=-1)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=1.5)
    assert ParallelConfig().executor_backend == "uni"
    assert ParallelConfig(tensor_parallel_size=2).executor_backend == "mp"
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ParallelConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="'uni' runs one worker"):
        ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerLimits(max_num_seqs=0)
    ray = ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="ray")
    assert ray.executor_backend == "ray" and ray.ray_placement_strategy == "PACK"
    with pytest.raises(ValueError, match="distributed_executor_backend: 'slurm' is unknown"):
        ParallelConfig(distributed_executor_backend="slurm")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ray_placement_strategy: 'RANDOM' is unknown"):
        ParallelConfig(ray_placement_strategy="RANDOM")  # type: ignore[arg-type]


def test_engine_config_checks(tiny_checkpoint: Callable[..., Path]) -> None:
    mc = ModelConfig.from_pretrained(str(tiny_checkpoint("llama")))
    EngineConfig(mc, parallel_config=ParallelConfig(tensor_parallel_size=2))
    # 3 ranks over 4 q heads / 2 KV heads is a valid uneven head split
    # (layers/head_partition.py); the MLP still needs an even split.
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 3 does not divide.*intermediate"):
        EngineConfig(mc, parallel_config=ParallelConfig(tensor_parallel_size=3))
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 8 is more than .* 4 attention"):
        EngineConfig(mc, parallel_config=ParallelConfig(tensor_parallel_size=8))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(
            mc,
            scheduler_limits=SchedulerLimits(
                max_num_batched_tokens=64, enable_chunked_prefill=False
            ),
        )


def test_quantized_gguf_defaults_to_kept_quantized_bfloat16_on_cpu() -> None:
    cfg = ModelConfig.from_pretrained(None)
    assert (cfg.quantization, cfg.dtype, cfg.keeps_weights_quantized) == (
        "gguf",
        torch.bfloat16,
        True,
    )
    explicit = ModelConfig.from_pretrained(None, dtype="bfloat16", quantization="gguf")
    assert (explicit.quantization, explicit.dtype) == ("gguf", torch.bfloat16)
    # An explicit float dtype without --quantization is the dequantised reference path.
    fp32 = ModelConfig.from_pretrained(None, dtype="float32")
    assert (fp32.quantization, fp32.dtype, fp32.keeps_weights_quantized) == (
        None,
        torch.float32,
        False,
    )


def test_quantization_errors_name_the_argument(tiny_checkpoint: Callable[..., Path]) -> None:
    with pytest.raises(ValueError, match="quantization: 'awq' is not supported"):
        ModelConfig.from_pretrained(None, quantization="awq")
    with pytest.raises(ValueError, match="dtype: quantized GGUF weights on CPU run with bfloat16"):
        ModelConfig.from_pretrained(None, dtype="float32", quantization="gguf")
    path = tiny_checkpoint("llama")
    with pytest.raises(ValueError, match="quantization: 'gguf' needs a GGUF file"):
        ModelConfig.from_pretrained(str(path), quantization="gguf")
