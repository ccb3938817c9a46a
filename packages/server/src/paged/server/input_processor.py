"""InputProcessor: user prompt + SamplingParams -> EngineCoreRequest (seed: InputProcessor).

The single place user input is checked before it reaches the engine: every
rejection is an `InvalidRequestError` (a `ValueError`) naming the field.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

import msgspec

from paged.scheduler import EngineCoreRequest, SamplingParams
from paged.scheduler.boundary import KVTransferParams
from paged.scheduler.sampling_params import DEFAULT_MAX_LOGPROBS
from paged.server.errors import ContextLengthError, InvalidRequestError, from_value_error
from paged.server.tokenizer import TokenizerLike

if TYPE_CHECKING:
    from paged.multimodal.inputs import MultiModalFeatureSpec
    from paged.server.mm_frontend import MultiModalFrontend


class TextPrompt(TypedDict, total=False):
    prompt: str
    add_special_tokens: bool
    # vLLM's field: {"image": PIL image or list of them}; placeholders in `prompt`.
    multi_modal_data: Mapping[str, Any]


class TokensPrompt(TypedDict, total=False):
    prompt_token_ids: list[int]
    prompt: str  # optional original text, reported back in RequestOutput.prompt
    multi_modal_data: Mapping[str, Any]


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
        mm_frontend: MultiModalFrontend | None = None,
        default_max_tokens: int | None = None,
        max_tokens_cap: int | None = None,
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
        # --generation-config (generation_defaults.py): max_tokens for a request that
        # gives none (still no more than fits), and a limit on every request's.
        self.default_max_tokens = default_max_tokens
        self.max_tokens_cap = max_tokens_cap
        # None: a text-only model; every image is refused with a 400.
        self.mm_frontend = mm_frontend

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
        cap = self.max_tokens_cap
        if cap is not None and params.max_tokens is not None and params.max_tokens > cap:
            # vLLM's get_max_tokens takes the smallest: the server's limit, not an error.
            params = msgspec.structs.replace(params, max_tokens=cap)
            if params.min_tokens > cap:
                raise InvalidRequestError(
                    "min_tokens",
                    f"min_tokens must be <= max_tokens={cap} (the server's limit), "
                    f"got {params.min_tokens}",
                )
        if params.max_tokens is None:
            fill = min(v for v in (room, self.default_max_tokens, cap) if v is not None)
            filled = msgspec.structs.replace(params, max_tokens=fill)
            # validate() checked min_tokens only against an explicit max_tokens;
            # the default filled in here must pass the same check, or the engine
            # core rejects the request (a 500 instead of the user's 400).
            if filled.min_tokens > fill:
                raise InvalidRequestError(
                    "min_tokens",
                    f"min_tokens must be <= max_tokens={fill} (the server default, or what "
                    f"fits in the context after the {prompt_len}-token prompt), "
                    f"got {filled.min_tokens}",
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
        ec_transfer_params: dict[str, Any] | None = None,
        commit_mm: bool = True,
    ) -> tuple[EngineCoreRequest, str | None]:
        """Return the engine request and the prompt text (None for token prompts).

        With images, `commit_mm=False` leaves the processor-cache commit to the
        caller, who must call `commit_mm(request)` right before sending it (the
        async frontend processes off the event loop but sends on it, in order).
        """
        if not request_id:
            raise InvalidRequestError("request_id", "request_id must not be empty")
        self.validate_params(params)
        mm_features: list[MultiModalFeatureSpec] | None = None
        mm_data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if mm_data is not None:
            assert isinstance(prompt, dict)
            processed, mm_features = self._process_multimodal(request_id, prompt, mm_data)
        else:
            processed = self.tokenize(prompt)
            self._check_no_placeholders(processed.token_ids)
        try:
            params = self.resolve_max_tokens(params, len(processed.token_ids))
        except ValueError:
            if mm_features is not None and self.mm_frontend is not None:
                self.mm_frontend.discard(request_id)
            raise
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
            mm_features=mm_features,
            ec_transfer_params=ec_transfer_params,
        )
        if mm_features is not None and commit_mm:
            request = self.commit_mm(request)
        return request, processed.text

    # -- images ----------------------------------------------------------------------------
    def commit_mm(self, request: EngineCoreRequest) -> EngineCoreRequest:
        """Settle what of the request's images travels (processor cache); then send at once."""
        if not request.mm_features or self.mm_frontend is None:
            return request
        features = self.mm_frontend.commit(request.request_id, request.mm_features)
        return msgspec.structs.replace(request, mm_features=features)

    def discard_mm(self, request_id: str) -> None:
        """Forget a processed request that will not be sent."""
        if self.mm_frontend is not None:
            self.mm_frontend.discard(request_id)

    def _process_multimodal(
        self, request_id: str, prompt: Mapping[str, Any], mm_data: object
    ) -> tuple[ProcessedPrompt, list[MultiModalFeatureSpec]]:
        mm = self.mm_frontend
        if mm is None:
            raise InvalidRequestError(
                "multi_modal_data",
                "this model is text-only: it does not accept image (or other multimodal) inputs",
            )
        if not isinstance(mm_data, Mapping):
            raise InvalidRequestError(
                "multi_modal_data", "multi_modal_data must be a dict such as {'image': image}"
            )
        for modality in mm_data:
            if modality != "image":
                raise InvalidRequestError(
                    "multi_modal_data",
                    f"modality {modality!r} is not supported by this model (supported: image)",
                )
        raw = mm_data.get("image")
        images = list(raw) if isinstance(raw, list | tuple) else [] if raw is None else [raw]
        try:
            if "prompt_token_ids" in prompt:
                ids = self.check_token_ids(prompt.get("prompt_token_ids"), "prompt_token_ids")
                out = mm.process(request_id, ids, images, add_special_tokens=False)
                text = prompt.get("prompt")
            else:
                text = prompt.get("prompt")
                if not isinstance(text, str):
                    raise InvalidRequestError("prompt", "prompt must be a string")
                add = bool(prompt.get("add_special_tokens", True))
                out = mm.process(request_id, text, images, add_special_tokens=add)
        except InvalidRequestError:
            raise
        except ValueError as e:  # PromptError, MediaError: the message names the problem
            raise InvalidRequestError("multi_modal_data", str(e)) from e
        for tok in out.token_ids:
            if not 0 <= tok < self.vocab_size:
                mm.discard(request_id)
                raise InvalidRequestError(
                    "prompt", f"token id {tok} is out of range [0, {self.vocab_size})"
                )
        return ProcessedPrompt(out.token_ids, text if isinstance(text, str) else None), list(
            out.features
        )

    def _check_no_placeholders(self, token_ids: Sequence[int]) -> None:
        """A multimodal model's prompt may not hold image placeholders without images."""
        mm = self.mm_frontend
        if mm is None:
            return
        proc = mm.processor
        special = {proc.boi_token_id, proc.image_token_id}
        if any(t in special for t in token_ids):
            raise InvalidRequestError(
                "prompt",
                f"the prompt holds image placeholder tokens ({proc.boi_token}) but no images "
                "were given",
            )
