"""GGUF metadata -> Hugging Face config.

A GGUF file carries its hyper-parameters as `<arch>.<key>` metadata
(llama.cpp naming). This module opens the file (loader/gguf_file.py), turning
every parse failure into one ValueError that names the file, and maps
the metadata of the supported architectures onto the matching transformers
config class so that the rest of paged sees one kind of config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf

from paged.runner.loader.gguf_file import GGUFFile, field_length, read_gguf

# GGUF `general.architecture` -> (HF architecture name, HF model_type).
# llama.cpp writes Mistral and SmolLM checkpoints as "llama".
GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    # llama.cpp's gemma3 files hold the text decoder only (the vision tower is a
    # separate mmproj file), hence the text-only model.
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}
# llama.cpp's BERT-family encoders (BertModel, RoBERTa, XLM-R and their rerankers), read
# by loader/gguf_bert.py into paged's BERT encoder; not a decoder, so not listed above.
ENCODER_GGUF_ARCHITECTURE = "bert"
# llama.cpp's rank head (llama-arch.cpp: LLM_TENSOR_CLS "cls", LLM_TENSOR_CLS_OUT
# "cls.output"): read by the pooler, never by a model body.
LLAMA_CPP_RANK_TENSORS = frozenset(
    {"cls.weight", "cls.bias", "cls.output.weight", "cls.output.bias"}
)


def open_gguf(path: Path) -> GGUFFile:
    """Parse a GGUF file (loader/gguf_file.py); a missing, truncated or foreign file raises
    a ValueError."""
    if not path.is_file():
        raise ValueError(f"model: GGUF file {str(path)!r} does not exist")
    try:
        return read_gguf(path)
    except Exception as exc:  # the gguf package raises assorted errors on bad files
        raise ValueError(
            f"model: {str(path)!r} is not a readable GGUF file ({type(exc).__name__}: {exc}); "
            "the file may be truncated or not GGUF: re-download or re-convert it"
        ) from exc


def field_value(reader: GGUFFile | gguf.GGUFReader, key: str) -> Any:
    """The value of metadata `key` (scalars as Python numbers/strings), or None if absent
    (also of gguf-py's reader, which LoRA adapters are read with)."""
    field = reader.fields.get(key)
    if field is None:
        return None
    return field.contents()


# llama.cpp's `enum llama_pooling_type` (gguf.PoolingType), the value of the
# `{arch}.pooling_type` key an embedding model is converted with.
_GGUF_POOLING_TYPES = {1: "MEAN", 2: "CLS", 3: "LAST"}
_GGUF_POOLING_NONE, _GGUF_POOLING_RANK = 0, 4


def gguf_pooling_type(reader: GGUFFile, path: Path) -> str | None:
    """The sequence pooling a GGUF embedding model declares (MEAN, CLS, LAST), else None.

    llama.cpp pools `--embedding` requests with `{arch}.pooling_type`; NONE (0) is
    per-token output (no sequence default). RANK (4) is llama.cpp's reranker, served as
    a classifier (loader/gguf_rank.py: its architecture says classify, with CLS pooling
    for `bert`, LAST for a decoder), so None here.
    """
    arch = field_value(reader, "general.architecture")
    value = field_value(reader, f"{arch}.pooling_type")
    if value is None or int(value) == _GGUF_POOLING_NONE:
        return None
    if int(value) == _GGUF_POOLING_RANK:
        return None
    if int(value) not in _GGUF_POOLING_TYPES:
        raise ValueError(
            f"model: GGUF file {str(path)!r} has an unknown {arch}.pooling_type {value!r}"
        )
    return _GGUF_POOLING_TYPES[int(value)]


def gguf_architecture(reader: GGUFFile, path: Path) -> str:
    """The HF architecture name for the file (ValueError naming the supported ones)."""
    arch = field_value(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        supported = ", ".join(sorted([*GGUF_ARCHITECTURES, ENCODER_GGUF_ARCHITECTURE]))
        raise ValueError(
            f"model: GGUF file {str(path)!r} has architecture {arch!r}, which paged does not "
            f"support; supported GGUF architectures: {supported}"
        )
    return GGUF_ARCHITECTURES[arch][0]


def _require(reader: GGUFFile, key: str, path: Path) -> Any:
    value = field_value(reader, key)
    if value is None:
        raise ValueError(f"model: GGUF file {str(path)!r} lacks metadata key {key!r}")
    return value


def gguf_to_hf_config(reader: GGUFFile, path: Path) -> Any:
    """Build the transformers config (LlamaConfig, Qwen2Config, ...) the file describes."""
    from transformers import AutoConfig

    hf_arch = gguf_architecture(reader, path)
    arch = field_value(reader, "general.architecture")
    model_type = GGUF_ARCHITECTURES[arch][1]

    def req(key: str) -> Any:
        return _require(reader, f"{arch}.{key}", path)

    def opt(key: str) -> Any:
        return field_value(reader, f"{arch}.{key}")

    hidden = int(req("embedding_length"))
    num_heads = int(req("attention.head_count"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab_size = opt("vocab_size")
    if vocab_size is None:
        if tokens is None:
            raise ValueError(f"model: GGUF file {str(path)!r} has neither vocab_size nor tokens")
        vocab_size = field_length(tokens)  # not decoded: Gemma 3's are 262,144 strings
    head_dim = opt("attention.key_length") or hidden // num_heads
    rope_parameters: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(opt("rope.freq_base") or 10000.0),
    }
    scaling_type = opt("rope.scaling.type")
    if scaling_type not in (None, "none"):
        if scaling_type != "linear":
            raise ValueError(
                f"model: GGUF rope scaling {scaling_type!r} in {str(path)!r} is not supported "
                "(supported: linear); use the Hugging Face checkpoint instead"
            )
        rope_parameters["rope_type"] = "linear"
        rope_parameters["factor"] = float(req("rope.scaling.factor"))
    tensor_names = {t.name for t in reader.tensors}
    kwargs: dict[str, Any] = {
        "architectures": [hf_arch],
        "vocab_size": int(vocab_size),
        "hidden_size": hidden,
        "intermediate_size": int(req("feed_forward_length")),
        "num_hidden_layers": int(req("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(opt("attention.head_count_kv") or num_heads),
        "head_dim": int(head_dim),
        "max_position_embeddings": int(req("context_length")),
        "rms_norm_eps": float(req("attention.layer_norm_rms_epsilon")),
        "rope_parameters": rope_parameters,
        # llama.cpp omits output.weight when the LM head shares the embedding.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": field_value(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field_value(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": field_value(reader, "tokenizer.ggml.padding_token_id"),
    }
    if model_type == "llama":
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    sliding_window = opt("attention.sliding_window")
    if sliding_window:
        kwargs["sliding_window"] = int(sliding_window)
    if model_type == "gemma3_text":
        kwargs.update(_gemma3_kwargs(rope_parameters, int(head_dim), kwargs))
    return AutoConfig.for_model(model_type, **kwargs)


def _gemma3_kwargs(
    rope_parameters: dict[str, Any], head_dim: int, kwargs: dict[str, Any]
) -> dict[str, Any]:
    """What a gemma3 GGUF leaves implicit, as llama.cpp assumes it.

    - global layers use rope.freq_base; sliding layers Gemma 3's fixed local base 10,000;
    - every 6th layer is global (llama.cpp's fixed pattern; transformers' default);
    - query_pre_attn_scalar = head_dim (llama.cpp's rule for every size but 27B,
      whose 62 layers scale by hidden / heads instead);
    - the LM head is tied to the embedding.
    """
    scalar = head_dim
    if kwargs["num_hidden_layers"] == 62:  # Gemma 3 27B
        scalar = kwargs["hidden_size"] // kwargs["num_attention_heads"]
    return {
        "rope_parameters": {
            "full_attention": dict(rope_parameters),
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        "query_pre_attn_scalar": scalar,
        "tie_word_embeddings": True,
        "hidden_activation": "gelu_pytorch_tanh",
    }
