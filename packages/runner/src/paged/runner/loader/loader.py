"""load_model: ModelConfig -> a ready CausalLM on the device, every weight filled."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from paged.runner.config import CpuWeightPanels, ModelConfig
from paged.runner.layers.linear import CheckpointTensor, ShardedLinear
from paged.runner.layers.vocab_embedding import ParallelLMHead
from paged.runner.loader.gguf_weights import iterate_gguf
from paged.runner.loader.quantized import finish_quantized_load, prepare_quantized_load
from paged.runner.loader.safetensors_weights import iterate_safetensors
from paged.runner.models.architectures import body_architecture
from paged.runner.models.interface import LoadableCausalLM
from paged.runner.models.registry import resolve_model_class
from paged.runner.pipeline.partition import PIPELINE_ARCHITECTURES
from paged.runner.pipeline.stage import StageSetup

logger = logging.getLogger(__name__)


def iterate_weights(
    model_config: ModelConfig, *, keep_quantized: bool = False
) -> Iterator[tuple[str, CheckpointTensor]]:
    """(HF name, full CPU tensor) pairs of the checkpoint, whatever its format.

    keep_quantized: quantised GGUF tensors come as blocks (loader/gguf_quant.py).
    """
    if model_config.weights_format == "gguf":
        return iterate_gguf(model_config.weights_path, keep_quantized=keep_quantized)
    return iterate_safetensors(Path(model_config.model))


def load_model(
    model_config: ModelConfig,
    device: torch.device | str,
    tp_rank: int = 0,
    tp_size: int = 1,
    *,
    stage_setup: StageSetup | None = None,
) -> LoadableCausalLM:
    """Build the model for `model_config` on `device` (this TP rank's shard) and load it.

    `stage_setup` (pipeline parallelism): build only this stage's layers.

    Parameters are allocated directly on the device, uninitialised, then every
    one is overwritten from the checkpoint; a checkpoint that lacks any of
    them, has extra tensors or disagrees on shapes raises a ValueError.
    """
    target = torch.device(device)
    if target.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was requested but no CUDA device is available")
    # A decoder *ForSequenceClassification runs on its causal-LM class (pooling/seq_cls.py).
    model_class = resolve_model_class(body_architecture(model_config.architecture))
    keep_quantized = model_config.keeps_weights_quantized
    if keep_quantized and tp_size != 1:
        raise ValueError(
            "quantization: quantized GGUF weights on CPU run at tensor_parallel_size=1; "
            "pass --dtype float32 to dequantize them for tensor parallelism"
        )
    with target:
        if stage_setup is None:
            model = model_class(model_config, tp_rank=tp_rank, tp_size=tp_size)
        else:
            model = _build_stage(model_config, stage_setup)
    if keep_quantized:
        if not isinstance(model, nn.Module):
            raise TypeError(f"{type(model).__name__} is not a torch.nn.Module")
        prepare_quantized_load(model)
    loaded = model.load_weights(iterate_weights(model_config, keep_quantized=keep_quantized))
    missing = sorted(model.expected_weights() - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise ValueError(
            f"model: the checkpoint at {str(model_config.weights_path)!r} lacks weights {shown}; "
            "it is incomplete or does not match config.json"
        )
    if keep_quantized:
        assert isinstance(model, nn.Module)
        finish_quantized_load(model, model_config.dtype)
    elif target.type == "cpu" and model_config.dtype == torch.float32:
        if not isinstance(model, nn.Module):
            raise TypeError(f"{type(model).__name__} is not a torch.nn.Module")
        if _want_cpu_panels(model_config.cpu_weight_panels, model):
            build_cpu_panels(model)
    model.eval()
    return model


def _build_stage(model_config: ModelConfig, setup: StageSetup) -> LoadableCausalLM:
    """A pipeline stage of a model whose class builds stages (the Llama family)."""
    if body_architecture(model_config.architecture) not in PIPELINE_ARCHITECTURES:
        raise ValueError(
            f"pipeline_parallel_size: {model_config.architecture} has no pipeline-parallel "
            "implementation"
        )
    from paged.runner.models.llama import LlamaForCausalLM

    stage = setup.stage
    return LlamaForCausalLM(
        model_config,
        tp_rank=stage.tp_rank,
        tp_size=stage.tp_size,
        stage=stage,
        pp_layer_partition=setup.pp_layer_partition,
        tp_group=setup.tp_group,
    )


def _panelled_modules(model: nn.Module) -> list[ShardedLinear | ParallelLMHead]:
    return [m for m in model.modules() if isinstance(m, (ShardedLinear, ParallelLMHead))]


def cpu_panel_bytes(model: nn.Module) -> int:
    """Memory the panel copies of `model` take (before any zero-padding)."""
    return sum(m.weight.numel() * m.weight.element_size() for m in _panelled_modules(model))


def available_host_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes; None where there is no such file."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _want_cpu_panels(mode: CpuWeightPanels, model: nn.Module) -> bool:
    if mode != "auto":
        return mode == "on"
    # A second copy of a large model's weights could push the host into swap
    # or the OOM killer; "auto" takes the speed-up only when it is cheap.
    need, available = cpu_panel_bytes(model), available_host_memory()
    wanted = available is not None and need <= available // 4
    logger.info(
        "CPU weight panels %s: they take %.0f MiB, %s MiB of memory available "
        "(auto builds them when they fit in a quarter of it)",
        "built" if wanted else "skipped",
        need / 2**20,
        "unknown" if available is None else f"{available / 2**20:.0f}",
    )
    return wanted


def build_cpu_panels(model: nn.Module) -> None:
    """Give every linear layer and the LM head its column-panel copy (layers/cpu_panels.py).

    Measured for float32 only, hence only called for it. Call again after
    changing weights: a load_weight call drops a layer's panels.
    """
    for module in _panelled_modules(model):
        module.build_cpu_panels()
