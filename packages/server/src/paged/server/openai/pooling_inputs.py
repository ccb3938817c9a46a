"""From a pooling request's inputs to the token ids the engine pools.

Everything here is blocking (tokenizer, chat template) and runs off the event
loop. Length rules are vLLM 0.33's (vllm/renderers/params.py:259-297,
495-540): `truncate_prompt_tokens` keeps N tokens (-1: max_model_len) from
the side `truncation_side` names, else the tokenizer's own (Hugging Face:
"right", the first N); without it, a prompt over max_model_len is refused
with vLLM's message, since a pooling request produces no output tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from paged.server.chat_utils import apply_chat_template
from paged.server.errors import ContextLengthError, InvalidRequestError
from paged.server.pooling_score import compress_token_type_ids
from paged.server.score_prompt import render_score_pair
from paged.server.tokenizer import TokenizerLike

# Checks a token list against the vocabulary (InputProcessor.check_token_ids).
TokenChecker = Callable[[object, str], list[int]]


@dataclass(frozen=True)
class TokenLimits:
    """How long a pooled prompt may be, and how it is cut to fit."""

    max_model_len: int
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None

    def __post_init__(self) -> None:
        n = self.truncate_prompt_tokens
        if n is not None and n > self.max_model_len:
            # vLLM 0.33's wording (renderers/params.py:286-297).
            raise InvalidRequestError(
                "truncate_prompt_tokens",
                f"truncate_prompt_tokens={n} cannot be greater than max_model_len "
                f"= {self.max_model_len}. Please request a smaller truncation size.",
            )

    def fit(self, ids: list[int], tokenizer: object) -> list[int]:
        """`ids` truncated as asked; a 400 when empty or still too long to fit."""
        keep = self.truncate_prompt_tokens
        if keep is not None and keep < 0:
            keep = self.max_model_len
        if keep is not None and keep < len(ids):
            side = self.truncation_side or getattr(tokenizer, "truncation_side", "right")
            ids = ids[len(ids) - keep :] if side == "left" else ids[:keep]
        if not ids:
            raise InvalidRequestError("input", "a prompt must not be empty (it has no tokens)")
        if len(ids) > self.max_model_len:
            raise ContextLengthError(
                "input",
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, your prompt contains {len(ids)} input tokens, which exceeds "
                "this limit even without any output tokens. Please reduce the length of "
                "the input prompt.",
            )
        return ids


def completion_prompts(
    value: str | list[str] | list[int] | list[list[int]],
) -> list[str | list[int]]:
    """`input` as a list of prompts: texts or token lists; a 400 when there are none."""
    if isinstance(value, str):
        return [value]
    if not value:
        # vllm/entrypoints/pooling/base/serving.py:87-88
        raise InvalidRequestError("input", "You must pass at least one prompt")
    if all(isinstance(x, int) for x in value):
        return [[int(x) for x in value if isinstance(x, int)]]
    out: list[str | list[int]] = []
    for x in value:
        if isinstance(x, str):
            out.append(x)
        elif isinstance(x, list):
            if not x:
                raise InvalidRequestError("input", "a token list in input must not be empty")
            out.append(list(x))
    return out


@dataclass(frozen=True)
class ChatOptions:
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None


def render_prompts(
    tokenizer: TokenizerLike,
    prompts: Sequence[str | list[int]],
    add_special_tokens: bool,
    limits: TokenLimits,
    check_ids: TokenChecker,
) -> list[list[int]]:
    """Each prompt's token ids: texts tokenized, token lists checked, all fitted."""
    out: list[list[int]] = []
    for p in prompts:
        if isinstance(p, str):
            ids = tokenizer.encode(p, add_special_tokens=add_special_tokens)
        else:
            ids = check_ids(p, "input")
        out.append(limits.fit(ids, tokenizer))
    return out


def render_conversations(
    tokenizer: TokenizerLike,
    conversations: Sequence[Sequence[Mapping[str, Any]]],
    options: ChatOptions,
    add_special_tokens: bool,
    limits: TokenLimits,
) -> list[list[int]]:
    """Each conversation through the chat template, then tokenized and fitted."""
    out: list[list[int]] = []
    for messages in conversations:
        if not messages:
            raise InvalidRequestError("messages", "a conversation must hold at least one message")
        text = apply_chat_template(
            tokenizer,
            messages,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
            chat_template=options.chat_template,
            chat_template_kwargs=options.chat_template_kwargs,
        )
        ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
        out.append(limits.fit(ids, tokenizer))
    return out


def check_token_limit(value: int, name: str, max_model_len: int) -> None:
    """vLLM 0.33's max_tokens_per_query / _doc check (scoring/io_processor.py:115-122)."""
    if value < 0:
        raise InvalidRequestError(name, f"{name} must be a non-negative integer")
    if value >= max_model_len:
        raise InvalidRequestError(
            name, f"{name} ({value}) must be less than max_model_len ({max_model_len})."
        )


def truncate_text(tokenizer: TokenizerLike, text: str, max_tokens: int) -> str:
    """`text` cut to its first `max_tokens` content tokens (0: unchanged).

    Cut on the text at a token boundary found from the tokenizer's offsets, as
    vLLM 0.33's truncate_text_to_tokens (scoring/utils.py:42-71), so the pair
    is tokenized whole afterwards; a tokenizer without offsets cuts by decoding.
    """
    if max_tokens <= 0:
        return text
    if not callable(tokenizer):
        ids = tokenizer.encode(text, add_special_tokens=False)
        return tokenizer.decode(ids[:max_tokens]) if len(ids) > max_tokens else text
    while text:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = enc["offset_mapping"]
        if len(enc["input_ids"]) <= max_tokens:
            break
        end = min(offsets[max_tokens - 1][1], offsets[max_tokens][0])
        text = text[: min(end, len(text) - 1)]
    return text


@dataclass(frozen=True)
class ScoreTemplate:
    """How a cross-encoder's pairs become prompts: the explicit score template (None:
    none), the request's kwargs for it, and whether pairs get the tokenizer's separator."""

    use_sep_token: bool = True
    chat_template: str | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class PairTokens:
    """A cross-encoder pair as the engine gets it."""

    token_ids: list[int]
    # [start, end) of the tokens of type 1 (the document), vLLM's compressed
    # token_type_ids (scoring/utils.py:265-291); None when there are none.
    token_type_range: tuple[int, int] | None


def encode_pair(
    tokenizer: TokenizerLike,
    query: str,
    document: str,
    template: ScoreTemplate,
    limits: TokenLimits,
) -> PairTokens:
    """One (query, document) pair tokenized for a cross-encoder, then fitted.

    The pair's prompt follows vLLM's rule (paged.server.score_prompt): a score
    template when one was given, else the tokenizer's pair encoding for BERT-style
    cross-encoders, else the two texts concatenated (an LLM used as a reranker).
    """
    prompt = render_score_pair(
        tokenizer,
        query,
        document,
        use_sep_token=template.use_sep_token,
        chat_template=template.chat_template,
        chat_template_kwargs=template.chat_template_kwargs,
    )
    ids, types = prompt.token_ids, prompt.token_types
    fitted = limits.fit(ids, tokenizer)
    if types is None:
        return PairTokens(fitted, None)
    if len(fitted) < len(ids):  # truncated: keep the types aligned with the kept tokens
        side = limits.truncation_side or getattr(tokenizer, "truncation_side", "right")
        types = types[len(types) - len(fitted) :] if side == "left" else types[: len(fitted)]
    span = compress_token_type_ids(types)
    return PairTokens(fitted, span if span[0] < span[1] else None)
