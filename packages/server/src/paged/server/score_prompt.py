"""One cross-encoder (query, document) pair -> the prompt a classifier scores.

vLLM 0.33's rule (vllm/entrypoints/pooling/scoring/io_processor.py:707-830),
shared by `LLM.score` and the /score and /rerank routes:

- a score template given explicitly (`--chat-template`, `LLM.score(...,
  chat_template=...)`) renders the pair as the two messages
  `{"role": "query"}`, `{"role": "document"}` (text only, with the request's
  `chat_template_kwargs`, e.g. `instruction`), and the text is tokenized with
  the tokenizer's special tokens. The tokenizer's own chat template is never
  used for scoring (vLLM: "many models inherit junk templates from their base
  LLM"), which is why Qwen3-Reranker needs `--chat-template`;
- else a BERT-style cross-encoder (`use_sep_token`, the default) gets the
  tokenizer's pair encoding `[CLS] q [SEP] d [SEP]` with token types;
- else (an LLM used as a reranker: `use_sep_token: false`) the two texts are
  concatenated and tokenized as one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import jinja2

from paged.server.errors import InvalidRequestError
from paged.server.tokenizer import TokenizerLike

# Keys the scorer passes itself (io_processor.py:799-806): a request may not set them.
_RESERVED: Final = frozenset({"chat_template", "tools", "tokenize"})


@dataclass(frozen=True)
class ScorePrompt:
    """A pair's token ids and, for a pair encoding, its token types (else None)."""

    token_ids: list[int]
    token_types: list[int] | None


def check_score_template_kwargs(kwargs: Mapping[str, Any] | None) -> None:
    """A 400 for `chat_template_kwargs` that would override the scorer's own arguments."""
    clash = sorted(_RESERVED & set(kwargs or {}))
    if clash:
        raise InvalidRequestError(
            "chat_template_kwargs",
            "chat_template_kwargs contains reserved keys that conflict with fixed scorer "
            f"arguments: {clash}",
        )


def render_score_pair(
    tokenizer: TokenizerLike,
    query: str,
    document: str,
    *,
    use_sep_token: bool,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> ScorePrompt:
    """The prompt for one pair (see the module docstring); a 400 when the template fails."""
    if chat_template is not None:
        check_score_template_kwargs(chat_template_kwargs)
        messages = [
            {"role": "query", "content": query},
            {"role": "document", "content": document},
        ]
        try:
            text = tokenizer.apply_chat_template(
                messages,
                chat_template=chat_template,
                tokenize=False,
                **dict(chat_template_kwargs or {}),
            )
        # A broken template (or a kwarg it cannot take) is the caller's input at fault.
        except (ValueError, TypeError, OverflowError, RecursionError, jinja2.TemplateError) as e:
            raise InvalidRequestError("chat_template", f"the score template failed: {e}") from e
        if not isinstance(text, str):
            raise InvalidRequestError("chat_template", "the score template did not render to text")
        return ScorePrompt(tokenizer.encode(text, add_special_tokens=True), None)
    if use_sep_token and callable(tokenizer):
        encoded: Mapping[str, Any] = tokenizer(text=query, text_pair=document)
        types = encoded.get("token_type_ids")
        return ScorePrompt(
            [int(t) for t in encoded["input_ids"]],
            None if types is None else [int(t) for t in types],
        )
    return ScorePrompt(tokenizer.encode(query + document, add_special_tokens=True), None)
