"""Weights from a GGUF file: llama.cpp tensor names -> Hugging Face names, dequantised.

    token_embd            model.embed_tokens
    blk.N.attn_norm       model.layers.N.input_layernorm
    blk.N.attn_q/k/v      model.layers.N.self_attn.q_proj / k_proj / v_proj
    blk.N.attn_q/k_norm   model.layers.N.self_attn.q_norm / k_norm        (Qwen3)
    blk.N.attn_output     model.layers.N.self_attn.o_proj
    blk.N.ffn_norm        model.layers.N.post_attention_layernorm
    blk.N.ffn_gate/up/down model.layers.N.mlp.gate_proj / up_proj / down_proj
    output_norm           model.norm
    output                lm_head (absent when tied)

gemma3 files name the four sandwich norms differently (attn_norm, post_attention_norm,
ffn_norm = *pre*-feed-forward, post_ffw_norm) and store Gemma's norm weights as
1 + w (llama.cpp adds the 1); they are turned back into HF's w here, as
transformers does, and GemmaRMSNorm adds the 1 again.

Quantised tensors (Q4_0, Q4_1, Q8_0, K-quants, ...) are dequantised to float32
with the `gguf` package, then cast to the model dtype when copied in; with
`keep_quantized` they are yielded as `GGUFQuantizedTensor` blocks instead
(loader/gguf_quant.py), for layers staging a quantised load.

llama.cpp's converter permutes the rows of Q and K of "llama" checkpoints so
that its GPT-J-style (interleaved) rotary applies; paged rotates NeoX-style
like Hugging Face, so the permutation is undone here, per head:
rows (head, 2, half) were written as (head, half, 2).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from paged.runner.loader.gguf_config import LLAMA_CPP_RANK_TENSORS, field_value, open_gguf
from paged.runner.loader.gguf_quant import GGUFQuantizedTensor

_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def is_quantized_type(tensor_type: Any) -> bool:
    """Whether a GGUF tensor type is a block-quantised one (not F32/F16/BF16/F64)."""
    return str(getattr(tensor_type, "name", tensor_type)) not in _FLOAT_TYPES


_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_PER_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Per-architecture overrides of _PER_LAYER.
_ARCH_PER_LAYER: dict[str, dict[str, str]] = {
    "gemma3": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")


def gguf_to_hf_name(name: str, arch: str = "llama") -> str:
    """The Hugging Face name of a GGUF tensor (ValueError for names paged does not map)."""
    per_layer = {**_PER_LAYER, **_ARCH_PER_LAYER.get(arch, {})}
    m = _LAYER_RE.match(name)
    if m and m.group(2) in per_layer:
        return f"model.layers.{m.group(1)}.{per_layer[m.group(2)]}.{m.group(3)}"
    m = _GLOBAL_RE.match(name)
    if m and m.group(1) in _GLOBAL:
        return f"{_GLOBAL[m.group(1)]}.{m.group(2)}"
    if name == "rope_freqs.weight":
        raise ValueError(
            "model: this GGUF stores Llama 3.1 rope frequency factors (rope_freqs), which paged "
            "does not read; use the Hugging Face checkpoint of this model instead"
        )
    raise ValueError(f"model: GGUF tensor {name!r} has no known Hugging Face equivalent")


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head Q/K row permutation (see the module docstring)."""
    rows = weight.shape[0]
    if rows % (2 * num_heads) != 0:
        raise ValueError(f"Q/K tensor with {rows} rows cannot hold {num_heads} heads")
    half = rows // num_heads // 2
    w = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return w.transpose(1, 2).reshape(weight.shape)


def dequantize(tensor: Any) -> torch.Tensor:
    """A GGUF ReaderTensor as a float32 torch tensor in HF layout ([out, in])."""
    array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    # GGUF lists dims fastest-first; numpy/torch want slowest-first.
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    array = np.ascontiguousarray(array, dtype=np.float32).reshape(shape)
    if not array.flags.writeable:
        # Unquantised tensors come back as views of the read-only memory map.
        array = array.copy()
    return torch.from_numpy(array)


def iterate_gguf(
    path: Path, *, keep_quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor | GGUFQuantizedTensor]]:
    """Yield (HF tensor name, float32 CPU tensor) for every tensor of a GGUF file.

    keep_quantized: 2-D quantised tensors come as GGUFQuantizedTensor blocks.
    """
    reader = open_gguf(path)
    arch = field_value(reader, "general.architecture")
    num_heads = field_value(reader, f"{arch}.attention.head_count")
    num_kv_heads = field_value(reader, f"{arch}.attention.head_count_kv") or num_heads
    for tensor in reader.tensors:
        if tensor.name in LLAMA_CPP_RANK_TENSORS:
            continue  # a reranker's head: the pooler reads it (loader/gguf_rank.py)
        hf_name = gguf_to_hf_name(tensor.name, str(arch))
        weight: torch.Tensor | GGUFQuantizedTensor
        try:
            if keep_quantized and is_quantized_type(tensor.tensor_type) and len(tensor.shape) == 2:
                cols, rows = (int(d) for d in tensor.shape.tolist())
                weight = GGUFQuantizedTensor(
                    tensor.data, tensor.tensor_type, cols, rows=rows, name=tensor.name
                )
            else:
                weight = dequantize(tensor)
        except Exception as exc:  # gguf/numpy raise assorted errors on short data
            raise ValueError(
                f"model: GGUF tensor {tensor.name!r} in {str(path)!r} cannot be decoded "
                f"({type(exc).__name__}: {exc}); the file is truncated or corrupt"
            ) from exc
        if arch == "llama" and ".self_attn.q_proj." in hf_name:
            weight = _unpermute(weight, int(num_heads))
        elif arch == "llama" and ".self_attn.k_proj." in hf_name:
            weight = _unpermute(weight, int(num_kv_heads))
        elif (
            arch == "gemma3"
            and hf_name.endswith("norm.weight")
            and isinstance(weight, torch.Tensor)  # norms are 1-D: never kept quantized
        ):
            weight = weight - 1.0  # llama.cpp stored 1 + w (module docstring)
        yield hf_name, weight


def _unpermute(
    weight: torch.Tensor | GGUFQuantizedTensor, num_heads: int
) -> torch.Tensor | GGUFQuantizedTensor:
    if isinstance(weight, torch.Tensor):
        return unpermute_qk(weight, num_heads)
    # Rows are independent blocks: permute them by the same index.
    return weight.permute_rows(unpermute_qk(torch.arange(weight.shape[0]), num_heads))
