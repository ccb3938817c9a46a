"""InputProcessor: user prompt + SamplingParams -> EngineCoreRequest (seed: InputProcessor).

The single place user input is checked before it reaches the engine: every
rejection is an `InvalidRequestError` (a `ValueError`) naming the field.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypedDict

import msgspec

from paged.scheduler import EngineCoreRequest, SamplingParams
from paged.scheduler.boundary import KVTransferParams
from paged.scheduler.sampling_params import DEFAULT_MAX_LOGPROBS
from paged.server.errors import ContextLengthError, InvalidRequestError, from_value_error
from paged.server.tokenizer import TokenizerLike


class TextPrompt(TypedDict, total=False):
    prompt: str
    add_special_tokens: bool


class TokensPrompt(TypedDict, total=False):
    prompt_token_ids: list[int]
    prompt: str  # optional original text, reported back in RequestOutput.prompt


PromptType = str | list[int] | TextPrompt | TokensPrompt


@dataclass(frozen=True, slots=True)
class ProcessedPrompt:
    token_ids: list[int]
    text: str | None


class InputProcessor:
    """Tokenizes and validates; fills `max_tokens` with what fits in `max_model_len`."""

    def __init__(
        self,
        tokenizer: TokenizerLike,
        *,
        max_model_len: int,
        vocab_size: int | None = None,
        eos_token_ids: Sequence[int] = (),
        max_logprobs: int = DEFAULT_MAX_LOGPROBS,
    ) -> None:
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {max_model_len}")
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size if vocab_size is not None else len(tokenizer)
        # The first EOS id is the request's eos_token_id; further ones (from a
        # generation config listing several) become stop token ids, as in vLLM.
        eos = list(eos_token_ids) or (
            [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        )
        self.eos_token_id: int | None = eos[0] if eos else None
        self.extra_eos_token_ids = eos[1:]
        self.max_logprobs = max_logprobs

    def tokenize(self, prompt: PromptType, *, add_special_tokens: bool = True) -> ProcessedPrompt:
        if isinstance(prompt, str):
            return ProcessedPrompt(
                self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens), prompt
            )
        if isinstance(prompt, list):
            return ProcessedPrompt(self.check_token_ids(prompt, "prompt"), None)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt.get("prompt_token_ids")
                return ProcessedPrompt(
                    self.check_token_ids(ids, "prompt_token_ids"), prompt.get("prompt")
                )
            text = prompt.get("prompt")
            if isinstance(text, str):
                add = prompt.get("add_special_tokens", add_special_tokens)
                return ProcessedPrompt(
                    self.tokenizer.encode(text, add_special_tokens=bool(add)), text
                )
        raise InvalidRequestError(
            "prompt", "prompt must be a string, a list of token ids, or a prompt dict"
        )

    def check_token_ids(self, ids: object, param: str) -> list[int]:
        if not isinstance(ids, Sequence) or isinstance(ids, str):
            raise InvalidRequestError(param, f"{param} must be a list of token ids")
        out: list[int] = []
        for tok in ids:
            if not isinstance(tok, int) or isinstance(tok, bool):
                raise InvalidRequestError(param, f"{param} must contain only integers")
            if not 0 <= tok < self.vocab_size:
                raise InvalidRequestError(
                    param, f"token id {tok} in {param} is out of range [0, {self.vocab_size})"
                )
            out.append(tok)
        return out

    def validate_params(self, params: SamplingParams) -> None:
        try:
            params.validate(self.max_logprobs)
        except ValueError as e:
            raise from_value_error(e) from e
        for tok in params.stop_token_ids:
            if tok >= self.vocab_size:
                raise InvalidRequestError(
                    "stop_token_ids", f"token id {tok} is out of range [0, {self.vocab_size})"
                )
        for tok in params.logit_bias or {}:
            if not 0 <= tok < self.vocab_size:
                raise InvalidRequestError(
                    "logit_bias", f"token id {tok} is out of range [0, {self.vocab_size})"
                )

    def resolve_max_tokens(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """Check the prompt fits and fill `max_tokens` (None -> all that fits)."""
        if prompt_len == 0:
            raise InvalidRequestError("prompt", "the prompt must not be empty")
        room = self.max_model_len - prompt_len
        if room <= 0:
            raise ContextLengthError(
                "prompt",
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, your prompt is {prompt_len} tokens, which leaves no room "
                "for the completion. Please reduce the length of the prompt.",
            )
        if params.max_tokens is None:
            filled = msgspec.structs.replace(params, max_tokens=room)
            # validate() checked min_tokens only against an explicit max_tokens;
            # the default filled in here must pass the same check, or the engine
            # core rejects the request (a 500 instead of the user's 400).
            if filled.min_tokens > room:
                raise InvalidRequestError(
                    "min_tokens",
                    f"min_tokens must be <= max_tokens={room} (what fits in the context "
                    f"after the {prompt_len}-token prompt), got {filled.min_tokens}",
                )
            return filled
        if params.max_tokens > room:
            raise ContextLengthError(
                "max_tokens",
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {prompt_len + params.max_tokens} tokens "
                f"({prompt_len} in the prompt, {params.max_tokens} in the completion). "
                "Please reduce the length of the prompt or of max_tokens.",
            )
        return params

    def process_inputs(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        kv_transfer_params: KVTransferParams | None = None,
    ) -> tuple[EngineCoreRequest, str | None]:
        """Return the engine request and the prompt text (None for token prompts)."""
        if not request_id:
            raise InvalidRequestError("request_id", "request_id must not be empty")
        self.validate_params(params)
        processed = self.tokenize(prompt)
        params = self.resolve_max_tokens(params, len(processed.token_ids))
        extra = [t for t in self.extra_eos_token_ids if t not in params.stop_token_ids]
        if extra and not params.ignore_eos:
            params = msgspec.structs.replace(
                params, stop_token_ids=[*params.stop_token_ids, *extra]
            )
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=processed.token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            priority=priority,
            cache_salt=cache_salt,
            kv_transfer_params=kv_transfer_params,
        )
        return request, processed.text
