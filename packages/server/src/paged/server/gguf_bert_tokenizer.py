"""The tokenizer of a llama.cpp `bert` GGUF (BERT's WordPiece, XLM-RoBERTa's Unigram).

transformers builds GGUF tokenizers for decoders only (its gguf tokenizer mapping
knows gpt2 / llama / t5 vocabularies, not llama.cpp's `bert` WPM, and its t5 one has
T5's post-processor, not XLM-R's), so paged rebuilds these two from the metadata,
as llama.cpp reads them (src/llama-vocab.cpp) and its converter writes them
(conversion/bert.py):

- `tokenizer.ggml.model = "bert"` (WPM): the WordPiece vocabulary in "phantom space"
  spelling: a word-initial piece is stored as "\u2581piece", a continuation "##piece" as
  "piece", CONTROL tokens ([CLS], [SEP], ...) unchanged. Undone here, then BERT's
  normaliser (lower-casing and accent stripping from `tokenizer.ggml.normalizer.*`;
  a file without those keys is lower-cased, as llama.cpp did before it wrote them),
  BERT's pre-tokeniser, and `[CLS] A [SEP] (B [SEP])` with token types 0 / 1.
  Special ids default as llama.cpp's: CLS = BOS 101, UNK 100, SEP 102, PAD 0, MASK 103.
- `tokenizer.ggml.model = "t5"` on a `bert` file (UGM, XLM-RoBERTa): the Unigram
  pieces and scores (<s>, <pad>, </s>, <unk> realigned first by the converter), the
  precompiled charsmap, `add_space_prefix`, and `<s> A </s> (</s> B </s>)`.

Both are handed to transformers' own BertTokenizer / XLMRobertaTokenizer (built from a
vocabulary), so the tokenizer paged caches reloads as that class.
"""

from __future__ import annotations

from typing import Any

import gguf

from paged.runner.loader.gguf_config import field_value as _value
from paged.runner.loader.gguf_file import GGUFFile

_CONTROL = int(gguf.TokenType.CONTROL)
_XLMR_UNK_ID = 3
_PHANTOM = "\u2581"
# GGUF key stem (gguf.Keys.Tokenizer; "seperator" is llama.cpp's spelling) -> llama.cpp's
# default id for a WPM vocabulary (llama-vocab.cpp, tokenizer_model == "bert").
_WPM_SPECIALS = {
    "bos_token_id": 101,
    "unknown_token_id": 100,
    "seperator_token_id": 102,
    "padding_token_id": 0,
    "mask_token_id": 103,
}


def _token(tokens: list[str], reader: GGUFFile | gguf.GGUFReader, key: str, default: int) -> str:
    value = _value(reader, f"tokenizer.ggml.{key}")
    index = default if value is None else int(value)
    if not 0 <= index < len(tokens):
        raise ValueError(f"model: the GGUF tokenizer's {key} ({index}) is not in its vocabulary")
    return tokens[index]


def is_bert_gguf_tokenizer(reader: GGUFFile | gguf.GGUFReader) -> bool:
    """Whether the file's tokenizer is one of the two this module builds."""
    return _value(reader, "general.architecture") == "bert" and _value(
        reader, "tokenizer.ggml.model"
    ) in ("bert", "t5")


def build_bert_gguf_tokenizer(reader: GGUFFile | gguf.GGUFReader) -> Any:
    """A transformers fast tokenizer for a `bert` GGUF (see the module docstring)."""
    model = _value(reader, "tokenizer.ggml.model")
    tokens = [str(t) for t in _value(reader, "tokenizer.ggml.tokens") or []]
    if not tokens:
        raise ValueError("model: the GGUF has no tokenizer.ggml.tokens")
    if model == "bert":
        return _wordpiece(reader, tokens)
    if model == "t5":
        return _unigram(reader, tokens)
    raise ValueError(f"model: a `bert` GGUF with tokenizer {model!r} is not supported (bert, t5)")


def _wordpiece(reader: GGUFFile | gguf.GGUFReader, tokens: list[str]) -> Any:
    from transformers import BertTokenizer

    types = _value(reader, "tokenizer.ggml.token_type")
    if types is None or len(types) != len(tokens):
        raise ValueError("model: a `bert` GGUF tokenizer needs tokenizer.ggml.token_type")
    words = [
        token
        if int(kind) == _CONTROL
        else token[len(_PHANTOM) :]
        if token.startswith(_PHANTOM)
        else "##" + token
        for token, kind in zip(tokens, types, strict=True)
    ]
    vocab: dict[str, int] = {}
    for index, word in enumerate(words):
        vocab.setdefault(word, index)

    def special(key: str, required: bool = True) -> str | None:
        try:
            return words[tokens.index(_token(tokens, reader, key, _WPM_SPECIALS[key]))]
        except ValueError:
            if required:
                raise
            return None  # PAD / MASK are not needed to encode

    lowercase = _value(reader, "tokenizer.ggml.normalizer.lowercase")
    lowercase = True if lowercase is None else bool(lowercase)
    strip = _value(reader, "tokenizer.ggml.normalizer.strip_accents")
    # transformers' BertTokenizer over that vocabulary: BERT's normaliser, pre-tokeniser,
    # WordPiece and `[CLS] A [SEP] B [SEP]` post-processor (token types 0 / 1). llama.cpp's
    # BERT classifies from BOS ([CLS]); SEP closes each segment.
    bert: Any = BertTokenizer
    return bert(
        vocab=vocab,
        do_lower_case=lowercase,
        strip_accents=None if strip is None else bool(strip),
        cls_token=special("bos_token_id"),
        sep_token=special("seperator_token_id"),
        unk_token=special("unknown_token_id"),
        pad_token=special("padding_token_id", required=False),
        mask_token=special("mask_token_id", required=False),
    )


def _unigram(reader: GGUFFile | gguf.GGUFReader, tokens: list[str]) -> Any:
    from transformers import XLMRobertaTokenizer

    scores = _value(reader, "tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ValueError("model: a Unigram GGUF tokenizer needs tokenizer.ggml.scores")
    unk_id = _value(reader, "tokenizer.ggml.unknown_token_id")
    if unk_id is not None and int(unk_id) != _XLMR_UNK_ID:
        # transformers' XLM-R tokenizer fixes <unk> at 3, where the converter puts it.
        raise ValueError(
            f"model: a Unigram `bert` GGUF needs <unk> at id {_XLMR_UNK_ID}, this one has "
            f"it at {unk_id}"
        )
    charsmap = _value(reader, "tokenizer.ggml.precompiled_charsmap")
    add_prefix = _value(reader, "tokenizer.ggml.add_space_prefix")
    pad = _value(reader, "tokenizer.ggml.padding_token_id")
    xlmr: Any = XLMRobertaTokenizer
    bos = _token(tokens, reader, "bos_token_id", 0)
    eos = _token(tokens, reader, "eos_token_id", 2)
    return xlmr(
        vocab=[(t, float(s)) for t, s in zip(tokens, scores, strict=True)],
        add_prefix_space=add_prefix is None or bool(add_prefix),
        bos_token=bos,
        eos_token=eos,
        cls_token=bos,
        sep_token=eos,
        unk_token=tokens[_XLMR_UNK_ID],
        pad_token=tokens[int(pad)] if pad is not None and 0 <= int(pad) < len(tokens) else "<pad>",
        mask_token="<mask>",
        _spm_precompiled_charsmap=bytes(bytearray(int(b) for b in charsmap)) if charsmap else None,
    )
