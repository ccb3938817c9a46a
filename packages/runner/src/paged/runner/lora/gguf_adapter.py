"""llama.cpp GGUF LoRA adapters -> `LoRAAdapterWeights` (HF module paths, PEFT orientation).

The files llama.cpp's `convert_lora_to_gguf.py` writes (and `llama-adapter.cpp`
reads):

- metadata: `general.type` = "adapter", `adapter.type` = "lora",
  `adapter.lora.alpha` (float32; absent or 0 means "scale 1"),
  `general.architecture` = the base model's GGUF architecture. No head counts:
  the converter writes only alpha, so the caller passes the base's.
- tensors `<base tensor name>.lora_a` / `.lora_b`, e.g. `blk.3.attn_q.weight.lora_a`.
  GGUF lists dimensions fastest first, so lora_a reads back as [rank, in] and
  lora_b as [out, rank]: PEFT's own orientation, nothing to transpose.
- for "llama" files the converter applies the base converter's Q/K row
  permutation to lora_b (LoraTorchTensor.reshape/swapaxes act on B's rows), so
  it is undone here with the base loader's `unpermute_qk`, per head.
- scaling: llama.cpp uses alpha / rank per tensor pair (llama-adapter.h,
  get_scale). rsLoRA cannot be expressed in the file (the converter keeps only
  alpha), so an rsLoRA adapter converted to GGUF is scaled as llama.cpp scales
  it, alpha / rank. Pairs of different ranks get their own scale folded into B
  so that one adapter-wide `scaling` holds.
- `*_norm.weight` tensors (mergekit-extract-lora adds them) are skipped, as
  llama.cpp skips them; any other tensor, or a target that is not one of
  `LORA_TARGET_MODULES` (token_embd, output), is refused with a ValueError.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import gguf
import torch

from paged.runner.loader.gguf_config import GGUF_ARCHITECTURES, field_value
from paged.runner.loader.gguf_weights import dequantize, gguf_to_hf_name, unpermute_qk
from paged.runner.lora.weights import LORA_TARGET_MODULES, LoRAAdapterWeights, LoRAModuleWeights

__all__ = ["is_gguf_file", "load_gguf_lora"]

logger = logging.getLogger(__name__)

_GGUF_MAGIC = b"GGUF"
# HF model_type values whose llama.cpp files use each GGUF architecture name
# (llama.cpp converts Mistral checkpoints as "llama"; Gemma 3 text as "gemma3").
_MODEL_TYPES: dict[str, tuple[str, ...]] = {
    "llama": ("llama", "mistral"),
    "gemma3": ("gemma3_text", "gemma3"),
}


def is_gguf_file(path: str) -> bool:
    """Whether `path` is a file starting with the GGUF magic (a directory: a PEFT adapter)."""
    p = Path(path)
    if not p.is_file():
        return False
    with p.open("rb") as f:
        return f.read(4) == _GGUF_MAGIC


def _open(path: str) -> gguf.GGUFReader:
    if not Path(path).is_file():
        raise ValueError(f"lora_path: GGUF LoRA adapter {path!r} does not exist")
    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # the gguf package raises assorted errors on bad files
        raise ValueError(
            f"lora_path: {path!r} is not a readable GGUF file ({type(exc).__name__}: {exc}); "
            "it may be truncated or corrupt"
        ) from exc


def _check_metadata(reader: gguf.GGUFReader, path: str, model_type: str | None) -> str:
    """Checks llama-adapter.cpp makes, as ValueErrors; returns the GGUF architecture."""
    general_type = field_value(reader, gguf.Keys.General.TYPE)
    if general_type != gguf.GGUFType.ADAPTER:
        raise ValueError(
            f"lora_path: {path!r} is not a LoRA adapter: general.type is {general_type!r}, "
            f"expected 'adapter' (a base model file? convert the PEFT adapter with llama.cpp's "
            "convert_lora_to_gguf.py)"
        )
    adapter_type = field_value(reader, gguf.Keys.Adapter.TYPE)
    if adapter_type != "lora":
        raise ValueError(
            f"lora_path: {path!r} has adapter.type {adapter_type!r}; only 'lora' is supported"
        )
    if field_value(reader, gguf.Keys.Adapter.ALORA_INVOCATION_TOKENS) is not None:
        raise ValueError(
            f"lora_path: {path!r} is an activated LoRA (adapter.alora.invocation_tokens), "
            "which paged does not support"
        )
    arch = str(field_value(reader, gguf.Keys.General.ARCHITECTURE))
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"lora_path: {path!r} is for architecture {arch!r}; supported: "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    if model_type is not None:
        accepted = _MODEL_TYPES.get(arch, (GGUF_ARCHITECTURES[arch][1],))
        if model_type not in accepted:
            raise ValueError(
                f"lora_path: {path!r} was converted for a {arch!r} model, the base model is "
                f"{model_type!r} (llama.cpp: model arch and LoRA arch mismatch)"
            )
    return arch


def _module_path(base_name: str, arch: str, path: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj` (a LoRA target) or ValueError."""
    try:
        hf_name = gguf_to_hf_name(base_name, arch)
    except ValueError:
        hf_name = ""
    module, _, suffix = hf_name.rpartition(".")
    if suffix != "weight" or module.rpartition(".")[2] not in LORA_TARGET_MODULES:
        raise ValueError(
            f"lora_path: {path!r} adapts {base_name!r}, which is not a LoRA target paged "
            f"supports ({', '.join(LORA_TARGET_MODULES)} of each layer)"
        )
    return module


def _read(tensor: Any, path: str) -> torch.Tensor:
    try:
        return dequantize(tensor)
    except Exception as exc:  # gguf/numpy raise assorted errors on short data
        raise ValueError(
            f"lora_path: tensor {tensor.name!r} in {path!r} cannot be decoded "
            f"({type(exc).__name__}: {exc}); the file is truncated or corrupt"
        ) from exc


def _pairs(reader: gguf.GGUFReader, path: str) -> dict[str, dict[str, Any]]:
    """`<base name>` -> {"a": tensor, "b": tensor}, as llama-adapter.cpp bundles them."""
    pairs: dict[str, dict[str, Any]] = {}
    for tensor in reader.tensors:
        name = str(tensor.name)
        base, dot, part = name.rpartition(".")
        if dot and part in ("lora_a", "lora_b"):
            pairs.setdefault(base, {})[part[-1]] = tensor
        elif name.endswith("_norm.weight"):
            logger.warning("GGUF LoRA %s: skipping norm tensor %s (llama.cpp skips it)", path, name)
        else:
            raise ValueError(
                f"lora_path: {path!r} holds tensor {name!r}, neither .lora_a nor .lora_b"
            )
    if not pairs:
        raise ValueError(f"lora_path: {path!r} holds no LoRA tensors")
    for base, pair in pairs.items():
        missing = [f"{base}.lora_{k}" for k in ("a", "b") if k not in pair]
        if missing:
            raise ValueError(f"lora_path: {path!r} lacks {missing[0]} (a pair needs both)")
    return pairs


def load_gguf_lora(
    path: str,
    *,
    num_heads: int,
    num_kv_heads: int,
    model_type: str | None = None,
) -> LoRAAdapterWeights:
    """Read a llama.cpp LoRA GGUF (module docstring) into float32 CPU weights, HF layout.

    `num_heads` / `num_kv_heads` are the base model's (for undoing the Q/K row
    permutation of "llama" files); `model_type` is the base's HF `model_type`,
    checked against the file's architecture when given. Shapes against the
    model and the rank limit are the caller's checks. Every problem with the
    file raises a ValueError naming `path` and the cause.
    """
    reader = _open(path)
    arch = _check_metadata(reader, path, model_type)
    alpha = float(field_value(reader, gguf.Keys.Adapter.LORA_ALPHA) or 0.0)
    loaded: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for base, pair in _pairs(reader, path).items():
        module = _module_path(base, arch, path)
        lora_a, lora_b = _read(pair["a"], path), _read(pair["b"], path)
        if lora_a.dim() != 2 or lora_b.dim() != 2 or lora_a.shape[0] != lora_b.shape[1]:
            raise ValueError(
                f"lora_path: {path!r}: {base} has lora_a {tuple(lora_a.shape)} and lora_b "
                f"{tuple(lora_b.shape)}; expected [rank, in] and [out, rank]"
            )
        if arch == "llama" and module.endswith((".q_proj", ".k_proj")):
            heads = num_heads if module.endswith(".q_proj") else num_kv_heads
            try:
                lora_b = unpermute_qk(lora_b, heads)
            except ValueError as exc:
                raise ValueError(
                    f"lora_path: {path!r}: {base}.lora_b {tuple(lora_b.shape)} does not fit "
                    f"the base model's {heads} heads ({exc}); wrong base model?"
                ) from exc
        loaded[module] = (lora_a.contiguous(), lora_b.contiguous())
    rank = max(a.shape[0] for a, _ in loaded.values())
    scaling = alpha / rank if alpha else 1.0
    modules: dict[str, LoRAModuleWeights] = {}
    for module, (lora_a, lora_b) in loaded.items():
        own = alpha / lora_a.shape[0] if alpha else 1.0
        if own != scaling:  # a pair of another rank: fold its own scale into B
            lora_b = lora_b * (own / scaling)
        modules[module] = LoRAModuleWeights(lora_a=lora_a, lora_b=lora_b)
    return LoRAAdapterWeights(rank=rank, scaling=scaling, modules=modules)
