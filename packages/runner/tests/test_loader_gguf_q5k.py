"""A tiny random Llama GGUF in Q5_K_M's types (Q5_K, Q6_K v / down), loaded quantised.

Q5_K rows take the C kernel's FMT_Q5K at the file's 5.5 bits a weight, exact: no
"re-quantised" in the load log, the weight error against the checkpoint 0, and the
greedy tokens of the quantised model equal those of its float32 (dequantised) path.
gguf-py cannot quantise K-quants, so the blocks are random bytes with sane f16 scales.
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
from paged.runner.cpu_kernels.packing_native import FMT_Q5K
from paged.runner.layers.linear import ShardedLinear
from paged.runner.layers.quantized_linear import QGemmMatmul, RowSplitMatmul
from paged.runner.loader import load_model

Q = gguf.GGMLQuantizationType
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS, VOCAB = 256, 4, 2, 64, 512, 2, 128
# llama.cpp's Q5_K_M: Q5_K everywhere but attn_v and ffn_down (Q6_K in these layers)
TYPES = {"attn_q": Q.Q5_K, "attn_k": Q.Q5_K, "attn_v": Q.Q6_K, "attn_output": Q.Q5_K,
         "ffn_gate": Q.Q5_K, "ffn_up": Q.Q5_K, "ffn_down": Q.Q6_K}  # fmt: skip
SHAPES = {  # [out, in]
    "attn_q": (HEADS * HEAD_DIM, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
    "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HEADS * HEAD_DIM),
    "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN), "ffn_down": (HIDDEN, INTER),
}  # fmt: skip


def k_quant_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes] random K-quant blocks whose weights are about cols ** -0.5."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    if qtype == Q.Q5_K:  # w = d sc q - dmin m: sc, m < 64, q < 32
        d = rng.uniform(0.5, 1.0, (data.shape[0], 2)) * cols**-0.5 / (32 * 32)
        data[:, 0:4] = d.astype(np.float16).view(np.uint8)
    else:  # Q6_K: w = d sc (q - 32), sc int8
        d = rng.uniform(0.5, 1.0, (data.shape[0], 1)) * cols**-0.5 / (32 * 64)
        data[:, -2:] = d.astype(np.float16).view(np.uint8)
    return data.reshape(rows, -1)


def write_tiny_llama_q5k(path: Path) -> Path:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>" for i in range(VOCAB)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    embedding = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)
    w.add_tensor("token_embd.weight", gguf.quants.quantize(embedding, Q.Q8_0), raw_dtype=Q.Q8_0)
    head = k_quant_blocks(Q.Q5_K, VOCAB, HIDDEN, rng)
    w.add_tensor("output.weight", head, raw_dtype=Q.Q5_K)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    for i in range(LAYERS):
        for kind, qtype in TYPES.items():
            rows, cols = SHAPES[kind]
            blocks = k_quant_blocks(qtype, rows, cols, rng)
            w.add_tensor(f"blk.{i}.{kind}.weight", blocks, raw_dtype=qtype)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(HIDDEN, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        hidden = model.forward(torch.tensor(ids), torch.arange(len(ids)), ForwardContext(None))
        logits: torch.Tensor = model.compute_logits(hidden)
        return logits.float()


def test_q5_k_m_gguf_loads_at_its_own_bytes_and_greedy_follows_the_float32_path(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_tiny_llama_q5k(tmp_path / "tiny-llama-q5_k_m.gguf")
    config = ModelConfig.from_pretrained(str(path), max_model_len=64)
    assert config.quantization == "gguf"
    with caplog.at_level(logging.DEBUG, logger="paged.runner.loader.quantized"):
        model: Any = load_model(config, "cpu")
    log = [r.getMessage() for r in caplog.records if r.getMessage().startswith("quantized")]
    assert log and not any("re-quantised" in line for line in log), log
    kernels = [m.quant for m in model.modules() if isinstance(m, ShardedLinear)]
    gemms = [
        k.gemm
        for kernel in kernels
        for k in (kernel.parts if isinstance(kernel, RowSplitMatmul) else [kernel])
        if isinstance(k, QGemmMatmul)
    ]
    # q/k (Q5_K) and v (Q6_K) of each qkv split by rows; o, gate_up: Q5_K
    assert sum(g.fmt == FMT_Q5K for g in gemms) == 3 * LAYERS, [g.fmt for g in gemms]
    reference: Any = load_model(
        ModelConfig.from_pretrained(str(path), max_model_len=64, dtype="float32"), "cpu"
    )
    ids = [1, 17, 99, 5, 64, 23, 81, 40, 12, 7, 3, 110]
    got, want = _logits(model, ids), _logits(reference, ids)
    # bf16 activations and the kernel's int8 activation groups; the weights are exact
    assert float((got - want).norm() / want.norm()) < 2e-2
    assert torch.equal(got.argmax(-1), want.argmax(-1))
