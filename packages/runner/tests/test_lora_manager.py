"""LoRAManager: slot packing, host LRU, validation against the model, and TP shard math.

The layers are paged's own (QKVParallelLinear, MergedColumnParallelLinear,
RowParallelLinear) under Hugging Face-like paths. The reference for a row with
adapter `a` is the same base layer with merged weights W + s * B @ A loaded
through the layer's own `load_weight`, so the adapter's shards must be cut
exactly as the base weight's (two TP ranks built in one process: a 1-process
gloo group satisfies TPGroup's check; no collective runs).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import cast

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from paged.kernels import ops
from paged.runner.cpu_step.fused import FusedDecoderStack, FusedLayers
from paged.runner.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from paged.runner.layers.parallel import TPGroup
from paged.runner.lora.config import LoRAAdapterSpec, LoRAConfig
from paged.runner.lora.layer import LoRALinear
from paged.runner.lora.manager import LoRAManager
from paged.runner.lora.weights import LoRAAdapterWeights, LoRAModuleWeights

F32 = torch.float32
HIDDEN, HEAD, INTER = 16, 4, 24
PREFIX = "model.layers.0"
# HF module -> (in, out) for 4 q heads; k/v use kv_heads * HEAD outputs.
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module", autouse=True)
def one_process_group() -> Iterator[None]:
    store = dist.HashStore()  # type: ignore[attr-defined]  # exported at runtime, not in stubs
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def shapes(heads: int, kv_heads: int) -> dict[str, tuple[int, int]]:
    q, kv = heads * HEAD, kv_heads * HEAD
    return {
        "q_proj": (HIDDEN, q), "k_proj": (HIDDEN, kv), "v_proj": (HIDDEN, kv),
        "o_proj": (q, HIDDEN), "gate_proj": (HIDDEN, INTER), "up_proj": (HIDDEN, INTER),
        "down_proj": (INTER, HIDDEN),
    }  # fmt: skip


def full_weights(heads: int, kv_heads: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {m: torch.randn(o, i, generator=gen) for m, (i, o) in shapes(heads, kv_heads).items()}


class Attn(nn.Module):
    def __init__(self, qkv: QKVParallelLinear, o: RowParallelLinear) -> None:
        super().__init__()
        self.qkv_proj, self.o_proj = qkv, o


class MLP(nn.Module):
    def __init__(self, gate_up: MergedColumnParallelLinear, down: RowParallelLinear) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj = gate_up, down


class Layer(nn.Module):
    def __init__(self, tp: TPGroup, heads: int, kv_heads: int, w: dict[str, torch.Tensor]) -> None:
        super().__init__()
        qkv = QKVParallelLinear(HIDDEN, HEAD, heads, kv_heads, tp=tp, dtype=F32)
        o = RowParallelLinear(
            heads * HEAD, HIDDEN, tp=tp, dtype=F32, shard=qkv.o_proj_shard, reduce_results=False
        )
        gate_up = MergedColumnParallelLinear(HIDDEN, [INTER, INTER], tp=tp, dtype=F32)
        down = RowParallelLinear(INTER, HIDDEN, tp=tp, dtype=F32, reduce_results=False)
        for part in ("q", "k", "v"):
            qkv.load_weight("weight", w[f"{part}_proj"], part)
        o.load_weight("weight", w["o_proj"], None)
        gate_up.load_weight("weight", w["gate_proj"], 0)
        gate_up.load_weight("weight", w["up_proj"], 1)
        down.load_weight("weight", w["down_proj"], None)
        self.self_attn = Attn(qkv, o)
        self.mlp = MLP(gate_up, down)


class Layers(nn.Module):
    def __init__(self, layer: Layer) -> None:
        super().__init__()
        self.layers = nn.ModuleList([layer])


class Tiny(nn.Module):
    """Hugging Face-like paths: model.layers.0.self_attn.qkv_proj, ..."""

    def __init__(self, tp: TPGroup, heads: int, kv_heads: int, w: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.model = Layers(Layer(tp, heads, kv_heads, w))
        self.cpu_fused = FusedLayers()  # as LlamaModel / Gemma3TextModel hold it

    @property
    def layer(self) -> Layer:
        return cast(Layer, self.model.layers[0])


def adapter(
    heads: int, kv_heads: int, rank: int, seed: int, modules: tuple[str, ...] = MODULES
) -> LoRAAdapterWeights:
    gen = torch.Generator().manual_seed(seed)
    pairs = {
        f"{PREFIX}.{'self_attn' if m[0] in 'qkvo' else 'mlp'}.{m}": LoRAModuleWeights(
            torch.randn(rank, i, generator=gen), torch.randn(o, rank, generator=gen)
        )
        for m, (i, o) in shapes(heads, kv_heads).items()
        if m in modules
    }
    return LoRAAdapterWeights(rank=rank, scaling=0.5 + seed, modules=pairs)


def merged(base: dict[str, torch.Tensor], weights: LoRAAdapterWeights) -> dict[str, torch.Tensor]:
    out = dict(base)
    for path, pair in weights.modules.items():
        m = path.rsplit(".", 1)[-1]
        out[m] = base[m] + weights.scaling * pair.lora_b @ pair.lora_a
    return out


def manager(
    model: nn.Module, loras: dict[str, LoRAAdapterWeights], max_loras: int = 2, **kw: int
) -> tuple[LoRAManager, list[str]]:
    loads: list[str] = []

    def loader(path: str) -> LoRAAdapterWeights:
        loads.append(path)
        if path not in loras:
            raise ValueError(f"lora_path: {path!r} does not exist")
        return loras[path]

    config = LoRAConfig(max_loras=max_loras, max_lora_rank=8, lora_dtype="float32", **kw)
    return LoRAManager(config, model, F32, torch.device("cpu"), loader), loads


@pytest.mark.parametrize(("tp_size", "heads", "kv_heads"), [(1, 4, 2), (2, 4, 2), (2, 4, 1)])
def test_shards_match_merged_weights(tp_size: int, heads: int, kv_heads: int) -> None:
    """Per rank, base + LoRA delta == the base layer loaded with W + s B A (column and row)."""
    base = full_weights(heads, kv_heads, 0)
    loras = {"a": adapter(heads, kv_heads, 8, 1), "b": adapter(heads, kv_heads, 3, 2)}
    rows = ["a", None, "b", "a"]
    counts = np.array([2, 1, 3, 1], dtype=np.int32)
    row_of_token = np.repeat(np.arange(len(rows)), counts)
    gen = torch.Generator().manual_seed(9)
    x_hidden = torch.randn(int(counts.sum()), HIDDEN, generator=gen)
    x_q = torch.randn(int(counts.sum()), heads * HEAD, generator=gen)
    x_inter = torch.randn(int(counts.sum()), INTER, generator=gen)
    for rank in range(tp_size):
        tp = TPGroup(rank, tp_size)
        model = Tiny(tp, heads, kv_heads, base)
        lm, _ = manager(model, loras)
        for name in loras:
            lm.add_lora(LoRAAdapterSpec(name, name))
        lm.begin_step(rows, counts)
        refs = {n: Tiny(tp, heads, kv_heads, merged(base, w)).layer for n, w in loras.items()}
        refs["base"] = Tiny(tp, heads, kv_heads, base).layer
        got = model.layer
        o, down = got.self_attn.o_proj, got.mlp.down_proj
        x_o = x_q[:, o.in_start : o.in_start + o.weight.shape[1]]
        x_down = x_inter[:, down.in_start : down.in_start + down.weight.shape[1]]
        for t, row in enumerate(row_of_token):
            ref = refs[rows[row] or "base"]
            cases = [
                (got.self_attn.qkv_proj, ref.self_attn.qkv_proj, x_hidden),
                (got.mlp.gate_up_proj, ref.mlp.gate_up_proj, x_hidden),
                (o, ref.self_attn.o_proj, x_o),
                (down, ref.mlp.down_proj, x_down),
            ]
            for layer, ref_layer, x in cases:
                torch.testing.assert_close(layer(x)[t], ref_layer(x)[t], rtol=1e-5, atol=1e-4)
        lm.end_step()
        torch.testing.assert_close(got.mlp.down_proj(x_down), refs["base"].mlp.down_proj(x_down))


def test_slot_packing_and_token_slots() -> None:
    base = full_weights(4, 2, 0)
    model = Tiny(TPGroup(), 4, 2, base)
    loras = {n: adapter(4, 2, 2, i) for i, n in enumerate("abc")}
    lm, loads = manager(model, loras, max_loras=2, max_cpu_loras=3)
    for n in "abc":
        lm.add_lora(LoRAAdapterSpec(n, n))
    lm.begin_step(["a", None, "a"], np.array([2, 1, 1], dtype=np.int32))
    assert lm.batch.token_slots is not None
    assert lm.batch.token_slots.tolist() == [0, 0, -1, 0]
    lm.begin_step(["b", "a"], np.array([1, 2], dtype=np.int32))
    assert lm.batch.token_slots.tolist() == [1, 0, 0]  # a keeps its slot, b takes the free one
    lm.begin_step(["a"], np.array([1], dtype=np.int32))
    lm.begin_step(["c"], np.array([1], dtype=np.int32))  # a used later than b: b's slot goes
    lm.begin_step(["a", "c"], np.array([1, 1], dtype=np.int32))
    assert lm.batch.token_slots.tolist() == [0, 1]
    assert lm.batch.scaling.tolist() == [0.5, 2.5]
    with pytest.raises(RuntimeError, match=r"3 distinct LoRA adapters .* more than max_loras=2"):
        lm.begin_step(["a", "b", "c"], np.array([1, 1, 1], dtype=np.int32))
    lm.begin_step([None, None], np.array([1, 1], dtype=np.int32))
    assert lm.batch.token_slots is None and not lm.batch.active
    assert loads == ["a", "b", "c"]


def test_host_lru_reload_remove_and_errors() -> None:
    model = Tiny(TPGroup(), 4, 2, full_weights(4, 2, 0))
    loras = {n: adapter(4, 2, 2, i) for i, n in enumerate("abc")}
    lm, loads = manager(model, loras, max_loras=1, max_cpu_loras=2)
    lm.add_lora(LoRAAdapterSpec("a", "a"))
    lm.add_lora(LoRAAdapterSpec("b", "b"))
    with pytest.raises(ValueError, match="'a' is already loaded"):
        lm.add_lora(LoRAAdapterSpec("a", "a"))
    lm.add_lora(LoRAAdapterSpec("c", "c"))  # beyond max_cpu_loras: a (least recent) leaves
    assert lm.list_loras() == ["b", "c"]
    lm.begin_step(["a"], np.array([1], dtype=np.int32))  # reloaded from its path
    assert loads == ["a", "b", "c", "a"] and lm.list_loras() == ["c", "a"]
    assert lm.remove_lora("a") is True and lm.remove_lora("a") is False
    lm.begin_step(["a"], np.array([1], dtype=np.int32))  # a request in flight still gets it
    assert loads[-1] == "a"
    with pytest.raises(ValueError, match="'zz' is not loaded and no lora_path is known"):
        lm.begin_step(["zz"], np.array([1], dtype=np.int32))
    with pytest.raises(ValueError, match="'nowhere' does not exist"):
        lm.add_lora(LoRAAdapterSpec("d", "nowhere"))


def test_validation_against_the_model() -> None:
    model = Tiny(TPGroup(), 4, 2, full_weights(4, 2, 0))
    wrong_kv = adapter(4, 4, 2, 0, ("k_proj",))  # k_proj out 16, the model's is 8
    extra = LoRAAdapterWeights(
        2,
        1.0,
        {"model.layers.7.mlp.up_proj": LoRAModuleWeights(torch.zeros(2, 16), torch.zeros(24, 2))},
    )
    big = adapter(4, 2, 16, 0, ("q_proj",))
    lm, _ = manager(model, {"kv": wrong_kv, "extra": extra, "big": big})
    with pytest.raises(
        ValueError,
        match=r"'model.layers.0.self_attn.k_proj' has lora_A \(2, 16\) "
        r"and lora_B \(16, 2\); the base layer needs lora_A \[r, 16\] and lora_B \[8, r\]",
    ):
        lm.add_lora(LoRAAdapterSpec("kv", "kv"))
    with pytest.raises(
        ValueError, match=r"'model.layers.7.mlp.up_proj' does not exist in this model"
    ):
        lm.add_lora(LoRAAdapterSpec("extra", "extra"))
    with pytest.raises(ValueError, match="rank 16 is greater than max_lora_rank 8"):
        lm.add_lora(LoRAAdapterSpec("big", "big"))
    assert lm.list_loras() == []


def test_lora_steps_leave_only_a_fused_stack_that_cannot_add_deltas() -> None:
    """A stack whose plans lack a LoRA layer's C plan must not run a step with LoRA rows;
    one that carries them runs every step (fused_layer.c adds the deltas)."""
    model = Tiny(TPGroup(), 4, 2, full_weights(4, 2, 0))
    lm, _ = manager(model, {"a": adapter(4, 2, 2, 0)})
    lm.add_lora(LoRAAdapterSpec("a", "a"))
    for ready in (False, True):
        kernel = object()  # a new key: the stack is built again
        stack = cast(FusedDecoderStack, SimpleNamespace(lora_ready=ready))

        def build(s: FusedDecoderStack = stack) -> FusedDecoderStack:
            return s

        assert model.cpu_fused.stack(kernel, build) is stack
        lm.begin_step([None, "a"], np.array([1, 1], dtype=np.int32))
        assert model.cpu_fused.stack(kernel, build) is (stack if ready else None)
        lm.end_step()
        assert model.cpu_fused.stack(kernel, build) is stack
        lm.begin_step([None], np.array([3], dtype=np.int32))
        assert model.cpu_fused.stack(kernel, build) is stack
        lm.end_step()


def test_cpu_layers_use_the_c_kernel_with_b_stored_transposed() -> None:
    """On the CPU each layer has a C plan; B_all is a view of its transposed stack."""
    model = Tiny(TPGroup(), 4, 2, full_weights(4, 2, 0))
    lm, _ = manager(model, {"a": adapter(4, 2, 2, 0)})
    lora = model.layer.self_attn.qkv_proj.lora
    assert isinstance(lora, LoRALinear) and lora.native is not None
    assert lora.b_all.transpose(1, 2).is_contiguous()
    lm.add_lora(LoRAAdapterSpec("a", "a"))
    lm.begin_step(["a"], np.array([2], dtype=np.int32))
    assert lm.batch.ranks.tolist()[lm._slot_names.index("a")] == 2
    lm.end_step()


@pytest.mark.skipif(
    not (ops.triton_available() and os.environ.get("TRITON_INTERPRET") == "1"),
    reason="the Triton LoRA kernels run on CPU only under TRITON_INTERPRET=1",
)
def test_triton_kernels_give_the_reference_deltas() -> None:
    """The layers' calling pattern (stacked slices, block-diagonal B) on the Triton backend."""
    model = Tiny(TPGroup(), 4, 2, full_weights(4, 2, 0))
    loras = {"a": adapter(4, 2, 8, 1), "b": adapter(4, 2, 3, 2)}
    lm, _ = manager(model, loras)
    for name in loras:
        lm.add_lora(LoRAAdapterSpec(name, name))
    lm.begin_step(["b", None, "a"], np.array([3, 2, 17], dtype=np.int32))
    x = torch.randn(22, HIDDEN, generator=torch.Generator().manual_seed(5))
    qkv = model.layer.self_attn.qkv_proj
    with ops.use_backend("reference"):
        expected = qkv(x)
    with ops.use_backend("triton"):
        got = qkv(x)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
