"""Write a Hugging Face BERT-family directory as a llama.cpp `bert` GGUF, without llama.cpp.

Tests and benchmarks need BERT-family GGUFs (embedders and rerankers) built from
random checkpoints on the spot; llama.cpp's converter (convert_hf_to_gguf.py,
`conversion/bert.py`) needs llama.cpp's source tree and sentencepiece. This writer
follows that converter's output with the `gguf` package alone:

- BertModel / BertForSequenceClassification (WordPiece vocabulary, `tokenizer.ggml.model
  = "bert"`, tokens in "phantom space" spelling: "\u2581word", "##piece" -> "piece",
  CONTROL tokens unchanged); BERT's `pooler.dense` is dropped, as the converter does,
  and `classifier` becomes `cls.output` (`keep_bert_pooler=True` writes `pooler.dense`
  as `cls` instead, which llama.cpp's rank head applies with tanh, i.e. what
  transformers computes);
- RobertaModel / XLMRobertaModel and their *ForSequenceClassification (Unigram
  vocabulary from a tokenizer.json, `tokenizer.ggml.model = "t5"`): the position table
  loses its first pad_token_id + 1 rows, `classifier.dense` -> `cls`,
  `classifier.out_proj` -> `cls.output`.

2-D weights in `dtype` (F32 or F16), 1-D tensors F32, as llama.cpp writes them.

    python benchmarks/bert_gguf.py /models/bge-small -o /tmp/bge-small-f16.gguf --dtype F16
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np

_ROBERTA_TYPES = ("roberta", "xlm-roberta")
_GLOBAL = {
    "embeddings.word_embeddings": "token_embd",
    "embeddings.position_embeddings": "position_embd",
    "embeddings.token_type_embeddings": "token_types",
    "embeddings.LayerNorm": "token_embd_norm",
}
_PER_LAYER = {
    "attention.self.query": "attn_q",
    "attention.self.key": "attn_k",
    "attention.self.value": "attn_v",
    "attention.output.dense": "attn_output",
    "attention.output.LayerNorm": "attn_output_norm",
    "intermediate.dense": "ffn_up",
    "output.dense": "ffn_down",
    "output.LayerNorm": "layer_output_norm",
}


def _gguf_name(name: str, seq_cls_bert: bool, keep_bert_pooler: bool) -> str | None:
    """The llama.cpp name of an HF tensor; None for what the converter drops."""
    for prefix in ("bert.", "roberta."):
        name = name.removeprefix(prefix)
    if name.endswith("position_ids") or name.startswith(("cls.predictions", "lm_head.")):
        return None
    module, _, leaf = name.rpartition(".")
    if module == "pooler.dense":
        return f"cls.{leaf}" if keep_bert_pooler and seq_cls_bert else None
    if module == "classifier":  # BertForSequenceClassification (labels given: cls.output)
        return f"cls.output.{leaf}"
    if module == "classifier.dense":
        return f"cls.{leaf}"
    if module == "classifier.out_proj":
        return f"cls.output.{leaf}"
    if module in _GLOBAL:
        return f"{_GLOBAL[module]}.{leaf}"
    parts = module.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["encoder", "layer"] and parts[3] in _PER_LAYER:
        return f"blk.{parts[2]}.{_PER_LAYER[parts[3]]}.{leaf}"
    raise ValueError(f"bert_gguf: no llama.cpp name for {name!r}")


def _tensors(model_dir: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    out: dict[str, np.ndarray] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def _wordpiece_vocab(writer: gguf.GGUFWriter, tokenizer: Any) -> None:
    vocab = tokenizer.get_vocab()
    ordered = sorted(vocab, key=lambda t: vocab[t])
    special = set(tokenizer.all_special_tokens)
    tokens, types = [], []
    for token in ordered:
        if token in special:
            tokens.append(token)
            types.append(gguf.TokenType.CONTROL)
        else:
            tokens.append(token[2:] if token.startswith("##") else "\u2581" + token)
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    # SpecialVocab writes the CLS token as BOS when the tokenizer has no BOS.
    writer.add_bos_token_id(int(tokenizer.cls_token_id))
    writer.add_sep_token_id(int(tokenizer.sep_token_id))
    writer.add_unk_token_id(int(tokenizer.unk_token_id))
    writer.add_pad_token_id(int(tokenizer.pad_token_id))
    writer.add_mask_token_id(int(tokenizer.mask_token_id))
    lower = bool(getattr(tokenizer, "do_lower_case", True))
    writer.add_bool("tokenizer.ggml.normalizer.lowercase", lower)


def _unigram_vocab(writer: gguf.GGUFWriter, tokenizer: Any, model_dir: Path) -> None:
    model = json.loads((model_dir / "tokenizer.json").read_text())["model"]
    if model.get("type") != "Unigram":
        raise ValueError("bert_gguf: a RoBERTa-family tokenizer must be a Unigram tokenizer.json")
    pieces = model["vocab"]
    special = set(tokenizer.all_special_ids)
    unk_id = int(model.get("unk_id", 3))
    tokens, scores, types = [], [], []
    for index, (piece, score) in enumerate(pieces):
        tokens.append(piece)
        scores.append(float(score))
        if index == unk_id:
            types.append(gguf.TokenType.UNKNOWN)
        elif index in special:
            types.append(gguf.TokenType.CONTROL)
        else:
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("t5")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_add_space_prefix(True)
    writer.add_remove_extra_whitespaces(True)
    writer.add_bos_token_id(int(tokenizer.bos_token_id))
    writer.add_eos_token_id(int(tokenizer.eos_token_id))
    writer.add_unk_token_id(unk_id)
    writer.add_pad_token_id(int(tokenizer.pad_token_id))


def write_bert_gguf(
    model_dir: Path,
    out: Path,
    *,
    dtype: str = "F32",
    pooling_type: gguf.PoolingType | None = None,
    keep_bert_pooler: bool = False,
) -> Path:
    """Convert `model_dir` (config.json, safetensors, tokenizer) to a `bert` GGUF at `out`."""
    from transformers import AutoTokenizer

    if dtype not in ("F32", "F16"):
        raise ValueError(f"dtype: {dtype!r} is not F32 or F16")
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = str(cfg["architectures"][0])
    roberta = cfg.get("model_type") in _ROBERTA_TYPES
    seq_cls = arch.endswith("ForSequenceClassification")
    offset = int(cfg.get("pad_token_id", 1)) + 1 if roberta else 0
    writer = gguf.GGUFWriter(str(out), "bert")
    writer.add_name(f"{model_dir.name} ({arch})")
    writer.add_context_length(int(cfg["max_position_embeddings"]) - offset)
    writer.add_embedding_length(int(cfg["hidden_size"]))
    writer.add_feed_forward_length(int(cfg["intermediate_size"]))
    writer.add_block_count(int(cfg["num_hidden_layers"]))
    writer.add_head_count(int(cfg["num_attention_heads"]))
    writer.add_layer_norm_eps(float(cfg.get("layer_norm_eps", 1e-12)))
    writer.add_causal_attention(False)
    if pooling_type is not None:
        writer.add_pooling_type(pooling_type)
    labels = cfg.get("id2label")
    if seq_cls and labels:
        writer.add_classifier_output_labels([str(v) for _, v in sorted(labels.items())])
    writer.add_file_type(
        gguf.LlamaFileType.MOSTLY_F16 if dtype == "F16" else gguf.LlamaFileType.ALL_F32
    )
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    writer.add_token_type_count(int(cfg.get("type_vocab_size", 1)))
    if roberta:
        _unigram_vocab(writer, tokenizer, model_dir)
    else:
        _wordpiece_vocab(writer, tokenizer)
    seq_cls_bert = seq_cls and not roberta
    for name, array in _tensors(model_dir).items():
        gname = _gguf_name(name, seq_cls_bert, keep_bert_pooler)
        if gname is None:
            continue
        data = np.ascontiguousarray(array, dtype=np.float32)
        if gname == "position_embd.weight":
            data = np.ascontiguousarray(data[offset:])
        if dtype == "F16" and data.ndim == 2:
            data = data.astype(np.float16)
        writer.add_tensor(gname, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("-o", "--output", type=Path, required=True)
    parser.add_argument("--dtype", choices=("F32", "F16"), default="F32")
    parser.add_argument("--pooling", choices=("MEAN", "CLS", "LAST", "RANK"), default=None)
    args = parser.parse_args()
    pooling = None if args.pooling is None else gguf.PoolingType[args.pooling]
    print(write_bert_gguf(args.model_dir, args.output, dtype=args.dtype, pooling_type=pooling))


if __name__ == "__main__":
    main()
