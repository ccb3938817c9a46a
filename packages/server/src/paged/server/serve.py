"""`paged serve`: build the engine, the AsyncLLM and the app, and run uvicorn."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING

from paged.server.async_llm_builder import (
    FrontendParts,
    build_async_llm,
    engine_core_factory_for,
    pooling_tasks_for,
    start_engine_client,
)
from paged.server.data_parallel import DataParallelOptions, engines_world_size, run_headless_node
from paged.server.engine_args import EngineArgs, build_frontend_for, tokenizer_path
from paged.server.openai.body_limit import DEFAULT_MAX_REQUEST_BODY_BYTES

if TYPE_CHECKING:
    from paged.server.compat_cli import FrontendOptions
    from paged.server.lora import LoRAModulePath
    from paged.server.openai.cors import CorsConfig
    from paged.server.openai.tools import ToolCallingConfig

logger = logging.getLogger("paged.server.serve")


def run_server(
    args: EngineArgs,
    *,
    host: str,
    port: int,
    api_key: str | None,
    log_level: str = "info",
    cors: CorsConfig | None = None,
    metrics_prefix: str = "paged",
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    tool_config: ToolCallingConfig | None = None,
    data_parallel: DataParallelOptions | None = None,
    frontend: FrontendOptions | None = None,
) -> None:
    """Serve `args`; every option is checked before the engine starts (the model loads).

    `frontend`: vLLM's --chat-template, --enable-log-requests, --uvicorn-log-level.
    """
    import uvicorn

    from paged.server.api_profile import maybe_profile
    from paged.server.compat_cli import FrontendOptions
    from paged.server.metrics import PrometheusStatLogger
    from paged.server.metrics_names import metrics_naming
    from paged.server.openai.api_server import build_app
    from paged.server.openai.responses import ResponseStore, store_enabled_from_env
    from paged.server.openai.tools import ToolCallingConfig, resolve_for_tokenizer
    from paged.server.tokenizer import load_tokenizer

    front = frontend if frontend is not None else FrontendOptions()
    check_listen_address(host, port)  # a port in use fails now, not after the model loads
    naming = metrics_naming(metrics_prefix)  # a bad prefix fails before the model loads
    core_options = args.engine_core_options()  # bad options fail before the model loads
    args.media_url_policy(host)  # bad --allowed-media-domains fail before the model loads
    args.structured_output_options()  # a bad config fails before the model loads
    reasoning_parser = args.reasoning_parser_name()  # so does an unknown parser
    # A bad VLLM_ENABLE_RESPONSES_API_STORE fails before the model loads too.
    responses_store = ResponseStore(enabled=store_enabled_from_env())
    check_lora_modules(args, front.lora_modules)  # before the model loads too
    config = args.create_engine_config()
    mc = config.model_config
    logger.info(
        "model: %s (%s, %s, %s, max_model_len=%d, vocab=%d)",
        mc.model,
        mc.architecture,
        mc.dtype_name,
        mc.device,
        mc.max_model_len,
        mc.vocab_size,
    )
    generation_defaults = args.generation_defaults()  # an unreadable file fails here
    tokenizer = load_tokenizer(tokenizer_path(config, args.tokenizer))
    _log_tokenizer_directory(tokenizer_path(config, args.tokenizer), len(tokenizer))
    if front.chat_template is not None:
        tokenizer.chat_template = front.chat_template  # --chat-template replaces the model's
    # Checked against the chat template now, not by build_app after the model loaded
    # (`--tool-call-parser auto` with a template showing no format fails here).
    resolve_for_tokenizer(tool_config or ToolCallingConfig(), tokenizer)
    # Images: a vision model's processor, loaded before the engine starts (fails fast).
    mm_frontend = build_frontend_for(args, config, bind_host=host)
    factory, compiler = engine_core_factory_for(args, config, tokenizer, core_options)
    parts = FrontendParts(tokenizer, generation_defaults, mm_frontend, compiler)
    dp = data_parallel if data_parallel is not None else DataParallelOptions()
    client = start_engine_client(factory, config, dp)
    try:
        info = client.info
        logger.info(
            "engine ready: %d KV blocks of %d tokens (%.1f MiB, %d tokens of KV cache)",
            info.num_gpu_blocks,
            info.block_size,
            info.kv_cache_memory_bytes / 2**20,
            info.num_gpu_blocks * info.block_size,
        )
        name = args.model_name()
        stats = PrometheusStatLogger(
            name,
            naming=naming,
            kv_cache_metrics=args.kv_cache_metrics,
            kv_connector_metrics=args.has_kv_connector(),
            num_engines=dp.size,
            num_speculative_tokens=(
                config.speculative_config.num_speculative_tokens
                if config.speculative_config is not None
                else 0
            ),
            max_loras=config.lora_config.max_loras if config.lora_config is not None else None,
        )
        llm = build_async_llm(
            args,
            config,
            client,
            parts,
            stat_loggers=[] if args.disable_log_stats else [stats],
            log_requests=front.enable_log_requests,
            chat_template=front.chat_template,
        )
        app = build_app(
            llm,
            model_name=name,
            model_root=mc.model,
            api_key=api_key,
            stat_logger=stats,
            cors=cors,
            max_request_body_bytes=max_request_body_bytes,
            tool_config=tool_config,
            reasoning_parser=reasoning_parser,
            responses_store=responses_store,
            pooling_tasks=pooling_tasks_for(llm, config, front.chat_template),
            lora_modules=front.lora_modules,
        )
        logger.info(
            "serving model %r at http://%s:%d/v1 (API key %s)",
            name,
            host,
            port,
            "required" if api_key else "not required",
        )
        with maybe_profile():  # PAGED_API_PROFILE=PATH; off by default
            uvicorn.run(
                app,
                host=host,
                port=port,
                log_level=front.uvicorn_log_level or log_level,
                timeout_graceful_shutdown=5,
            )
    finally:
        client.shutdown()


def check_lora_modules(args: EngineArgs, modules: Sequence[LoRAModulePath]) -> None:
    """--lora-modules against the other flags and the file system (ValueError)."""
    if not modules:
        return
    if not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    served = args.model_name()
    for module in modules:
        if module.name == served:
            raise ValueError(
                f"--lora-modules: the lora adapter '{module.name}' conflicts with the "
                "served base model name"
            )
        if not os.path.exists(module.path):
            raise ValueError(f"--lora-modules {module.name}: {module.path!r} does not exist")


def check_listen_address(host: str, port: int) -> None:
    """ValueError unless `host:port` can be listened on (vLLM binds before its engine starts).

    A probe, closed at once: uvicorn binds again once the engine is up.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind((host, port))
        except OSError as e:
            raise ValueError(f"--host/--port: cannot listen on {host}:{port}: {e}") from None


def run_headless(args: EngineArgs, data_parallel: DataParallelOptions) -> int:
    """`paged serve --headless`: this node's DP engines, no API server; the exit status."""
    from paged.server.tokenizer import load_tokenizer

    core_options = args.engine_core_options()
    config = args.create_engine_config()
    tokenizer = load_tokenizer(tokenizer_path(config, args.tokenizer))
    factory, _ = engine_core_factory_for(args, config, tokenizer, core_options)
    return run_headless_node(
        factory,
        data_parallel,
        device=config.model_config.device,
        world_size=engines_world_size(config),
    )


def _log_tokenizer_directory(source: str, vocab: int) -> None:
    """Say where a Hugging Face copy of the tokenizer is, for load tools' --tokenizer."""
    from paged.server.tokenizer import tokenizer_directory

    try:
        directory: object = tokenizer_directory(source)
    except (OSError, ValueError) as e:  # no saved copy: say so, serving goes on
        directory = f"{source} (no Hugging Face copy: {e})"
    logger.info("tokenizer: %s (%d tokens)", directory, vocab)
