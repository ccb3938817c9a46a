"""Decoder classifiers: which body runs them, and LMs converted into rerankers.

Two kinds of checkpoint serve `classify` / `score` from a decoder:

- a `*ForSequenceClassification` checkpoint (transformers' class, or a
  converted "-seq-cls" upload): the causal-LM body without its LM head plus a
  `score` linear layer on the last token's state (vLLM 0.33:
  model_executor/models/adapters.py:307-413, `as_seq_cls_model`);
- an original LM used as a reranker through its LM head (Qwen3-Reranker,
  mxbai-rerank-v2, bge-reranker-v2-gemma): the config (or `--hf-overrides`)
  names `classifier_from_token` and a `method`, and the `score` weight is
  derived from the LM head rows of those tokens at load time
  (adapters.py:416-446, :516-680). `is_original_qwen3_reranker` on a
  Qwen3ForSequenceClassification stands for `method: from_2_way_softmax`
  (vLLM's Qwen3ForSequenceClassificationConfig, models/config.py:927-946).

`apply_seq_cls_conversion` is vLLM's `verify_and_update_config` for both
(num_labels 1 for a 2-way softmax, else one per token; `use_sep_token`
defaults to False: an LLM reranker's query and document are concatenated).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

from paged.runner.models.architectures import body_architecture, is_decoder_seq_cls

__all__ = [
    "SEQ_CLS_METHODS",
    "apply_seq_cls_conversion",
    "body_architecture",
    "conversion_tokens",
    "is_decoder_seq_cls",
    "token_ids_for",
]

# vllm/model_executor/models/adapters.py:659-662 (SEQ_CLS_LOAD_METHODS).
SEQ_CLS_METHODS: Final[tuple[str, ...]] = ("from_2_way_softmax", "no_post_processing")
# The config classes vLLM gives `is_original_qwen3_reranker` a meaning in.
_QWEN3_RERANKER_ARCHITECTURES: Final = frozenset({"Qwen3ForSequenceClassification"})


def conversion_tokens(hf_config: Any) -> list[str] | None:
    """`classifier_from_token` when the config asks for an LM-head conversion, else None."""
    if getattr(hf_config, "method", None) is None:
        return None
    tokens = getattr(hf_config, "classifier_from_token", None)
    return None if tokens is None else [str(t) for t in tokens]


def apply_seq_cls_conversion(hf_config: Any, architecture: str) -> None:
    """vLLM's config fix-ups for a decoder classifier, in place; ValueError naming the key."""
    if architecture in _QWEN3_RERANKER_ARCHITECTURES and getattr(
        hf_config, "is_original_qwen3_reranker", False
    ):
        tokens = getattr(hf_config, "classifier_from_token", None)
        if not isinstance(tokens, list) or len(tokens) != 2:
            raise ValueError(
                "classifier_from_token: an original Qwen3 reranker "
                "(is_original_qwen3_reranker) needs the two tokens whose logits it compares, "
                f'e.g. ["no", "yes"]; got {tokens!r}'
            )
        hf_config.method = "from_2_way_softmax"
    method = getattr(hf_config, "method", None)
    if method is None:
        return
    if method not in SEQ_CLS_METHODS:
        raise ValueError(f"method: {method!r} is not supported; use {' or '.join(SEQ_CLS_METHODS)}")
    tokens = getattr(hf_config, "classifier_from_token", None)
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError(
            f"classifier_from_token: method {method!r} needs a list of token strings, "
            f"got {tokens!r}"
        )
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ValueError(
            f"classifier_from_token: from_2_way_softmax needs 2 tokens (false, true), "
            f"got {len(tokens)}"
        )
    hf_config.num_labels = 1 if method == "from_2_way_softmax" else len(tokens)
    hf_config.use_sep_token = bool(getattr(hf_config, "use_sep_token", False))


def token_ids_for(tokenizer_dir: str | Path, tokens: list[str]) -> list[int]:
    """Each token's id in the model's tokenizer (vLLM: `convert_tokens_to_ids`)."""
    from transformers import AutoTokenizer

    auto: Any = AutoTokenizer  # untyped in transformers
    tokenizer = auto.from_pretrained(str(tokenizer_dir))
    vocab = tokenizer.get_vocab()
    missing = [t for t in tokens if t not in vocab]
    if missing:
        raise ValueError(
            f"classifier_from_token: {missing!r} not in the tokenizer's vocabulary "
            f"({str(tokenizer_dir)!r}); name whole vocabulary tokens"
        )
    return [int(vocab[t]) for t in tokens]
