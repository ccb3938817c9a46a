"""GGUF rerankers: which files are, the classifier they become, their rank head tensors.

llama.cpp marks a reranker with `{arch}.pooling_type = RANK` (4) and stores its head
as `cls` / `cls.output` (llama-graph.cpp, build_pooling, case LLAMA_POOLING_TYPE_RANK:
the CLS row, or the last token's for a causal model, then `cls` + tanh if present,
then `cls.output` if present, then a softmax for qwen3).

- `bert` files (loader/gguf_bert.py): the head keeps llama.cpp's names; the pooler
  applies it as llama.cpp does (pooling/heads.py).
- decoders: llama.cpp's converter (conversion/qwen.py, Qwen3Model) turns Qwen3-Reranker
  into a qwen3 file whose LM head is replaced by `cls.output.weight` = the LM head rows
  of "yes" and "no" (in that order), with `classifier.output_labels` ["yes", "no"] and
  a `tokenizer.chat_template.rerank` prompt; llama.cpp's score is the softmax's "yes"
  probability. paged serves such a file as the decoder's *ForSequenceClassification
  (the body, no LM head) with a `score` head: for qwen3 with two rows one label,
  score.weight = w[yes] - w[no] (vLLM's from_2_way_softmax, adapters.py:516-590:
  sigmoid(score) is that softmax's "yes" probability); otherwise one label per row,
  the rows themselves. `use_sep_token` is false (an LLM reranker: vLLM concatenates
  query and document when no score template is given).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import torch

from paged.runner.loader.gguf_config import (
    ENCODER_GGUF_ARCHITECTURE,
    LLAMA_CPP_RANK_TENSORS,
    field_value,
    open_gguf,
)
from paged.runner.loader.gguf_file import GGUFFile
from paged.runner.loader.gguf_weights import dequantize

_POOLING_RANK = 4
# GGUF decoder architecture -> the *ForSequenceClassification paged runs it as.
DECODER_RANK_ARCHITECTURES = {
    "llama": "LlamaForSequenceClassification",
    "qwen2": "Qwen2ForSequenceClassification",
    "qwen3": "Qwen3ForSequenceClassification",
}
# llama.cpp softmaxes the rank head's outputs for these (llama-graph.cpp, build_pooling).
_SOFTMAX_RANK_ARCHITECTURES = frozenset({"qwen3"})


def _tensors(reader: GGUFFile | gguf.GGUFReader) -> dict[str, Any]:
    return {t.name: t for t in reader.tensors}


def is_decoder_rank(reader: GGUFFile | gguf.GGUFReader) -> bool:
    """A decoder file declaring pooling_type RANK."""
    arch = field_value(reader, "general.architecture")
    value = field_value(reader, f"{arch}.pooling_type")
    return arch != ENCODER_GGUF_ARCHITECTURE and value is not None and int(value) == _POOLING_RANK


def _two_way(arch: str, rows: int) -> bool:
    return arch in _SOFTMAX_RANK_ARCHITECTURES and rows == 2


def apply_decoder_rank(reader: GGUFFile | gguf.GGUFReader, path: Path, hf_config: Any) -> None:
    """Make `hf_config` the decoder classifier a RANK file is (ValueError naming what is
    missing, before any weight loads)."""
    arch = str(field_value(reader, "general.architecture"))
    out = _tensors(reader).get("cls.output.weight")
    if out is None:
        raise ValueError(
            f"model: GGUF file {str(path)!r} is a llama.cpp reranker (pooling_type RANK) "
            "without its classifier: it has no cls.output tensor (llama.cpp's converter "
            "writes the LM head's 'yes' / 'no' rows there); re-convert it, or serve the "
            "Hugging Face checkpoint (a *ForSequenceClassification directory, or "
            "--hf-overrides for an LM reranker)"
        )
    if arch not in DECODER_RANK_ARCHITECTURES:
        raise ValueError(
            f"model: GGUF file {str(path)!r} is a {arch!r} reranker; paged serves GGUF "
            f"rerankers of {', '.join(sorted(DECODER_RANK_ARCHITECTURES))} and bert"
        )
    rows = int(out.shape.tolist()[1])
    hf_config.architectures = [DECODER_RANK_ARCHITECTURES[arch]]
    hf_config.num_labels = 1 if _two_way(arch, rows) else rows
    hf_config.use_sep_token = False


def read_gguf_rank_head(path: Path) -> dict[str, torch.Tensor]:
    """The head tensors the pooler builds a GGUF reranker's classifier from (float32):
    llama.cpp's names for a `bert` file, `score.*` for a decoder (module docstring)."""
    reader = open_gguf(path)
    arch = str(field_value(reader, "general.architecture"))
    head = {
        t.name: dequantize(t).float() for t in reader.tensors if t.name in LLAMA_CPP_RANK_TENSORS
    }
    if arch == ENCODER_GGUF_ARCHITECTURE:
        return head
    weight, bias = head["cls.output.weight"], head.get("cls.output.bias")
    if _two_way(arch, int(weight.shape[0])):
        out = {"score.weight": weight[[0]] - weight[[1]]}  # rows: yes, no
        if bias is not None:
            out["score.bias"] = bias[[0]] - bias[[1]]
        return out
    return {"score.weight": weight} | ({} if bias is None else {"score.bias": bias})


def llama_cpp_rerank_prompt(path: Path) -> str | None:
    """The file's `tokenizer.chat_template.rerank` ({query} / {document} placeholders)."""
    value = field_value(open_gguf(path), "tokenizer.chat_template.rerank")
    return None if value is None else str(value)
