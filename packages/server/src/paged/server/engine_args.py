"""`EngineArgs`: the user-facing engine options (CLI flags, `LLM(...)` kwargs).

`create_engine_config()` turns them into the runner's `EngineConfig`
(validated there, with errors naming the option). Heavy imports (torch,
the runner) happen only when a config is built.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paged.server.tokenizer import DEFAULT_MODEL_NAME

if TYPE_CHECKING:
    from paged.connectors.events import KVEventsConfig
    from paged.multimodal.media import MediaLimits
    from paged.multimodal.media_url_policy import MediaUrlPolicy
    from paged.runner.config import (
        EngineConfig,
        ExecutorBackend,
        ModelConfig,
        RayPlacementStrategy,
    )
    from paged.runner.lora.config import LoRAConfig
    from paged.server.generation_defaults import GenerationDefaults
    from paged.server.mm_frontend import MultiModalEngineOptions, MultiModalFrontend
    from paged.server.structured_output.options import StructuredOutputOptions

logger = logging.getLogger(__name__)

# On CUDA: the fraction of the device the engine may use when not given.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


@dataclass
class EngineArgs:
    model: str | None = None  # None: the default SmolLM2-135M-Instruct GGUF
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    device: str = "auto"  # "auto": cuda when available, else cpu
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    # vLLM's --kv-cache-dtype (paged.runner.kv_cache_dtype): auto, float16, bfloat16, fp8*.
    kv_cache_dtype: str = "auto"
    # None: DEFAULT_GPU_MEMORY_UTILIZATION on CUDA; ignored on CPU (a warning when given).
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # vLLM's --scheduling-policy: "fcfs", or "priority" (requests' `priority`, lower first).
    scheduling_policy: str = "fcfs"
    # vLLM's --long-prefill-token-threshold (0: no cap) and -adaptive (vLLM 0.33).
    long_prefill_token_threshold: int = 0
    long_prefill_token_threshold_adaptive: bool = False
    tensor_parallel_size: int = 1
    # paged's --cpu-threads: threads per CPU rank (None: paged.runner.cpu_threads decides).
    cpu_threads: int | None = None
    # vLLM's --pipeline-parallel-size: decoder layers split over this many stages.
    pipeline_parallel_size: int = 1
    # vLLM's --distributed-executor-backend ("uni" | "mp" | "ray"; None: mp for TP > 1).
    distributed_executor_backend: ExecutorBackend | None = None
    # The "ray" backend's placement-group strategy (PACK | SPREAD | STRICT_*).
    ray_placement_strategy: RayPlacementStrategy = "PACK"
    # vLLM's --nnodes/--node-rank/--master-addr/--master-port (the "mp" backend over nodes).
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int = 29501
    max_logprobs: int = 20
    seed: int = 0
    enforce_eager: bool = False
    attention_backend: str = "auto"
    cpu_weight_panels: str = "auto"  # "auto" | "on" | "off"
    # vLLM's --quantization; None: "gguf" for a quantized GGUF on CPU (see ModelConfig).
    quantization: str | None = None
    # vLLM's --kv-events-config; goes to EngineCore itself, not into EngineConfig.
    kv_events_config: KVEventsConfig | None = None
    # vLLM's --async-scheduling: the engine core keeps two batches in flight
    # (EngineCore batch_queue_size=2) and schedules step N+1 while N runs.
    async_scheduling: bool = False
    # vLLM's --kv-cache-metrics / --kv-cache-metrics-sample: sampled block
    # residency histograms (lifetime, idle before evict, reuse gaps).
    kv_cache_metrics: bool = False
    kv_cache_metrics_sample: float = 0.01
    # vLLM's --structured-outputs-config (JSON text or a dict); None: the defaults.
    structured_outputs_config: str | dict[str, Any] | None = None

    # vLLM's --reasoning-parser (deepseek_r1, qwen3, think; None/"none": off).
    reasoning_parser: str | None = None

    def reasoning_parser_name(self) -> str | None:
        """The reasoning parser in use: the flag, else the structured-outputs key (ValueError)."""
        from paged.server.reasoning import check_reasoning_parser

        return check_reasoning_parser(self.reasoning_parser) or (
            self.structured_output_options().reasoning_parser
        )

    def structured_output_options(self) -> StructuredOutputOptions:
        """Parsed `structured_outputs_config` (ValueError naming a bad key)."""
        from paged.server.structured_output.options import (
            StructuredOutputOptions,
            parse_structured_outputs_config,
        )

        if self.structured_outputs_config is None:
            return StructuredOutputOptions()
        return parse_structured_outputs_config(self.structured_outputs_config)

    # Multimodal (vLLM's flags): '{"image": 2}' or a dict; None: vLLM's default per modality.
    limit_mm_per_prompt: str | dict[str, int] | None = None
    # Directory file:// image URLs may read from; None refuses file:// URLs.
    allowed_local_media_path: str | None = None
    # vLLM's --allowed-media-domains: the only hostnames http(s) media is fetched
    # from (exact match); None: any. A server listening beyond loopback also refuses
    # internal addresses unless their hostname is listed (see mm_frontend.media_url_policy).
    allowed_media_domains: list[str] | None = None
    # vLLM's --mm-processor-cache-type (lru, shm; here also processor_only, none) and
    # --mm-processor-cache-gb (GiB; 0 disables it).
    mm_processor_cache_type: str = "lru"
    mm_processor_cache_gb: float = 4.0
    disable_chunked_mm_input: bool = False

    def mm_engine_options(self) -> MultiModalEngineOptions:
        """The engine core's multimodal options; one shm prefix per `EngineArgs` (per server)."""
        from paged.multimodal.processor_cache import ProcessorCacheConfig, new_shm_prefix
        from paged.server.mm_frontend import MultiModalEngineOptions

        if self._shm_prefix is None:
            self._shm_prefix = new_shm_prefix()
        return MultiModalEngineOptions(
            processor_cache=ProcessorCacheConfig(
                self.mm_processor_cache_type, self.mm_processor_cache_gb, self._shm_prefix
            ),
            disable_chunked_mm_input=self.disable_chunked_mm_input,
        )

    def media_url_policy(self, bind_host: str | None = None) -> MediaUrlPolicy:
        """The http(s) media policy for a server on `bind_host` (None: in-process `LLM`).

        Reads vLLM's VLLM_MEDIA_URL_ALLOW_REDIRECTS; ValueError naming a bad domain or value.
        """
        from paged.server.mm_frontend import media_url_policy

        return media_url_policy(self.allowed_media_domains, bind_host, os.environ)

    def media_limits(self) -> MediaLimits:
        """Fetch and decode limits, with vLLM's VLLM_IMAGE_FETCH_TIMEOUT applied."""
        from paged.server.mm_frontend import media_limits_from_env

        return media_limits_from_env(os.environ)

    def engine_core_options(self) -> dict[str, Any]:
        """The `EngineCore` keyword arguments these options select (see engine/options.py)."""
        from paged.server.engine.options import engine_core_options

        options = engine_core_options(
            async_scheduling=self.async_scheduling,
            kv_cache_metrics=self.kv_cache_metrics,
            kv_cache_metrics_sample=self.kv_cache_metrics_sample,
        )
        self.check_compat_options()
        options["log_stats"] = not self.disable_log_stats
        options["kv_events_config"] = self.kv_events_config
        options["mm_options"] = self.mm_engine_options()
        from paged.server.mm_frontend import parse_limit_mm_per_prompt

        parse_limit_mm_per_prompt(self.limit_mm_per_prompt)  # a bad value fails before loading
        self.media_url_policy()  # a bad domain or env value too
        self.media_limits()
        return options

    # vLLM's --kv-transfer-config: JSON text (or a dict from LLM(...)); None: no connector.
    kv_transfer_config: str | dict[str, Any] | None = None
    # vLLM's --kv-offloading-size (GiB, all ranks together) / --kv-offloading-backend:
    # a host-memory OffloadingConnector without writing the JSON.
    kv_offloading_size: float | None = None
    kv_offloading_backend: str = "native"
    # Seed of the block-hash chain (NONE_HASH), independent of `seed`. None:
    # vLLM 0.33's rule (PYTHONHASHSEED, else a fixed seed for sha256): engines that
    # share stored KV (a disk tier across restarts, P/D peers) must hash alike.
    block_hash_seed: int | None = None
    # vLLM's --prefix-caching-hash-algo: sha256 (default), sha256_cbor, xxhash,
    # xxhash_cbor (vLLM's bytes), or paged's own paged_sha256 / paged_xxhash.
    prefix_caching_hash_algo: str = "sha256"
    # vLLM's --speculative-config: JSON text (or a dict from LLM(...)); None: no speculation.
    speculative_config: str | dict[str, Any] | None = None
    # vLLM's --ec-transfer-config (encoder-cache connector): JSON text or a dict; None: none.
    ec_transfer_config: str | dict[str, Any] | None = None
    # vLLM 0.33's model flags (compat_cli.py): --tokenizer-mode (auto/hf only),
    # --trust-remote-code (accepted; no remote code runs), --generation-config
    # (auto/vllm/DIR: request defaults), --disable-log-stats (no engine statistics).
    tokenizer_mode: str = "auto"
    trust_remote_code: bool = False
    generation_config: str = "auto"
    disable_log_stats: bool = False
    # vLLM 0.33's --runner (auto/generate/pooling/draft), --convert (auto/none/embed/
    # classify) and --pooler-config (JSON text or a dict): see paged.runner.runner_type.
    runner: str = "auto"
    convert: str = "auto"
    pooler_config: str | dict[str, Any] | None = None
    # vLLM's --hf-overrides (JSON text or a dict): set on the HF config before it is read.
    hf_overrides: str | dict[str, Any] | None = None
    # vLLM's LoRA flags (paged.server.lora_cli): adapters on the base model.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"
    _shm_prefix: str | None = field(default=None, repr=False)

    def check_compat_options(self) -> None:
        """The vLLM flags above, checked for `LLM(...)` callers as the CLI checks them."""
        from paged.server.compat_cli import SUPPORTED_TOKENIZER_MODES
        from paged.server.generation_defaults import GENERATION_CONFIG_NAME

        if self.tokenizer_mode not in SUPPORTED_TOKENIZER_MODES:
            raise ValueError(
                f"tokenizer_mode: {self.tokenizer_mode!r} is not supported; use "
                f"{' or '.join(SUPPORTED_TOKENIZER_MODES)}"
            )
        source = self.generation_config
        if source not in ("auto", "vllm") and not (Path(source) / GENERATION_CONFIG_NAME).is_file():
            raise ValueError(
                f"generation_config: {source!r} is neither 'auto', 'vllm' nor a directory "
                f"holding {GENERATION_CONFIG_NAME}"
            )

    def generation_defaults(self) -> GenerationDefaults:
        """What `--generation-config` gives requests that leave fields out (reads files only)."""
        from paged.server.generation_defaults import load_generation_defaults

        return load_generation_defaults(self.model, self.generation_config)

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def _kv_cache_bytes(self, device: str) -> int | None:
        """--kv-cache-memory, else on CPU paged.server.cpu_memory's default (None on CUDA:
        the runner profiles the device under --gpu-memory-utilization)."""
        if device != "cpu":
            return self.kv_cache_memory_bytes
        if self.gpu_memory_utilization is not None:
            logger.warning(
                "--gpu-memory-utilization is ignored on CPU; the KV cache budget is "
                "--kv-cache-memory, else VLLM_CPU_KVCACHE_SPACE (GiB), else a quarter of the "
                "available memory"
            )
        if self.kv_cache_memory_bytes is not None:
            return self.kv_cache_memory_bytes
        from paged.server.cpu_memory import cpu_kv_cache_bytes

        kv_bytes, source = cpu_kv_cache_bytes()
        logger.info("CPU KV cache budget: %.2f GiB (%s)", kv_bytes / 2**30, source)
        return kv_bytes

    def model_name(self) -> str:
        """The name clients use in `model`: the served name, else the model as given."""
        if self.served_model_name:
            return self.served_model_name
        return DEFAULT_MODEL_NAME if self.model is None else self.model

    def create_engine_config(self) -> EngineConfig:
        from paged.runner.config import (
            CacheConfig,
            EngineConfig,
            ModelConfig,
            ParallelConfig,
            SchedulerLimits,
        )
        from paged.runner.kv_cache_dtype import check_kv_cache_dtype
        from paged.server.ec_transfer import ec_connector_builder
        from paged.server.kv_transfer import kv_connector_builder

        check_kv_cache_dtype(self.kv_cache_dtype)  # before the model loads
        # Validated first: a bad connector config must stop start-up before the model loads.
        kv_connector = kv_connector_builder(
            self._kv_transfer_config(),
            self.block_size,
            model_name=self.model_name(),
            world_size=self.tensor_parallel_size,
        )
        ec_connector = ec_connector_builder(self.ec_transfer_config, model_name=self.model_name())
        if kv_connector is not None and self.kv_cache_dtype.startswith("fp8"):
            # The connectors move blocks with index_copy_, which torch lacks for fp8 on CPU;
            # refused until they move fp8 blocks as bytes.
            raise ValueError(
                f"kv_cache_dtype: {self.kv_cache_dtype!r} is not supported with a KV connector "
                "(kv_transfer_config / kv_offloading_size) yet; use auto, float16 or bfloat16"
            )
        lora_config = self.lora_config()  # before the model loads
        device = self.resolved_device()
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(
                f"attention_backend: {self.attention_backend!r} is unknown; use auto, torch, triton"
            )
        from paged.runner.hf_overrides import parse_hf_overrides
        from paged.server.pooling_config import parse_pooler_config

        pooler_override = parse_pooler_config(self.pooler_config)  # before the model loads
        hf_overrides = parse_hf_overrides(self.hf_overrides)
        model_config = ModelConfig.from_pretrained(
            self.model,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            device=device,
            attention_backend=self.attention_backend,  # type: ignore[arg-type]
            enforce_eager=self.enforce_eager,
            cpu_weight_panels=self.cpu_weight_panels,  # type: ignore[arg-type]
            quantization=self.quantization,
            runner=self.runner,
            convert=self.convert,
            pooler_config=pooler_override,
            hf_overrides=hf_overrides,
        )
        from paged.server.pooling_config import pooling_scheduler_settings
        from paged.server.speculative import resolve_speculative_config

        chunked, prefix_caching, batched_tokens = pooling_scheduler_settings(
            model_config,
            enable_chunked_prefill=self.enable_chunked_prefill,
            enable_prefix_caching=self.enable_prefix_caching,
            max_num_batched_tokens=self.max_num_batched_tokens,
        )

        if self.speculative_config is not None and self.async_scheduling:
            raise ValueError("speculative_config: not supported with async_scheduling")
        speculative_config = resolve_speculative_config(self.speculative_config, model_config)
        if ec_connector is not None:
            _check_ec_model(model_config)
        kv_bytes = self._kv_cache_bytes(device)
        if model_config.is_encoder_only and self.kv_cache_memory_bytes is None:
            # No KV cache: the encoder's runner sizes a virtual one for the scheduler's
            # block accounting (encode_only.virtual_kv_bytes). The CPU default budget (a
            # quarter of memory) would make that tens of millions of blocks, a minute of
            # start-up and gigabytes of block objects.
            kv_bytes = None
        utilization = self.gpu_memory_utilization
        config = EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory_bytes=kv_bytes,
                gpu_memory_utilization=(
                    DEFAULT_GPU_MEMORY_UTILIZATION if utilization is None else utilization
                ),
                cache_dtype=self.kv_cache_dtype,
                enable_prefix_caching=prefix_caching,
                prefix_caching_hash_algo=self.prefix_caching_hash_algo,
            ),
            parallel_config=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                cpu_threads=self.cpu_threads,
                pipeline_parallel_size=self.pipeline_parallel_size,
                distributed_executor_backend=self.distributed_executor_backend,
                ray_placement_strategy=self.ray_placement_strategy,
                nnodes=self.nnodes,
                node_rank=self.node_rank,
                master_addr=self.master_addr,
                master_port=self.master_port,
            ),
            scheduler_limits=SchedulerLimits(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=batched_tokens,
                enable_chunked_prefill=chunked,
                max_logprobs=self.max_logprobs,
                policy=self.scheduling_policy,  # type: ignore[arg-type]  # checked there
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                long_prefill_token_threshold_adaptive=self.long_prefill_token_threshold_adaptive,
            ),
            seed=self.seed,
            block_hash_seed=self.block_hash_seed,
            kv_connector_factory=kv_connector,
            speculative_config=speculative_config,
            ec_connector_factory=ec_connector,
            lora_config=lora_config,
        )
        # Build the scheduler's config now, in the caller's process, so that limits it
        # rejects (vLLM's SchedulerConfig checks) fail here with a message rather than
        # inside the engine core process after it was spawned.
        from paged.server.encode_only import encode_only_engine_config
        from paged.server.engine.core import scheduler_config_from

        config = encode_only_engine_config(config)  # an EPD encoder producer's settings
        scheduler_config_from(config)
        return config

    def lora_config(self) -> LoRAConfig | None:
        """`--enable-lora`'s LoRAConfig (None: off); ValueError naming a bad limit.

        As vLLM 0.33 (arg_utils.py:2691-2711): the limits are ignored without
        --enable-lora, and --max-cpu-loras <= 0 means "as --max-loras".
        """
        if not self.enable_lora:
            return None
        from paged.runner.lora.config import LoRAConfig

        if self.async_scheduling:
            raise ValueError("enable_lora: not supported with async_scheduling yet")
        if self.pipeline_parallel_size > 1:
            raise ValueError("enable_lora: not supported with pipeline_parallel_size > 1 yet")
        cpu = self.max_cpu_loras if self.max_cpu_loras and self.max_cpu_loras > 0 else None
        return LoRAConfig(
            max_loras=self.max_loras,
            max_lora_rank=self.max_lora_rank,
            max_cpu_loras=cpu,
            lora_dtype=self.lora_dtype,  # type: ignore[arg-type]  # checked there
        )

    def has_kv_connector(self) -> bool:
        """Whether these options configure a KV connector (offloading or a transfer config)."""
        return self.kv_offloading_size is not None or self.kv_transfer_config is not None

    def _kv_transfer_config(self) -> str | dict[str, Any] | None:
        if self.kv_offloading_size is None:
            return self.kv_transfer_config
        if self.kv_transfer_config is not None:
            raise ValueError(
                "kv_offloading_size and kv_transfer_config are exclusive; put the "
                "OffloadingConnector's options in kv_transfer_config instead"
            )
        from paged.server.kv_transfer import offloading_kv_transfer_config

        return offloading_kv_transfer_config(
            self.kv_offloading_size, self.kv_offloading_backend, self.tensor_parallel_size
        )


def _check_ec_model(model_config: ModelConfig) -> None:
    """An encoder-cache connector needs a model with a vision encoder."""
    from paged.server.mm_frontend import mm_tokens_per_item

    if not mm_tokens_per_item(model_config.hf_config):
        raise ValueError(
            f"ec_transfer_config: the model {model_config.architecture} has no vision "
            "encoder; an encoder-cache connector needs a multimodal model"
        )


def build_frontend_for(
    args: EngineArgs, config: EngineConfig, *, bind_host: str | None = None
) -> MultiModalFrontend | None:
    """The multimodal frontend for a model with a vision tower; None for a text-only one.

    `bind_host` is the API server's listening address (None: the in-process `LLM`);
    it decides whether media URLs to internal addresses are refused.
    """
    from paged.server.mm_frontend import build_mm_frontend, mm_tokens_per_item

    mc = config.model_config
    if not mm_tokens_per_item(mc.hf_config):
        return None
    return build_mm_frontend(
        mc.tokenizer,
        args.model_name(),
        cache_config=args.mm_engine_options().processor_cache,
        limit_mm_per_prompt=args.limit_mm_per_prompt,
        allowed_local_media_path=args.allowed_local_media_path,
        media_limits=args.media_limits(),
        media_url_policy=args.media_url_policy(bind_host),
    )


def tokenizer_path(config: EngineConfig, override: str | None = None) -> str:
    """Where the tokenizer comes from: the override, the GGUF file, or the HF directory."""
    if override is not None:
        return override
    mc = config.model_config
    if mc.gguf_file is not None:
        return str(Path(mc.tokenizer) / mc.gguf_file)
    return mc.tokenizer


def parse_bytes(text: str) -> int:
    """'512MiB', '2GiB', '1G', '1000000' -> bytes (for --kv-cache-memory)."""
    units = {
        "": 1,
        "b": 1,
        "k": 1000,
        "kb": 1000,
        "kib": 1 << 10,
        "m": 1000**2,
        "mb": 1000**2,
        "mib": 1 << 20,
        "g": 1000**3,
        "gb": 1000**3,
        "gib": 1 << 30,
    }
    s = text.strip().lower()
    num = s.rstrip("abgikm")
    unit = s[len(num) :]
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"not a byte size: {text!r} (try 512MiB or 2GiB)") from None
    if unit not in units or value <= 0:
        raise ValueError(f"not a byte size: {text!r} (try 512MiB or 2GiB)")
    return int(value * units[unit])
