"""The engine behind `run-batch`: what `paged serve` builds (both through
async_llm_builder.py), without the HTTP server.

Every option is checked before the model loads (as `run_server` does); the
requests then go through the same `OpenAIServing` as the API's, so a batch
line gets exactly the response body a POST would.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from paged.server.engine_args import EngineArgs

if TYPE_CHECKING:  # imported in batch_serving: `paged run-batch --help` stays fast
    from paged.server.openai.pooling_tasks import ModelTasks
    from paged.server.openai.serving import OpenAIServing
    from paged.server.openai.serving_pooling import PoolingServing
    from paged.server.openai.tools import ToolCallingConfig

logger = logging.getLogger(__name__)

# vLLM's default --max-inflight: twice max_num_seqs, at least 1024 (run_batch.py:1063-1068).
MIN_DEFAULT_INFLIGHT = 1024


def default_max_inflight(args: EngineArgs) -> int:
    return max(MIN_DEFAULT_INFLIGHT, 2 * args.max_num_seqs)


@dataclass(frozen=True, slots=True)
class BatchServing:
    """The handlers a batch line can reach: generation, pooling, and what the model serves."""

    openai: OpenAIServing
    pooling: PoolingServing
    tasks: ModelTasks


@contextlib.contextmanager
def batch_serving(
    args: EngineArgs,
    *,
    tool_config: ToolCallingConfig | None = None,
    chat_template: str | None = None,
) -> Iterator[BatchServing]:
    """The API's handlers over a started engine; the engine stops on exit.

    `tool_config`: vLLM's tool flags; `chat_template`: --chat-template's text.
    """
    from paged.server.async_llm_builder import (
        FrontendParts,
        build_async_llm,
        engine_core_factory_for,
        pooling_tasks_for,
        start_engine_client,
    )
    from paged.server.data_parallel import DataParallelOptions
    from paged.server.engine_args import build_frontend_for, tokenizer_path
    from paged.server.openai.serving import OpenAIServing
    from paged.server.openai.serving_pooling import PoolingServing
    from paged.server.openai.tools import ToolCallingConfig, resolve_for_tokenizer
    from paged.server.reasoning import make_reasoning_parser
    from paged.server.tokenizer import load_tokenizer

    tools = tool_config if tool_config is not None else ToolCallingConfig()
    core_options = args.engine_core_options()  # bad options fail before the model loads
    args.structured_output_options()
    reasoning = make_reasoning_parser(args.reasoning_parser_name())
    generation_defaults = args.generation_defaults()
    config = args.create_engine_config()
    tokenizer = load_tokenizer(tokenizer_path(config, args.tokenizer))
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    # As `paged serve`: the generic tool format when the template ignores tools.
    tool_flags = resolve_for_tokenizer(tools, tokenizer)
    mm_frontend = build_frontend_for(args, config)
    factory, compiler = engine_core_factory_for(args, config, tokenizer, core_options)
    parts = FrontendParts(tokenizer, generation_defaults, mm_frontend, compiler)
    client = start_engine_client(factory, config, DataParallelOptions())
    llm = build_async_llm(args, config, client, parts, chat_template=chat_template)
    tasks = pooling_tasks_for(llm, config, chat_template)
    try:
        yield BatchServing(
            OpenAIServing(llm, args.model_name(), tool_flags, reasoning),
            PoolingServing(llm, args.model_name(), tasks),
            tasks,
        )
    finally:
        llm.shutdown()
        client.shutdown()
