"""LLM: offline batch generation in-process (seed: LLM entry point).

LLM.generate(prompts) -> InputProcessor -> InprocClient.add_request (no IPC)
loop: InprocClient.get_output() (one engine step) -> OutputProcessor
-> finished RequestOutputs, in prompt order, with a tqdm progress bar.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Generator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import msgspec
from tqdm import tqdm

from paged.scheduler import PoolingParams, RequestOutputKind, SamplingParams
from paged.server.chat_utils import apply_chat_template, collect_image_urls
from paged.server.client_protocols import NoEngineUtilities, SyncEngineClient, SyncUtilityClient
from paged.server.engine_args import EngineArgs, build_frontend_for, tokenizer_path
from paged.server.errors import InvalidRequestError
from paged.server.generation_defaults import GenerationDefaults
from paged.server.input_processor import InputProcessor, ProcessedPrompt, PromptType, TextPrompt
from paged.server.lora import LoRARegistry, LoRARequest
from paged.server.output_processor import OutputProcessor
from paged.server.outputs import RequestOutput
from paged.server.parent import fan_out
from paged.server.pooling_frontend import PoolingFrontend, build_pooling_request
from paged.server.pooling_outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringRequestOutput,
)
from paged.server.structured_output.compiler import GrammarCompiler
from paged.server.structured_output.validate import check_compiles
from paged.server.tokenizer import TokenizerLike, load_tokenizer

if TYPE_CHECKING:
    from paged.server.mm_frontend import MultiModalFrontend

logger = logging.getLogger(__name__)
ChatMessages = Sequence[Mapping[str, Any]]


class LLM:
    """Generate for a batch of prompts with one engine in this process.

    `LLM()` loads the default model; `LLM(model, **engine_options)` takes the
    options of `EngineArgs` (`max_model_len`, `kv_cache_memory_bytes`, ...).
    """

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        from paged.server.engine.client import InprocClient
        from paged.server.engine.core import make_engine_core_factory

        args = EngineArgs(model=model, **engine_options)
        core_options = args.engine_core_options()  # bad options fail before the model loads
        so_options = args.structured_output_options()
        reasoning_parser = args.reasoning_parser_name()  # an unknown parser fails here too
        # --generation-config (vLLM's LLM: the defaults when no sampling_params are given).
        generation_defaults = args.generation_defaults()
        config = args.create_engine_config()
        from paged.server.reasoning import REASONING_SPECS, ReasoningEndDetector
        from paged.server.structured_output import (
            GrammarCompiler,
            StructuredOutputBackend,
            try_load_ll_tokenizer,
        )

        tokenizer = load_tokenizer(tokenizer_path(config, args.tokenizer))
        mc = config.model_config
        # In-process engine: the backend is handed over as is, and its compiler
        # (with its cache) also checks constraints as requests are added.
        # A tokenizer llguidance cannot read turns structured outputs off (logged).
        ll_tokenizer = try_load_ll_tokenizer(tokenizer, mc.vocab_size, mc.eos_token_ids)
        backend = None
        if ll_tokenizer is not None:
            backend = StructuredOutputBackend(
                GrammarCompiler(
                    ll_tokenizer,
                    eos_token_ids=mc.eos_token_ids,
                    cache_size=so_options.cache_size,
                    compile_timeout_s=so_options.compile_timeout_s,
                    json_options=so_options.json_options,
                ),
                reasoning=(
                    ReasoningEndDetector(REASONING_SPECS[reasoning_parser], tokenizer)
                    if reasoning_parser is not None and not so_options.enable_in_reasoning
                    else None
                ),
            )
        mm_frontend = build_frontend_for(args, config)
        client = InprocClient.from_factory(
            make_engine_core_factory(config, structured_output=backend, **core_options)
        )
        self._setup(
            client,
            tokenizer,
            mc.max_model_len,
            mc.vocab_size,
            generation_defaults.eos_token_ids_for(mc.eos_token_ids),
            config.scheduler_limits.max_logprobs,
            None if backend is None else backend.compiler,
            mm_frontend,
            PoolingFrontend.from_model_config(mc, args.model_name(), tokenizer),
        )
        self.generation_defaults = generation_defaults

    @classmethod
    def from_engine_client(
        cls,
        client: SyncEngineClient,
        tokenizer: TokenizerLike,
        *,
        max_model_len: int,
        vocab_size: int | None = None,
        eos_token_ids: Sequence[int] = (),
        max_logprobs: int = 20,
        grammar_compiler: GrammarCompiler | None = None,
        mm_frontend: MultiModalFrontend | None = None,
        generation_defaults: GenerationDefaults | None = None,
        pooling: PoolingFrontend | None = None,
    ) -> LLM:
        """An `LLM` over an existing engine client (tests, custom engines)."""
        self = cls.__new__(cls)
        self._setup(
            client,
            tokenizer,
            max_model_len,
            vocab_size,
            eos_token_ids,
            max_logprobs,
            grammar_compiler,
            mm_frontend,
            pooling,
        )
        self.generation_defaults = generation_defaults or GenerationDefaults()
        return self

    def _setup(
        self,
        client: SyncEngineClient,
        tokenizer: TokenizerLike,
        max_model_len: int,
        vocab_size: int | None,
        eos_token_ids: Sequence[int],
        max_logprobs: int,
        grammar_compiler: GrammarCompiler | None = None,
        mm_frontend: MultiModalFrontend | None = None,
        pooling: PoolingFrontend | None = None,
    ) -> None:
        self.engine_client = client
        # What the model pools (None: a generative model without a pooler).
        self.pooling = pooling
        self.grammar_compiler = grammar_compiler
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.input_processor = InputProcessor(
            tokenizer,
            max_model_len=max_model_len,
            vocab_size=vocab_size,
            eos_token_ids=eos_token_ids,
            max_logprobs=max_logprobs,
            mm_frontend=mm_frontend,
        )
        self.output_processor = OutputProcessor(tokenizer)
        self._counter = itertools.count()
        self.loras = LoRARegistry()  # adapters this LLM loaded on its engine

    def get_tokenizer(self) -> TokenizerLike:
        return self.tokenizer

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        """vLLM's `LLM.supported_tasks` ("generate", or the pooler's tasks)."""
        return ("generate",) if self.pooling is None else self.pooling.supported_tasks

    def _check_generate(self, api: str) -> None:
        if self.pooling is not None:
            self.pooling.check_generate(api)

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the generation config's defaults (--generation-config), else the neutral ones."""
        return SamplingParams(**self.generation_defaults.sampling)

    def reset_prefix_cache(self) -> bool:
        """Drop the engine's cached prefix blocks; False while running requests hold blocks."""
        return bool(self._utility_client().call_utility("reset_prefix_cache"))

    def _utility_client(self) -> SyncUtilityClient:
        client = self.engine_client
        if not isinstance(client, SyncUtilityClient):
            raise NoEngineUtilities(client)
        return client

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order.

        `lora_request`: one adapter for every prompt, or one per prompt (vLLM's
        argument); each is loaded on the engine the first time its name is seen.
        """
        self._check_generate("LLM.generate()")
        batch = _as_batch(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _per_prompt(sampling_params, len(batch))
        loras = _per_prompt_lora(lora_request, len(batch))
        for adapter in dict.fromkeys(x for x in loras if x is not None):
            self._ensure_lora(adapter)
        ids: list[str] = []
        try:
            for prompt, p, lora in zip(batch, params, loras, strict=True):
                ids.append(self._add_request(prompt, p, lora=lora))
        except BaseException:
            self._abort(ids)
            raise
        return self._run_engine(ids, use_tqdm)

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a batch of conversations.

        `tools` (OpenAI's `{"type": "function", "function": {...}}` items, as
        vLLM's `LLM.chat`) are checked and handed to the chat template; the
        replies are text: parse tool calls with a `paged.server.tool_parsers` parser.
        """
        from paged.server.openai.tools import parse_tools

        self._check_generate("LLM.chat()")
        single = bool(messages) and isinstance(messages[0], Mapping)
        conversations = cast(Sequence[ChatMessages], [messages] if single else messages)
        tool_dicts = [t.template_dict() for t in parse_tools([dict(t) for t in tools or ()])]
        prompts: list[PromptType] = []
        mm = self.input_processor.mm_frontend
        for conv in conversations:
            urls = collect_image_urls(conv)
            if urls and mm is None:
                raise InvalidRequestError(
                    "messages", "this model is text-only: it does not accept image inputs"
                )
            text = apply_chat_template(
                self.tokenizer,
                conv,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template=chat_template,
                chat_template_kwargs=chat_template_kwargs,
                tools=tool_dicts or None,
                allow_images=mm is not None,
            )
            prompt: TextPrompt = {"prompt": text, "add_special_tokens": False}
            if urls and mm is not None:
                mm.check_counts({"image": len(urls)}, "messages")
                prompt["multi_modal_data"] = {"image": mm.load_images(urls)}
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stream(
        self, prompt: PromptType, sampling_params: SamplingParams | None = None
    ) -> Generator[RequestOutput, None, None]:
        """Generate for one prompt, yielding delta outputs as the engine steps.

        Must be the only request in flight on this `LLM`; closing the iterator
        early aborts the request.
        """
        if self.output_processor.has_unfinished_requests():
            raise RuntimeError("stream() needs an idle LLM: other requests are in flight")
        params = (
            sampling_params if sampling_params is not None else self.get_default_sampling_params()
        )
        rid = self._add_request(prompt, params, RequestOutputKind.DELTA)
        finished = False
        try:
            while not finished:
                if not self.engine_client.has_work():
                    raise RuntimeError("the engine has no work left but the request is unfinished")
                outputs = self.engine_client.get_output()
                processed = self.output_processor.process_outputs(outputs.outputs)
                if processed.reqs_to_abort:
                    self.engine_client.abort_requests(processed.reqs_to_abort)
                for out in processed.request_outputs:
                    finished = out.finished
                    yield out
        finally:
            if not finished:
                self._abort([rid])

    def _add_request(
        self,
        prompt: PromptType,
        params: SamplingParams,
        kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
        *,
        lora: LoRARequest | None = None,
    ) -> str:
        rid = str(next(self._counter))
        params = msgspec.structs.replace(params, output_kind=kind)
        if params.structured_outputs is not None:
            check_compiles(self.grammar_compiler, params)
        request, text = self.input_processor.process_inputs(rid, prompt, params)
        if lora is not None:
            request = msgspec.structs.replace(
                request, lora_request=lora.lora_name, lora_path=lora.lora_path
            )
        parent, requests = fan_out(request)
        for i, req in enumerate(requests):
            self.output_processor.add_request(req, text, parent, i)
        for req in requests:
            self.engine_client.add_request(req)
        return rid

    def _ensure_lora(self, lora: LoRARequest) -> None:
        """Load `lora` on the engine unless this LLM did (InvalidRequestError naming the cause)."""
        if self.loras.check_same(lora):
            return
        client = self._utility_client()
        try:
            client.call_utility("add_lora", lora.lora_name, lora.lora_path, lora.lora_int_id)
        except ValueError as exc:
            raise InvalidRequestError("lora_request", str(exc)) from exc
        self.loras.record_loaded(lora)

    # -- pooling (vllm/entrypoints/pooling/offline.py) -----------------------------------

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        use_tqdm: bool = True,
        pooling_task: str | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[PoolingRequestOutput[PoolingOutput]]:
        """Pool every prompt's final hidden states for `pooling_task`; outputs in prompt order."""
        pooling = self._require_pooling()
        task = pooling.check_task(pooling_task)
        batch = _as_batch(prompts)
        if not batch:
            raise InvalidRequestError("prompts", "prompts must not be empty")
        params = _per_prompt_pooling(pooling_params, len(batch))
        ids: list[str] = []
        try:
            for prompt, p in zip(batch, params, strict=True):
                ids.append(
                    self._add_pooling_request(
                        prompt, pooling.resolve_params(p, task), truncate_prompt_tokens
                    )
                )
        except BaseException:
            self._abort(ids)
            raise
        return self._run_pooling(ids, use_tqdm)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (vLLM's `LLM.embed`)."""
        items = self.encode(
            prompts,
            pooling_params,
            use_tqdm=use_tqdm,
            pooling_task="embed",
            truncate_prompt_tokens=truncate_prompt_tokens,
        )
        return [EmbeddingRequestOutput.from_base(item) for item in items]

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (vLLM's `LLM.classify`)."""
        items = self.encode(
            prompts,
            pooling_params,
            use_tqdm=use_tqdm,
            pooling_task="classify",
            truncate_prompt_tokens=truncate_prompt_tokens,
        )
        return [ClassificationRequestOutput.from_base(item) for item in items]

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        /,
        *,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
        truncate_prompt_tokens: int | None = None,
        chat_template: str | None = None,
    ) -> list[ScoringRequestOutput]:
        """Scores of text pairs, 1:1, 1:N or N:N (vLLM's `LLM.score`).

        `chat_template`: a cross-encoder's score template (e.g. Qwen3-Reranker's),
        rendered with the messages `query` and `document` (paged.server.score_prompt).
        """
        from paged.server.pooling_offline import run_score

        return run_score(
            self,
            self._require_pooling(),
            data_1,
            data_2,
            use_tqdm,
            pooling_params,
            truncate_prompt_tokens,
            chat_template,
        )

    def _require_pooling(self) -> PoolingFrontend:
        if self.pooling is None or not self.pooling.can_pool:
            raise ValueError(
                "LLM.encode() is only supported for pooling models. "
                "Try passing `--runner pooling` to use the model as a pooling model."
            )
        return self.pooling

    def _add_pooling_request(
        self,
        prompt: PromptType | ProcessedPrompt,
        params: PoolingParams,
        truncate_prompt_tokens: int | None,
    ) -> str:
        rid = str(next(self._counter))
        request, text = build_pooling_request(
            self.input_processor,
            rid,
            prompt,
            params,
            truncate_prompt_tokens=truncate_prompt_tokens,
        )
        self.output_processor.add_request(request, text)
        self.engine_client.add_request(request)
        return rid

    def _run_pooling(
        self, ids: list[str], use_tqdm: bool
    ) -> list[PoolingRequestOutput[PoolingOutput]]:
        done = self._run_until_finished(ids, use_tqdm)
        out: list[PoolingRequestOutput[PoolingOutput]] = []
        for rid in ids:
            item = done[rid]
            assert isinstance(item, PoolingRequestOutput)
            if item.error is not None:
                raise RuntimeError(f"pooling request {rid} failed: {item.error}")
            out.append(item)
        return out

    def _abort(self, ids: list[str]) -> None:
        engine_ids = self.output_processor.abort_requests(ids)
        if engine_ids:
            self.engine_client.abort_requests(engine_ids)

    def _run_engine(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done = self._run_until_finished(ids, use_tqdm)
        return [cast(RequestOutput, done[rid]) for rid in ids]

    def _run_until_finished(
        self, ids: list[str], use_tqdm: bool
    ) -> dict[str, RequestOutput | PoolingRequestOutput[PoolingOutput]]:
        """Step the engine until every request in flight finished (generation and pooling
        requests alike: one engine batches both)."""
        finished: dict[str, RequestOutput | PoolingRequestOutput[PoolingOutput]] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, unit="req")
        try:
            while self.output_processor.has_unfinished_requests():
                if not self.engine_client.has_work():
                    raise RuntimeError(
                        "the engine has no work left but requests are unfinished; "
                        "this is a bug in the engine"
                    )
                outputs = self.engine_client.get_output()
                processed = self.output_processor.process_outputs(outputs.outputs)
                if processed.reqs_to_abort:
                    self.engine_client.abort_requests(processed.reqs_to_abort)
                for out in processed.request_outputs:
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
                for pooled in processed.pooling_outputs:
                    finished[pooled.request_id] = pooled
                    bar.update(1)
        except BaseException:
            self._abort(ids)
            raise
        finally:
            bar.close()
        return finished

    def shutdown(self) -> None:
        self.engine_client.shutdown()
        if self.input_processor.mm_frontend is not None:
            self.input_processor.mm_frontend.close()  # shm segments

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _as_batch(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, str | dict):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt of token ids
    return list(prompts)  # type: ignore[arg-type]


def _per_prompt_pooling(
    params: PoolingParams | Sequence[PoolingParams] | None, n: int
) -> list[PoolingParams | None]:
    if params is None or isinstance(params, PoolingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(
            f"pooling_params: got {len(params)} for {n} prompts; give one or one per prompt"
        )
    return list(params)


def _per_prompt_lora(
    lora: LoRARequest | Sequence[LoRARequest] | None, n: int
) -> list[LoRARequest | None]:
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * n
    if len(lora) != n:
        raise InvalidRequestError(
            "lora_request",
            f"lora_request: got {len(lora)} for {n} prompts; give one or one per prompt",
        )
    return list(lora)


def _per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(
            f"sampling_params: got {len(params)} for {n} prompts; give one or one per prompt"
        )
    return list(params)
