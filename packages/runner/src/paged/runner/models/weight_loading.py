"""Copying Hugging Face-named checkpoint tensors into paged's model modules.

Shared by every model: q/k/v and gate/up tensors go into their packed layers
(`load_weight(name, tensor, shard_id)` on paged's linear layers, which also
stage quantized GGUF tensors); plain torch modules (a vision tower's convs and
layer norms) take the tensor as it is.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from paged.runner.layers.linear import CheckpointTensor

# HF checkpoint fragment -> (packed parameter fragment, shard id).
PACKED: list[tuple[str, str, str | int]] = [
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
]


def load_named_weights(
    module: nn.Module, weights: Iterable[tuple[str, CheckpointTensor]], skip: set[str]
) -> set[str]:
    """Copy HF-named tensors into `module`'s layers (packing q/k/v and gate/up).

    Returns the parameter names filled; a name in `skip` is ignored (a tied
    LM head); an unknown name raises a ValueError naming it.
    """
    modules = dict(module.named_modules())
    loaded: set[str] = set()
    shards: dict[str, set[str | int]] = {}
    for name, tensor in weights:
        if name in skip:
            continue
        target, shard_id = name, None
        for fragment, packed, sid in PACKED:
            packed_name = name.replace(fragment, packed)
            # Only where the packed layer exists (SigLIP keeps separate q/k/v).
            if fragment in name and packed_name.rpartition(".")[0] in modules:
                target, shard_id = packed_name, sid
                break
        module_name, _, param_name = target.rpartition(".")
        owner = modules.get(module_name)
        if owner is None or not (hasattr(owner, "load_weight") or param_name in owner._parameters):
            raise ValueError(
                f"checkpoint tensor {name!r} does not belong to {type(module).__name__}; "
                "is the checkpoint for a different architecture?"
            )
        try:
            if hasattr(owner, "load_weight"):
                owner.load_weight(param_name, tensor, shard_id)
            else:  # plain torch modules (vision tower convs and layer norms): same layout as HF
                _copy_param(owner._parameters[param_name], tensor)
        except ValueError as exc:
            raise ValueError(f"checkpoint tensor {name!r}: {exc}") from exc
        if shard_id is None:
            loaded.add(target)
        else:
            shards.setdefault(target, set()).add(shard_id)
    for target, got in shards.items():
        needed = {"q", "k", "v"} if ".qkv_proj." in target else {0, 1}
        if got == needed:
            loaded.add(target)
    return loaded


def _copy_param(param: torch.Tensor | None, tensor: CheckpointTensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError("a quantized GGUF tensor cannot fill a plain torch parameter")
    if param is None or param.shape != tensor.shape:
        shape = None if param is None else list(param.shape)
        raise ValueError(f"shape {list(tensor.shape)} does not match the parameter's {shape}")
    with torch.no_grad():
        param.copy_(tensor)
