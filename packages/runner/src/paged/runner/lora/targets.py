"""Find a model's LoRA-capable linear layers and attach a `LoRALinear` to each.

paged packs projections (q/k/v in `qkv_proj`, gate/up in `gate_up_proj`);
PEFT names the Hugging Face modules. Each packed layer becomes one slice per
HF module, at the offset and with this rank's share that the base layer's own
`load_weight` uses (linear.py), so an adapter shards exactly as its base:

    paged module path                     HF module paths (slices, local output offsets)
    model.layers.N.self_attn.qkv_proj  -> ...self_attn.q_proj @0, k_proj @q, v_proj @q+kv
    model.layers.N.self_attn.o_proj    -> ...self_attn.o_proj (row-parallel: A sharded)
    model.layers.N.mlp.gate_up_proj    -> ...mlp.gate_proj @0, up_proj @inter/tp
    model.layers.N.mlp.down_proj       -> ...mlp.down_proj (row-parallel: A sharded)
"""

from __future__ import annotations

import torch
from torch import nn

from paged.runner.cpu_kernels.lora_delta import LoRADeltaPlan, load_lora_delta
from paged.runner.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    ShardedLinear,
)
from paged.runner.lora.layer import LoRABatch, LoRALinear, LoRASlice

__all__ = ["attach_lora_layers"]

_GATE_UP = ("gate_proj", "up_proj")


def attach_lora_layers(
    model: nn.Module,
    batch: LoRABatch,
    slots: int,
    rank: int,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, LoRASlice]:
    """Attach LoRA holders to every target layer; returns HF module path -> its slice.

    On the CPU with bfloat16 or float32 stacks each layer also gets the C kernel's
    plan (B stored transposed, see layer.py), unless the kernel cannot be built.
    Raises ValueError when the model has no layer LoRA can target.
    """
    native = device.type == "cpu" and dtype in (torch.bfloat16, torch.float32)
    lib = load_lora_delta() if native else None
    targets: dict[str, LoRASlice] = {}
    for path, module in model.named_modules():
        if not isinstance(module, ShardedLinear):
            continue
        parent, _, leaf = path.rpartition(".")
        specs = _slice_specs(module, leaf)
        if specs is None:
            continue
        in_local, n = module.weight.shape[1], len(specs)
        # One stack for all slices: A rows and B columns per slice, B block diagonal.
        out_local = module.weight.shape[0]
        a_all = torch.zeros(slots, n * rank, in_local, dtype=dtype, device=device)
        bt_all: torch.Tensor | None = None
        if lib is not None:  # B transposed in memory: the C kernel runs along output columns
            bt_all = torch.zeros(slots, n * rank, out_local, dtype=dtype, device=device)
            b_all = bt_all.transpose(1, 2)
        else:
            b_all = torch.zeros(slots, out_local, n * rank, dtype=dtype, device=device)
        layer_slices = []
        for i, (name, full_in, full_out, in_start, out_start, offset, slice_out) in enumerate(
            specs
        ):
            hf_path = f"{parent}.{name}" if parent else name
            ranks = slice(i * rank, (i + 1) * rank)
            lora_slice = LoRASlice(
                module=hf_path,
                full_in=full_in,
                full_out=full_out,
                in_start=in_start,
                out_start=out_start,
                out_offset=offset,
                a=a_all[:, ranks],
                b=b_all[:, offset : offset + slice_out, ranks],
            )
            targets[hf_path] = lora_slice
            layer_slices.append(lora_slice)
        plan = None
        if lib is not None and bt_all is not None:
            offsets = [s.out_offset for s in layer_slices] + [out_local]
            plan = LoRADeltaPlan(lib, a_all, bt_all, batch.scaling, batch.ranks, offsets)
        module.lora = LoRALinear(batch, layer_slices, a_all, b_all, plan)
    if not targets:
        raise ValueError(
            f"enable_lora: {type(model).__name__} has no layer LoRA can target "
            "(q/k/v/o and gate/up/down projections)"
        )
    return targets


# (HF module name, full in, full out, in_start, out_start, local out offset, local out size)
_Spec = tuple[str, int, int, int, int, int, int]


def _slice_specs(layer: ShardedLinear, leaf: str) -> list[_Spec] | None:
    """The HF modules packed in `layer`, with this rank's share of each; None: not a target."""
    in_features = layer.weight.shape[1]
    if isinstance(layer, QKVParallelLinear):
        hidden, h = in_features, layer.head_size
        q_full = layer.total_heads["q"] * h
        kv_full = layer.total_heads["k"] * h
        q_start = layer.heads.q_start * h
        kv_start = layer.heads.kv_start * h
        return [
            ("q_proj", hidden, q_full, 0, q_start, 0, layer.q_size),
            ("k_proj", hidden, kv_full, 0, kv_start, layer.q_size, layer.kv_size),
            ("v_proj", hidden, kv_full, 0, kv_start, layer.q_size + layer.kv_size, layer.kv_size),
        ]
    if isinstance(layer, MergedColumnParallelLinear):
        if leaf != "gate_up_proj" or len(layer.output_sizes) != 2:
            return None
        specs: list[_Spec] = []
        offset = 0
        for name, full in zip(_GATE_UP, layer.output_sizes, strict=True):
            start, local = layer.tp.shard(full, "a merged projection")
            specs.append((name, in_features, full, 0, start, offset, local))
            offset += local
        return specs
    if isinstance(layer, RowParallelLinear) and leaf in ("o_proj", "down_proj"):
        out = layer.weight.shape[0]
        return [(leaf, layer.input_size, out, layer.in_start, 0, 0, out)]
    return None
