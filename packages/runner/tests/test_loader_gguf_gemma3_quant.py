"""A tiny random Gemma 3 GGUF with the fallback types of Gemma 3 270M Q4_K_M, loaded quantised.

Gemma 3 270M's hidden size (640) is not a multiple of 256, so llama.cpp's Q4_K_M stores
the projections reading the hidden state as Q5_0 (and some v / down as Q8_0 / Q6_K).
The file written here uses the types whose mapping this test pins: Q5_0 (exact int8
groups of 32), Q8_0 (exact), Q5_1 (no exact kernel form: re-quantised to int8 groups of
32, the error logged) and Q4_0, beside F32 norms stored as 1 + w, as llama.cpp writes them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from paged.runner.attention.metadata import ForwardContext
from paged.runner.config import ModelConfig
from paged.runner.cpu_kernels.build import ISA_ENV
from paged.runner.layers.linear import ShardedLinear
from paged.runner.layers.quantized_linear import Int8GroupMatmul, QGemmMatmul, RowSplitMatmul
from paged.runner.loader import load_model

Q = gguf.GGMLQuantizationType
HIDDEN, HEADS, HEAD_DIM, INTER, LAYERS, VOCAB = 64, 4, 64, 256, 2, 128

# Per-layer GGUF tensor types (llama.cpp names): layer 1 has the re-quantised Q5_1 rows.
TYPES: list[dict[str, Q]] = [
    {"attn_q": Q.Q5_0, "attn_k": Q.Q5_0, "attn_v": Q.Q8_0, "attn_output": Q.Q4_0,
     "ffn_gate": Q.Q5_0, "ffn_up": Q.Q5_0, "ffn_down": Q.Q8_0},
    {"attn_q": Q.Q5_0, "attn_k": Q.Q5_0, "attn_v": Q.Q5_1, "attn_output": Q.Q4_0,
     "ffn_gate": Q.Q5_0, "ffn_up": Q.Q5_0, "ffn_down": Q.Q5_1},
]  # fmt: skip
SHAPES = {  # [out, in] (Hugging Face layout)
    "attn_q": (HEADS * HEAD_DIM, HIDDEN), "attn_k": (HEAD_DIM, HIDDEN),
    "attn_v": (HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HEADS * HEAD_DIM),
    "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN), "ffn_down": (HIDDEN, INTER),
}  # fmt: skip
NORMS = {"attn_norm": HIDDEN, "post_attention_norm": HIDDEN, "ffn_norm": HIDDEN,
         "post_ffw_norm": HIDDEN, "attn_q_norm": HEAD_DIM, "attn_k_norm": HEAD_DIM}  # fmt: skip


def write_tiny_gemma3(path: Path) -> Path:
    """A 2-layer Gemma 3 GGUF (1 KV head, head_dim 64, sliding window 8) of random weights."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(1)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1_000_000.0)
    w.add_sliding_window(8)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>" for i in range(VOCAB)])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)

    def quantised(name: str, shape: tuple[int, int], qtype: Q, scale: float) -> None:
        weight = (rng.standard_normal(shape) * scale).astype(np.float32)
        w.add_tensor(name, gguf.quants.quantize(weight, qtype), raw_dtype=qtype)

    def norm(name: str, size: int) -> None:  # llama.cpp stores Gemma's norms as 1 + w
        w.add_tensor(name, (1.0 + rng.standard_normal(size) * 0.3).astype(np.float32))

    quantised("token_embd.weight", (VOCAB, HIDDEN), Q.Q8_0, 1.0)
    norm("output_norm.weight", HIDDEN)
    for i, types in enumerate(TYPES):
        for kind, qtype in types.items():
            rows, cols = SHAPES[kind]
            quantised(f"blk.{i}.{kind}.weight", (rows, cols), qtype, cols**-0.5)
        for kind, size in NORMS.items():
            norm(f"blk.{i}.{kind}.weight", size)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gemma3(tmp_path_factory.mktemp("gemma3q") / "tiny-gemma3.gguf")


def _logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        hidden = model.forward(torch.tensor(ids), torch.arange(len(ids)), ForwardContext(None))
        logits: torch.Tensor = model.compute_logits(hidden)
        return logits.float()


def _projections(model: Any) -> dict[str, Any]:
    return {n: m.quant for n, m in model.named_modules() if isinstance(m, ShardedLinear)}


@pytest.mark.parametrize("backend", ["qgemm", "torch"])
def test_tiny_gemma3_gguf_loads_quantised_and_follows_its_float32_path(
    tiny: Path, backend: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    if backend == "torch":
        monkeypatch.setenv(ISA_ENV, "off")
    quant_config = ModelConfig.from_pretrained(str(tiny), max_model_len=64)
    assert (quant_config.quantization, quant_config.dtype) == ("gguf", torch.bfloat16)
    # The per-kind lines are DEBUG (one INFO summary line is what `paged generate` shows).
    with caplog.at_level(logging.DEBUG, logger="paged.runner.loader.quantized"):
        model: Any = load_model(quant_config, "cpu")
    log = [r.getMessage() for r in caplog.records if r.getMessage().startswith("quantized")]
    # Layer 0's qkv (Q5_0 q/k, Q8_0 v) is exact; layer 1's carries its re-quantised Q5_1 v.
    qkv_exact = next(line for line in log if "qkv_proj x1: Q5_0+Q8_0 ->" in line)
    qkv_requant = next(line for line in log if "qkv_proj x1: Q5_0+Q5_1 ->" in line)
    assert "re-quantised" not in qkv_exact
    assert "Q5_1 re-quantised to int8 groups of 32" in qkv_requant
    assert "error vs the checkpoint 0.00e+00" not in qkv_requant
    if backend == "qgemm":  # torch's kernels round the scales to bf16: never 0 there
        assert "error vs the checkpoint 0.00e+00" in qkv_exact
    assert any("gate_up_proj x2: Q5_0 ->" in line and "re-quantised" not in line for line in log)
    kernels = _projections(model)
    if backend == "qgemm":
        # Every projection on the C kernel (one 8-bit table per qkv: Q5_0 and Q8_0/Q5_1
        # rows share the int8-groups form): every layer qualifies for the fused path.
        assert all(isinstance(k, QGemmMatmul) for k in kernels.values()), kernels
        assert all(layer.fused_spec() is not None for layer in model.model.layers)
    else:  # torch's kernels: the int8 groups run as two int4 passes, exact codes
        assert isinstance(kernels["model.layers.0.self_attn.qkv_proj"], Int8GroupMatmul)
        assert not any(isinstance(k, RowSplitMatmul) for k in kernels.values())
    reference: Any = load_model(
        ModelConfig.from_pretrained(str(tiny), max_model_len=64, dtype="float32"), "cpu"
    )
    ids = [2, 17, 99, 5, 64, 23, 81, 40, 12, 7, 3, 110]  # longer than the sliding window
    got, want = _logits(model, ids), _logits(reference, ids)
    # bf16 activations (and the C kernel's int8 activation groups), the re-quantised
    # Q5_1 rows: measured 4.7e-3 on the C kernel, 3.7e-3 on torch's kernels.
    assert float((got - want).norm() / want.norm()) < 2e-2
    assert torch.equal(got.argmax(-1), want.argmax(-1))
