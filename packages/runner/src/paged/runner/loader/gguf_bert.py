"""BERT-family GGUFs (llama.cpp's `bert` architecture): config, tensor names, rank head.

llama.cpp's converter (convert_hf_to_gguf.py, `conversion/bert.py`) writes BertModel,
RobertaModel, XLMRobertaModel and their *ForSequenceClassification as one
architecture, `bert`:

    token_embd              embeddings.word_embeddings
    position_embd           embeddings.position_embeddings   (RoBERTa / XLM-R: the
                            pad_token_id + 1 leading rows cut off, so positions are 0-based)
    token_types             embeddings.token_type_embeddings (optional)
    token_embd_norm         embeddings.LayerNorm
    blk.N.attn_q/k/v        encoder.layer.N.attention.self.query / key / value
    blk.N.attn_output       encoder.layer.N.attention.output.dense
    blk.N.attn_output_norm  encoder.layer.N.attention.output.LayerNorm
    blk.N.ffn_up / ffn_down encoder.layer.N.intermediate.dense / output.dense
    blk.N.layer_output_norm encoder.layer.N.output.LayerNorm
    cls, cls.output         the rank head (below), read by the pooler, not the body

Metadata: `bert.attention.layer_norm_epsilon`, `bert.attention.causal` (false),
`bert.pooling_type` (MEAN 1, CLS 2, LAST 3, RANK 4; only when the checkpoint had a
sentence-transformers Pooling module), `bert.classifier.output_labels` (a
*ForSequenceClassification's id2label); the token type count is the `token_types` rows.

The rank head as llama.cpp applies it (src/llama-graph.cpp, build_pooling, case
LLAMA_POOLING_TYPE_RANK): the CLS row, then `cls` + tanh when the file has it, then
`cls.output` when the file has it. A file holding either tensor, or declaring
pooling_type RANK, is a reranker / classifier here (`BertForSequenceClassification`);
llama.cpp itself needs `--reranking` for files without RANK, which is how its converter
writes bge-reranker-v2-m3 (`classifier.dense` -> cls, `classifier.out_proj` -> cls.output).
Its converter drops BertForSequenceClassification's `pooler.dense`, so such a file
scores as llama.cpp does (cls.output on the raw CLS state), not as transformers.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import torch

from paged.runner.loader.gguf_config import (
    ENCODER_GGUF_ARCHITECTURE,
    LLAMA_CPP_RANK_TENSORS,
    field_value,
)
from paged.runner.loader.gguf_file import GGUFFile
from paged.runner.loader.gguf_weights import dequantize

_POOLING_RANK = 4

_GLOBAL = {
    "token_embd": "embeddings.word_embeddings",
    "position_embd": "embeddings.position_embeddings",
    "token_types": "embeddings.token_type_embeddings",
    "token_embd_norm": "embeddings.LayerNorm",
}
_PER_LAYER = {
    "attn_q": "attention.self.query",
    "attn_k": "attention.self.key",
    "attn_v": "attention.self.value",
    "attn_output": "attention.output.dense",
    "attn_output_norm": "attention.output.LayerNorm",
    "ffn_up": "intermediate.dense",
    "ffn_down": "output.dense",
    "layer_output_norm": "output.LayerNorm",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")


def bert_gguf_to_hf_name(name: str) -> str | None:
    """The HF BertModel name of a `bert` GGUF tensor; None for the rank head's tensors."""
    if name in LLAMA_CPP_RANK_TENSORS:
        return None
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _PER_LAYER:
        return f"encoder.layer.{m.group(1)}.{_PER_LAYER[m.group(2)]}.{m.group(3)}"
    m = _GLOBAL_RE.match(name)
    if m and m.group(1) in _GLOBAL:
        return f"{_GLOBAL[m.group(1)]}.{m.group(2)}"
    raise ValueError(
        f"model: GGUF tensor {name!r} has no BERT equivalent (paged reads llama.cpp's `bert` "
        "files with separate attn_q/attn_k/attn_v tensors)"
    )


def is_rank_gguf(reader: GGUFFile | gguf.GGUFReader) -> bool:
    """A `bert` file that carries a rank head or declares pooling_type RANK."""
    names = {t.name for t in reader.tensors}
    pooling = field_value(reader, f"{ENCODER_GGUF_ARCHITECTURE}.pooling_type")
    return bool(names & LLAMA_CPP_RANK_TENSORS) or (
        pooling is not None and int(pooling) == _POOLING_RANK
    )


def bert_hf_config(reader: GGUFFile | gguf.GGUFReader, path: Path) -> Any:
    """A transformers BertConfig for a `bert` GGUF (positions 0-based: model_type bert)."""
    from transformers import AutoConfig

    arch = ENCODER_GGUF_ARCHITECTURE

    def req(key: str) -> Any:
        value = field_value(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"model: GGUF file {str(path)!r} lacks metadata key '{arch}.{key}'")
        return value

    if field_value(reader, f"{arch}.attention.causal"):
        raise ValueError(
            f"model: GGUF file {str(path)!r} declares a causal `bert` model; paged's BERT "
            "encoder attends both ways"
        )
    tensors = {t.name: t for t in reader.tensors}
    for name in ("token_embd.weight", "position_embd.weight"):
        if name not in tensors:
            raise ValueError(f"model: GGUF file {str(path)!r} lacks tensor {name!r}")
    vocab = int(tensors["token_embd.weight"].shape.tolist()[1])
    types = tensors.get("token_types.weight")
    # Without the tensor iterate_bert_gguf supplies one zero row (see there).
    type_count = 1 if types is None else int(types.shape.tolist()[1])
    rank = is_rank_gguf(reader)
    labels = field_value(reader, f"{arch}.classifier.output_labels")
    out = tensors.get("cls.output.weight")
    cls_dense = tensors.get("cls.weight")
    if out is not None:
        num_labels = int(out.shape.tolist()[1])
    elif cls_dense is not None:  # llama.cpp's jina-reranker-v1 shape: cls + tanh only
        num_labels = int(cls_dense.shape.tolist()[1])
    elif rank:
        raise ValueError(
            f"model: GGUF file {str(path)!r} declares pooling_type RANK but has no rank head "
            "(neither cls nor cls.output tensors)"
        )
    else:
        num_labels = 1
    kwargs: dict[str, Any] = {
        "architectures": ["BertForSequenceClassification" if rank else "BertModel"],
        "vocab_size": vocab,
        "hidden_size": int(req("embedding_length")),
        "num_hidden_layers": int(req("block_count")),
        "num_attention_heads": int(req("attention.head_count")),
        "intermediate_size": int(req("feed_forward_length")),
        "max_position_embeddings": int(tensors["position_embd.weight"].shape.tolist()[1]),
        "layer_norm_eps": float(req("attention.layer_norm_epsilon")),
        # llama.cpp's BERT feed-forward is LLM_FFN_GELU (ggml's tanh approximation);
        # the checkpoints it converts use the exact GELU, which paged runs, as transformers.
        "hidden_act": "gelu",
        "type_vocab_size": type_count,
        "pad_token_id": field_value(reader, "tokenizer.ggml.padding_token_id") or 0,
    }
    if rank:
        kwargs["num_labels"] = num_labels
        if labels and len(labels) == num_labels:
            kwargs["id2label"] = {i: str(v) for i, v in enumerate(labels)}
            kwargs["label2id"] = {str(v): i for i, v in enumerate(labels)}
    return AutoConfig.for_model("bert", **kwargs)


def iterate_bert_gguf(
    reader: GGUFFile | gguf.GGUFReader, path: Path
) -> list[tuple[str, torch.Tensor]]:
    """The body tensors of a `bert` GGUF under HF BertModel names, float32.

    A file without `token_types` (optional in llama.cpp, which then adds nothing)
    gets a zero row, so the encoder's token-type embedding adds nothing either.
    """
    out: list[tuple[str, torch.Tensor]] = []
    for tensor in reader.tensors:
        hf_name = bert_gguf_to_hf_name(tensor.name)
        if hf_name is None:
            continue
        try:
            out.append((hf_name, dequantize(tensor)))
        except Exception as exc:  # gguf/numpy raise assorted errors on short data
            raise ValueError(
                f"model: GGUF tensor {tensor.name!r} in {str(path)!r} cannot be decoded "
                f"({type(exc).__name__}: {exc}); the file is truncated or corrupt"
            ) from exc
    if not any(name == "embeddings.token_type_embeddings.weight" for name, _ in out):
        hidden = next(t for n, t in out if n == "embeddings.word_embeddings.weight").shape[1]
        out.append(("embeddings.token_type_embeddings.weight", torch.zeros(1, hidden)))
    return out
