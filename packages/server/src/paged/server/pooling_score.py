"""`LLM.score` inputs and results: pairs 1:1, 1:N or N:N, cross-encoder or cosine.

vLLM 0.33: a model whose pooling task is `classify` scores a pair with one
forward pass of the tokenizer's pair encoding (a cross-encoder; num_labels
must be 1); an `embed` model embeds both sides and scores their cosine
similarity (a bi-encoder) - vllm/tasks.py:34-38 (SCORE_TYPE_MAP),
vllm/entrypoints/pooling/offline.py:292-330, scoring/utils.py:265-300.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from paged.server.errors import InvalidRequestError
from paged.server.input_processor import ProcessedPrompt
from paged.server.score_prompt import render_score_pair
from paged.server.tokenizer import TokenizerLike


def score_pairs(data_1: str | Sequence[str], data_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """The (query, document) pairs: 1 -> N replicates the single query, N -> N zips."""
    first = [data_1] if isinstance(data_1, str) else list(data_1)
    second = [data_2] if isinstance(data_2, str) else list(data_2)
    for name, items in (("data_1", first), ("data_2", second)):
        if not items:
            raise InvalidRequestError(name, f"{name} must not be empty")
        if not all(isinstance(t, str) for t in items):
            raise InvalidRequestError(name, f"{name} must be a string or a list of strings")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise InvalidRequestError(
            "data_2",
            f"data_1 has {len(first)} inputs and data_2 {len(second)}; give one data_1 "
            "or as many as data_2",
        )
    return list(zip(first, second, strict=True))


def compress_token_type_ids(token_type_ids: Sequence[int]) -> tuple[int, int]:
    """The half-open range of token type 1 (vLLM's compress_token_type_ids)."""
    n = len(token_type_ids)
    first_one = next((i for i, t in enumerate(token_type_ids) if t == 1), n)
    end = next((i for i in range(first_one, n) if token_type_ids[i] != 1), n)
    if any(t not in (0, 1) for t in token_type_ids) or any(t != 0 for t in token_type_ids[end:]):
        raise ValueError(
            "Token type ids are expected to be a sequence of zeros followed by ones "
            "and optional trailing zeros"
        )
    return first_one, end


def cross_encoder_prompt(
    tokenizer: TokenizerLike,
    text_1: str,
    text_2: str,
    *,
    use_sep_token: bool = True,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[ProcessedPrompt, tuple[int, int] | None]:
    """The pair's prompt (paged.server.score_prompt) and its segment-1 range (None if the
    prompt has no token types)."""
    prompt = render_score_pair(
        tokenizer,
        text_1,
        text_2,
        use_sep_token=use_sep_token,
        chat_template=chat_template,
        chat_template_kwargs=chat_template_kwargs,
    )
    types = prompt.token_types
    span = compress_token_type_ids(types) if types else None
    if span is not None and span[0] >= span[1]:
        span = None  # no type-1 segment: the model does not use token types
    return ProcessedPrompt(prompt.token_ids, None), span


def cosine_score(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of two embeddings, as a 0-d float32 tensor."""
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=0)
