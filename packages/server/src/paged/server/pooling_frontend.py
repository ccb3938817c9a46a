"""The frontend half of pooling: which tasks a model serves, params, prompts -> engine requests.

Shared by the offline `LLM` (embed/classify/score/encode) and `AsyncLLM.encode`.
vLLM 0.33 references: task checks and their messages
vllm/entrypoints/pooling/offline.py:128-180 and llm.py:461-467; the default
pooling task `ModelConfig.get_pooling_task` (config/model.py:1918-1955);
`truncate_prompt_tokens` (None: no truncation, -1: max_model_len, k: keep k
tokens from the tokenizer's truncation side) and the length errors
vllm/renderers/params.py:255-300, 495-550; cross-encoder segment ids as
`compressed_token_type_ids` (entrypoints/pooling/scoring/io_processor.py:671-682).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from paged.scheduler import EngineCoreRequest, PoolingModelInfo, PoolingParams, SamplingParams
from paged.server.errors import ContextLengthError, InvalidRequestError
from paged.server.input_processor import InputProcessor, ProcessedPrompt, PromptType

if TYPE_CHECKING:
    from paged.runner.config import ModelConfig
    from paged.server.st_score_template import SavedScoreTemplate
    from paged.server.tokenizer import TokenizerLike

# vllm/config/model.py:1940-1947 (without the plugin/compound tasks paged lacks).
_TASK_PRIORITY = ("embed", "classify", "token_embed", "token_classify")
# A pooling request never samples; its SamplingParams only keep the type non-optional.
_POOLING_SAMPLING_PARAMS = SamplingParams(max_tokens=1)


def default_pooling_task(supported: Sequence[str], configured: str | None) -> str | None:
    """vLLM's `get_pooling_task`: the pooler config's task, else the first supported."""
    if configured is not None:
        if configured not in supported:
            raise ValueError(
                f"Unsupported task: {configured!r} Supported tasks: {tuple(supported)}"
            )
        return configured
    return next((t for t in _TASK_PRIORITY if t in supported), None)


def _use_sep_token(hf_config: object) -> bool:
    use_pad = getattr(hf_config, "use_pad_token", None)  # vLLM's deprecated spelling
    return bool(getattr(hf_config, "use_sep_token", True) if use_pad is None else use_pad)


def _gguf_rerank_template(model_config: ModelConfig) -> SavedScoreTemplate | None:
    """A llama.cpp reranker GGUF's rerank prompt (loader/gguf_rank.py) as a score template."""
    from paged.runner.loader.gguf_rank import llama_cpp_rerank_prompt
    from paged.server.st_score_template import SavedScoreTemplate, llama_cpp_rerank_template

    prompt = llama_cpp_rerank_prompt(model_config.weights_path)
    return None if prompt is None else SavedScoreTemplate(llama_cpp_rerank_template(prompt))


def generate_unsupported_message(api: str = "LLM.generate()") -> str:
    """vLLM's message for generation on a pooling model (llm.py:461-467)."""
    return (
        f"{api} is only supported for generative models. "
        "Try passing `--runner generate` to use the model as a generative model."
    )


@dataclass(frozen=True)
class PoolingFrontend:
    """What the frontend knows about the served model's pooling (see the module doc)."""

    supported_tasks: tuple[str, ...]
    runner_type: str
    pooling_task: str | None
    model_info: PoolingModelInfo
    num_labels: int
    is_cross_encoder: bool
    # vLLM's ModelConfig.use_sep_token (config/model.py:2094-2105): False for an LLM
    # used as a reranker, whose query and document are concatenated.
    use_sep_token: bool = True
    # The score template the model brings (st_score_template.py: a sentence-transformers
    # CrossEncoder's saved one, a GGUF reranker's rerank prompt), used when no template
    # is given explicitly.
    saved_score_template: SavedScoreTemplate | None = None

    @classmethod
    def from_model_config(
        cls,
        model_config: ModelConfig,
        served_model_name: str,
        tokenizer: TokenizerLike | None = None,
        chat_template: str | None = None,
    ) -> PoolingFrontend:
        """`tokenizer`: read a cross-encoder's own score template with it (a ValueError
        when a saved one is bad, unless `chat_template`, the explicit one, is given)."""
        from paged.server.pooling_config import pooling_model_info
        from paged.server.st_score_template import saved_score_template

        tasks = model_config.supported_tasks
        pooler = model_config.pooler_config
        pooling_tasks = [t for t in tasks if t != "generate"]
        task = default_pooling_task(pooling_tasks, None if pooler is None else pooler.task)
        hf = model_config.hf_config
        saved = None
        if tokenizer is not None and "classify" in tasks:
            if model_config.weights_format == "gguf":
                saved = _gguf_rerank_template(model_config)
            else:  # vLLM's CrossEncoderIOProcessor (scoring/io_processor.py:463-475)
                saved = saved_score_template(model_config.model, tokenizer, explicit=chat_template)
        return cls(
            supported_tasks=tasks,
            runner_type=model_config.runner_type,
            pooling_task=task,
            model_info=pooling_model_info(model_config, served_model_name),
            num_labels=int(getattr(hf, "num_labels", 0) or 0),
            is_cross_encoder="classify" in tasks,
            use_sep_token=_use_sep_token(hf),
            saved_score_template=saved,
        )

    @property
    def can_pool(self) -> bool:
        return self.pooling_task is not None

    def check_generate(self, api: str = "LLM.generate()") -> None:
        if "generate" not in self.supported_tasks:
            raise ValueError(generate_unsupported_message(api))

    def check_task(self, task: str | None) -> str:
        """vLLM's `_verify_pooling_task` (offline.py:128-180): the task, or ValueError."""
        if not self.can_pool:
            raise ValueError(
                "LLM.encode() is only supported for pooling models. "
                "Try passing `--runner pooling` to use the model as a pooling model."
            )
        if task is None:
            raise ValueError(
                "pooling_task required for `LLM.encode`. Use `LLM.embed(...)` or "
                "pooling_task='embed', `LLM.classify(...)` or pooling_task='classify', "
                "`LLM.score(...)`, pooling_task='token_classify' or 'token_embed'."
            )
        if task in ("embed", "token_embed") and task not in self.supported_tasks:
            raise ValueError(
                "Embedding API is not supported by this model. "
                "Try converting the model using `--convert embed`."
            )
        if task in ("classify", "token_classify") and task not in self.supported_tasks:
            raise ValueError(
                "Classification API is not supported by this model. "
                "Try converting the model using `--convert classify`."
            )
        if task not in self.supported_tasks:
            raise ValueError(f"Unsupported task: {task!r} Supported tasks: {self.supported_tasks}")
        return task

    def resolve_params(self, params: PoolingParams | None, task: str) -> PoolingParams:
        """The request's params for `task`, checked against the model (InvalidRequestError)."""
        params = params if params is not None else PoolingParams()
        if params.task is not None and params.task != task:
            raise InvalidRequestError(
                "task", f"You cannot overwrite params.task={params.task!r} with {task!r}!"
            )
        try:
            return params.with_task(task).verify(self.model_info)
        except ValueError as exc:
            if isinstance(exc, InvalidRequestError):
                raise
            param = next(
                (p for p in ("dimensions", "step_tag_id", "use_activation") if p in str(exc)),
                None,
            )
            raise InvalidRequestError(param, str(exc)) from exc


def check_truncate_prompt_tokens(value: int | None, max_model_len: int) -> int | None:
    """The number of tokens to keep (None: all), or InvalidRequestError (vLLM's message)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise InvalidRequestError(
            "truncate_prompt_tokens",
            f"truncate_prompt_tokens must be -1 or a non-negative integer, got {value!r}",
        )
    if value > max_model_len:
        raise InvalidRequestError(
            "truncate_prompt_tokens",
            f"truncate_prompt_tokens={value} cannot be greater than max_model_len "
            f"= {max_model_len}. Please request a smaller truncation size.",
        )
    return max_model_len if value == -1 else value


def truncate_tokens(ids: list[int], keep: int | None, side: str) -> tuple[list[int], int]:
    """(kept ids, tokens dropped from the left): "left" keeps the last `keep` tokens."""
    if keep is None or keep >= len(ids):
        return ids, 0
    if side == "left":
        return ids[len(ids) - keep :], len(ids) - keep
    return ids[:keep], 0


def check_prompt_length(num_tokens: int, max_model_len: int) -> None:
    """A prompt over max_model_len without truncation: vLLM's message naming the limit."""
    if num_tokens == 0:
        raise InvalidRequestError("prompt", "the prompt must not be empty")
    if num_tokens > max_model_len:
        raise ContextLengthError(
            "input_tokens",
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains {num_tokens} input tokens, which exceeds this limit even without "
            "any output tokens. Please reduce the length of the input prompt.",
        )


def build_pooling_request(
    input_processor: InputProcessor,
    request_id: str,
    prompt: PromptType | ProcessedPrompt,
    params: PoolingParams,
    *,
    truncate_prompt_tokens: int | None = None,
    arrival_time: float | None = None,
    priority: int = 0,
) -> tuple[EngineCoreRequest, str | None]:
    """Tokenize (or take the ids), truncate, check the length: the engine request and text.

    A `ProcessedPrompt` (a cross-encoder pair already tokenized by the caller)
    is taken as is; its segment range must already be in `params.extra_kwargs`.
    """
    if not request_id:
        raise InvalidRequestError("request_id", "request_id must not be empty")
    max_len = input_processor.max_model_len
    keep = check_truncate_prompt_tokens(truncate_prompt_tokens, max_len)
    if isinstance(prompt, ProcessedPrompt):
        processed = prompt
    else:
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            raise InvalidRequestError("prompt", "pooling requests take text or token ids only")
        processed = input_processor.tokenize(prompt)
    side = str(getattr(input_processor.tokenizer, "truncation_side", "right") or "right")
    ids, dropped = truncate_tokens(processed.token_ids, keep, side)
    if dropped and params.extra_kwargs and "compressed_token_type_ids" in params.extra_kwargs:
        start, end = params.extra_kwargs["compressed_token_type_ids"]
        span = [max(int(start) - dropped, 0), max(int(end) - dropped, 0)]
        extra: dict[str, Any] = {**params.extra_kwargs, "compressed_token_type_ids": span}
        params = msgspec.structs.replace(params, extra_kwargs=extra)
    check_prompt_length(len(ids), max_len)
    request = EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=ids,
        sampling_params=_POOLING_SAMPLING_PARAMS,
        eos_token_id=None,
        arrival_time=arrival_time if arrival_time is not None else time.time(),
        priority=priority,
        pooling_params=params,
    )
    return request, processed.text
