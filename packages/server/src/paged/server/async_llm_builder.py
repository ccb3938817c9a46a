"""The engine and the `AsyncLLM` over it, built from `EngineArgs` and its `EngineConfig`.

What `paged serve` (serve.py), `paged serve --headless` and `paged run-batch`
(batch/engine.py) share, so the three start the same engine: the grammar
recipe for the engine process, the engine-core factory, the client over the
engine process(es), the `AsyncLLM` and the pooling tasks the model serves.
Each caller checks its own flags before calling in (the model loads in
`start_engine_client`).

vLLM 0.33 builds the engine client the same way for `vllm serve` and
`run-batch`: `build_async_engine_client`
(vllm/entrypoints/launchers/api_server/entry.py:35-66), which
vllm/entrypoints/launchers/run_batch.py:1092-1104 calls too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from paged.server.data_parallel import DataParallelOptions, build_engine_client, engines_world_size
from paged.server.engine_args import EngineArgs, tokenizer_path

if TYPE_CHECKING:
    from paged.runner.config import EngineConfig
    from paged.server.async_llm import AsyncLLM
    from paged.server.engine.client import AsyncMPClient
    from paged.server.engine.dp_client import DPLBAsyncClient
    from paged.server.engine.interfaces import EngineCoreFactory
    from paged.server.generation_defaults import GenerationDefaults
    from paged.server.metrics import StatLogger
    from paged.server.mm_frontend import MultiModalFrontend
    from paged.server.openai.pooling_tasks import ModelTasks
    from paged.server.structured_output import GrammarCompiler, StructuredOutputConfig
    from paged.server.tokenizer import TokenizerLike


def structured_outputs_for(
    args: EngineArgs, config: EngineConfig, tokenizer: TokenizerLike
) -> tuple[StructuredOutputConfig | None, GrammarCompiler | None]:
    """The engine's grammar-backend recipe and the API's compiler (None, None: off).

    The engine process builds its grammar backend from the recipe; the API
    process compiles constraints too, to refuse bad ones with a 400. A
    tokenizer llguidance cannot read turns structured outputs off (logged).
    """
    from paged.server.structured_output import (
        GrammarCompiler,
        StructuredOutputConfig,
        try_load_ll_tokenizer,
    )

    so_options = args.structured_output_options()
    mc = config.model_config
    ll_tokenizer = try_load_ll_tokenizer(tokenizer, mc.vocab_size, mc.eos_token_ids)
    if ll_tokenizer is None:
        return None, None
    so_config = StructuredOutputConfig(
        tokenizer_path(config, args.tokenizer),
        mc.vocab_size,
        tuple(mc.eos_token_ids),
        cache_size=so_options.cache_size,
        compile_timeout_s=so_options.compile_timeout_s,
        json_options=so_options.json_options,
        reasoning_parser=args.reasoning_parser_name(),
        enable_in_reasoning=so_options.enable_in_reasoning,
    )
    compiler = GrammarCompiler(
        ll_tokenizer,
        eos_token_ids=mc.eos_token_ids,
        cache_size=so_options.cache_size,
        compile_timeout_s=so_options.compile_timeout_s,
        json_options=so_options.json_options,
    )
    return so_config, compiler


def engine_core_factory_for(
    args: EngineArgs,
    config: EngineConfig,
    tokenizer: TokenizerLike,
    core_options: dict[str, Any],
) -> tuple[EngineCoreFactory, GrammarCompiler | None]:
    """What builds the engine core in its process, and the API's grammar compiler (or None).

    `core_options`: `args.engine_core_options()`, taken by the caller before
    the config is created so that bad options fail first.
    """
    from paged.server.engine.core import make_engine_core_factory

    so_config, compiler = structured_outputs_for(args, config, tokenizer)
    factory = make_engine_core_factory(config, structured_output=so_config, **core_options)
    return factory, compiler


def start_engine_client(
    factory: EngineCoreFactory, config: EngineConfig, data_parallel: DataParallelOptions
) -> AsyncMPClient | DPLBAsyncClient:
    """Start the engine process(es) from `factory` (the model loads here); their client.

    The caller owns the client: it calls `client.shutdown()` when it is done.
    """
    return build_engine_client(
        factory,
        data_parallel,
        device=config.model_config.device,
        world_size=engines_world_size(config),
    )


@dataclass(frozen=True, slots=True)
class FrontendParts:
    """What the `AsyncLLM` is built from besides the engine, all made before the engine
    starts (so a bad file or flag among them fails before the model loads)."""

    tokenizer: TokenizerLike  # with --chat-template applied
    generation_defaults: GenerationDefaults  # --generation-config
    mm_frontend: MultiModalFrontend | None  # a vision model's processor
    grammar_compiler: GrammarCompiler | None  # from `engine_core_factory_for`


def build_async_llm(
    args: EngineArgs,
    config: EngineConfig,
    client: AsyncMPClient | DPLBAsyncClient,
    parts: FrontendParts,
    *,
    stat_loggers: Sequence[StatLogger] = (),
    log_requests: bool = False,
    chat_template: str | None = None,
) -> AsyncLLM:
    """The `AsyncLLM` over a started engine, with the model's limits and defaults.

    `chat_template`: --chat-template's text; without it a cross-encoder's saved score
    template is read (and refused if bad) here, at start-up.
    """
    from paged.server.async_llm import AsyncLLM
    from paged.server.pooling_frontend import PoolingFrontend

    mc = config.model_config
    return AsyncLLM(
        client,
        parts.tokenizer,
        max_model_len=mc.max_model_len,
        vocab_size=mc.vocab_size,
        eos_token_ids=parts.generation_defaults.eos_token_ids_for(mc.eos_token_ids),
        max_logprobs=config.scheduler_limits.max_logprobs,
        stat_loggers=stat_loggers,
        grammar_compiler=parts.grammar_compiler,
        mm_frontend=parts.mm_frontend,
        generation_defaults=parts.generation_defaults,
        log_requests=log_requests,
        pooling=PoolingFrontend.from_model_config(
            mc, args.model_name(), parts.tokenizer, chat_template
        ),
    )


def pooling_tasks_for(
    llm: AsyncLLM, config: EngineConfig, score_template: str | None
) -> ModelTasks:
    """The pooling tasks the API serves: the model's, narrowed by --pooler-config's task.

    `score_template`: --chat-template's text, which renders /score's pairs.
    """
    from paged.server.openai.pooling_tasks import ModelTasks

    mc = config.model_config
    return ModelTasks.from_hf_config(
        mc.hf_config,
        llm.supported_tasks,
        None if mc.pooler_config is None else mc.pooler_config.task,
        score_template=score_template,
        saved_score_template=None if llm.pooling is None else llm.pooling.saved_score_template,
    )
