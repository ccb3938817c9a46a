"""Engine configuration: model, KV cache, parallelism, scheduler limits.

`EngineConfig` (vLLM's VllmConfig) gathers the per-part configs. `ModelConfig`
lives in model_config.py (the speculative config needs it, and the engine
config needs the speculative config); it is re-exported here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from paged.kvcache import HASH_ALGOS
from paged.runner.default_model import default_model_path
from paged.runner.kv_cache_dtype import check_kv_cache_dtype
from paged.runner.layers.head_partition import partition_heads
from paged.runner.lora.config import LoRAConfig
from paged.runner.model_config import CpuWeightPanels, ModelConfig, resolve_dtype
from paged.runner.pipeline.partition import PIPELINE_ARCHITECTURES, layer_partition
from paged.runner.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:
    from paged.runner.ec_connector import ECConnectorWorkerFactory
    from paged.runner.kv_connector import KVConnectorWorkerFactory

__all__ = [
    "DEFAULT_MASTER_PORT",
    "CacheConfig",
    "CpuWeightPanels",
    "EngineConfig",
    "ExecutorBackend",
    "LoRAConfig",
    "ModelConfig",
    "ParallelConfig",
    "RayPlacementStrategy",
    "SchedulerLimits",
    "default_model_path",
    "resolve_dtype",
]


@dataclass(frozen=True)
class CacheConfig:
    """KV cache settings.

    kv_cache_memory_bytes: the byte budget for KV blocks (required on CPU,
    where there is no free-memory probe; on CUDA None means
    `gpu_memory_utilization` of the device minus what the profiling run used).
    cache_dtype: vLLM's `--kv-cache-dtype` (kv_cache_dtype.py): "auto" stores
    the model's dtype; float16/bfloat16/fp8 pages are smaller, so the same
    budget holds more blocks.
    """

    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    cache_dtype: str = "auto"
    # vLLM's --prefix-caching-hash-algo (paged.kvcache.hashing: vLLM's bytes for
    # its four names; paged_sha256 / paged_xxhash are paged's own encoding).
    prefix_caching_hash_algo: str = "sha256"

    def __post_init__(self) -> None:
        check_kv_cache_dtype(self.cache_dtype)
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ValueError(
                f"prefix_caching_hash_algo: {self.prefix_caching_hash_algo!r} is not one of "
                f"{list(HASH_ALGOS)}"
            )
        if self.block_size <= 0:
            raise ValueError(f"block_size: must be positive, got {self.block_size}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(
                f"kv_cache_memory_bytes: must be positive, got {self.kv_cache_memory_bytes}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}"
            )


ExecutorBackend = Literal["uni", "mp", "ray"]
# Ray placement-group strategies (ray.util.placement_group's names).
RayPlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
_EXECUTOR_BACKENDS = ("uni", "mp", "ray")
_RAY_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
DEFAULT_MASTER_PORT = 29501  # vLLM's ParallelConfig.master_port


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor and pipeline parallelism. More than one rank needs "mp" or "ray".

    World size = tensor_parallel_size x pipeline_parallel_size; rank
    r is pipeline stage r // TP, tensor rank r % TP (vLLM's layout, TP innermost).
    `pp_layer_partition` is vLLM's VLLM_PP_LAYER_PARTITION ("8,7": decoder
    layers per stage, summing to the model's); None: vLLM's even split.
    """

    tensor_parallel_size: int = 1
    # vLLM's --distributed-executor-backend: "uni", "mp" or "ray" (None: "mp" for TP > 1).
    distributed_executor_backend: ExecutorBackend | None = None
    # How the "ray" backend places its one-bundle-per-rank placement group:
    # PACK fills the engine core's node first (vLLM's default), SPREAD puts
    # ranks on different nodes where it can.
    ray_placement_strategy: RayPlacementStrategy = "PACK"
    pipeline_parallel_size: int = 1
    pp_layer_partition: str | None = field(
        default_factory=lambda: os.environ.get("VLLM_PP_LAYER_PARTITION")
    )
    # vLLM's --nnodes/--node-rank/--master-addr/--master-port: the "mp" backend's
    # ranks spread node-major over `nnodes` machines (executor/remote_nodes.py).
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None  # node 0's address; required when nnodes > 1
    master_port: int = DEFAULT_MASTER_PORT
    # paged's --cpu-threads: threads per CPU rank (None: paged.runner.cpu_threads decides
    # from VLLM_CPU_OMP_THREADS_BIND, OMP_NUM_THREADS and the CPUs this process may use).
    cpu_threads: int | None = None

    def __post_init__(self) -> None:
        if self.cpu_threads is not None and (
            isinstance(self.cpu_threads, bool) or self.cpu_threads < 1
        ):
            raise ValueError(f"cpu_threads: must be >= 1, got {self.cpu_threads!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size: must be >= 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(
                f"pipeline_parallel_size: must be >= 1, got {self.pipeline_parallel_size}"
            )
        if self.distributed_executor_backend not in (None, *_EXECUTOR_BACKENDS):
            raise ValueError(
                "distributed_executor_backend: "
                f"{self.distributed_executor_backend!r} is unknown; use 'uni', 'mp' or 'ray'"
            )
        if self.world_size > 1 and self.distributed_executor_backend == "uni":
            raise ValueError(
                "distributed_executor_backend: 'uni' runs one worker, so it cannot serve "
                f"tensor_parallel_size={self.tensor_parallel_size} x "
                f"pipeline_parallel_size={self.pipeline_parallel_size}; use 'mp' or 'ray'"
            )
        self._check_nodes()
        if self.ray_placement_strategy not in _RAY_STRATEGIES:
            raise ValueError(
                f"ray_placement_strategy: {self.ray_placement_strategy!r} is unknown; "
                f"use one of {', '.join(_RAY_STRATEGIES)}"
            )

    def _check_nodes(self) -> None:
        if self.nnodes < 1:
            raise ValueError(f"nnodes: must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank: must be in [0, {self.nnodes}), got {self.node_rank}")
        if not 0 < self.master_port < 65535:  # the node link listens on master_port + 1
            raise ValueError(f"master_port: must be in 1..65534, got {self.master_port}")
        if self.nnodes == 1:
            return
        if self.world_size % self.nnodes != 0:
            raise ValueError(
                f"nnodes: {self.nnodes} does not divide the world size {self.world_size} "
                f"(tensor_parallel_size={self.tensor_parallel_size} x "
                f"pipeline_parallel_size={self.pipeline_parallel_size}); every node runs "
                "world_size / nnodes ranks"
            )
        if self.executor_backend != "mp":
            raise ValueError(
                f"nnodes: {self.nnodes} nodes need distributed_executor_backend 'mp' (got "
                f"{self.executor_backend!r}); the 'ray' backend places ranks over the Ray "
                "cluster by itself"
            )
        if not self.master_addr:
            raise ValueError(
                "master_addr: required with nnodes > 1 (node 0's address, reachable from "
                "every node); pass --master-addr"
            )

    @property
    def ranks_per_node(self) -> int:
        """Worker processes on each node (world size / nnodes; ranks are node-major)."""
        return self.world_size // self.nnodes

    @property
    def world_size(self) -> int:
        """Worker processes: TP x PP."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def executor_backend(self) -> ExecutorBackend:
        """The backend in effect: the explicit choice, else "mp" for several ranks, else "uni"."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "mp" if self.world_size > 1 else "uni"


@dataclass(frozen=True)
class SchedulerLimits:
    """The scheduler limits the runner sizes its buffers by.

    The server builds `paged.scheduler.SchedulerConfig` from the same numbers.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    max_logprobs: int = 20
    # Not used by the runner; carried to the scheduler (vLLM's SchedulerConfig fields).
    policy: Literal["fcfs", "priority"] = "fcfs"
    long_prefill_token_threshold: int = 0
    long_prefill_token_threshold_adaptive: bool = False

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy: must be 'fcfs' or 'priority', got {self.policy!r}"
            )
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold: must be >= 0, "
                f"got {self.long_prefill_token_threshold}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens: must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs: must be >= 0, got {self.max_logprobs}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything an executor needs to build workers (vLLM's VllmConfig)."""

    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler_limits: SchedulerLimits = field(default_factory=SchedulerLimits)
    seed: int = 0
    # Seeds the block-hash chain (NONE_HASH). None: vLLM 0.33's rule
    # (PYTHONHASHSEED, else the fixed "vllm-none-hash" for sha256 / sha256_cbor,
    # random for xxhash), so paged and vLLM engines hash alike. KV stored by a
    # connector (a disk tier, a peer) is found again only by engines that agree.
    block_hash_seed: int | None = None
    # Builds each worker's KV connector (None: no KV transfer). An object, not
    # a config, so the runner needs no knowledge of connector classes; it is
    # pickled to worker processes with the rest of this config.
    kv_connector_factory: KVConnectorWorkerFactory | None = None
    # vLLM's --speculative-config (n-gram or draft model); None: no speculation.
    speculative_config: SpeculativeConfig | None = None
    # Builds each worker's encoder-cache connector (None: none); picklable, as above.
    ec_connector_factory: ECConnectorWorkerFactory | None = None
    # The scheduler's encoder_cache_size (embeddings); None: its default. Sizes the
    # worker's preallocated encoder cache so both sides count the same capacity.
    encoder_cache_size: int | None = None
    # `--enable-lora` and its limits; None: LoRA off (a request naming an
    # adapter is refused).
    lora_config: LoRAConfig | None = None

    def __post_init__(self) -> None:
        limits = self.scheduler_limits
        if (
            not limits.enable_chunked_prefill
            and limits.max_num_batched_tokens < self.model_config.max_model_len
        ):
            raise ValueError(
                f"max_num_batched_tokens: {limits.max_num_batched_tokens} is smaller than "
                f"max_model_len={self.model_config.max_model_len} with chunked prefill off; "
                "raise it, lower max_model_len or enable chunked prefill"
            )
        if self.parallel_config.pipeline_parallel_size > 1:
            self._check_pipeline()
        cfg = self.model_config.text_config
        tp = self.parallel_config.tensor_parallel_size
        # Heads need not divide evenly (layers/head_partition.py replicates KV
        # heads and splits heads unevenly); this raises only for tp > heads.
        heads = int(cfg.num_attention_heads)
        partition_heads(heads, int(getattr(cfg, "num_key_value_heads", None) or heads), tp)
        sizes = {"intermediate size": int(cfg.intermediate_size)}
        for what, size in sizes.items():
            if size % tp != 0:
                raise ValueError(
                    f"tensor_parallel_size: {tp} does not divide the model's {what} ({size}); "
                    "choose a divisor"
                )

    def _check_pipeline(self) -> None:
        """ValueError naming the setting for what pipeline parallelism cannot run (PP > 1)."""
        parallel = self.parallel_config
        model = self.model_config
        if model.architecture not in PIPELINE_ARCHITECTURES:
            raise ValueError(
                f"pipeline_parallel_size: {model.architecture} has no pipeline-parallel "
                f"implementation; supported: {', '.join(sorted(PIPELINE_ARCHITECTURES))}"
            )
        layer_partition(
            model.num_hidden_layers, parallel.pipeline_parallel_size, parallel.pp_layer_partition
        )
        if self.speculative_config is not None:
            raise ValueError("speculative_config: not supported with pipeline_parallel_size > 1")
        if self.kv_connector_factory is not None:
            raise ValueError("kv_transfer_config: not supported with pipeline_parallel_size > 1")
