"""The fused CPU decoder stack (cpu_step/fused.py) against the per-op forward, bit for bit.

Tiny random Llama / Qwen3-style (q/k norm) / Gemma 3 checkpoints are built here,
loaded in bfloat16, and their projections quantised as the GGUF loader would
(Q4_1 rows, Q8_0 rows, and a qkv mixing both: the row-split kernel). Each model
runs a prefill step (two prompts, the torch attention) and two decode steps
(the C decode attention) through a paged KV cache, once fused and once per op;
the hidden states and the caches must be equal.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from paged.runner.attention.metadata import AttentionMetadata, ForwardContext
from paged.runner.config import ModelConfig
from paged.runner.cpu_step import build, fused, fused_build
from paged.runner.layers.linear import QKVParallelLinear, ShardedLinear
from paged.runner.layers.quantized_linear import QGemmMatmul, RowSplitMatmul
from paged.runner.loader import load_model
from paged.runner.loader.gguf_quant import GGUFQuantizedTensor
from paged.runner.lora.layer import LoRALinear

BF16 = torch.bfloat16
Q = gguf.GGMLQuantizationType
BLOCK = 4

LLAMA: dict[str, Any] = {
    "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
}  # fmt: skip
GEMMA3: dict[str, Any] = {
    "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 24,
    "sliding_window": 4, "attn_logit_softcapping": 20.0, "final_logit_softcapping": 30.0,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
}  # fmt: skip


def _checkpoint(path: Path, family: str) -> Path:
    import transformers

    if family == "gemma3":
        config: Any = transformers.Gemma3TextConfig(**GEMMA3)
        cls: Any = transformers.Gemma3ForCausalLM
    elif family == "qwen3":
        config = transformers.Qwen3Config(**LLAMA, head_dim=32)
        cls = transformers.Qwen3ForCausalLM
    else:
        config = transformers.LlamaConfig(**LLAMA)
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    model = cls(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + torch.randn_like(param) * 0.3)
    model.save_pretrained(str(path))
    return path


def _gguf(weight: torch.Tensor, qtype: Q) -> GGUFQuantizedTensor:
    w = weight.float().numpy().astype(np.float32)
    return GGUFQuantizedTensor(gguf.quants.quantize(w, qtype), qtype, w.shape[1])


def _quantise(model: torch.nn.Module) -> None:
    """Q4_1 everywhere, down_proj Q8_0, qkv's v rows Q8_0 (a row-split layer)."""
    for name, layer in model.named_modules():
        if not isinstance(layer, ShardedLinear) or "lm_head" in name:
            continue
        weight = layer.weight.detach().float().clone()
        layer.start_quantized_load()
        staging = layer.quant_staging
        assert staging is not None
        if isinstance(layer, QKVParallelLinear):
            qk = layer.q_size + layer.kv_size
            staging.narrow(0, 0, qk).copy_(_gguf(weight[:qk], Q.Q4_1))
            staging.narrow(0, qk, layer.kv_size).copy_(_gguf(weight[qk:], Q.Q8_0))
        else:
            staging.copy_(_gguf(weight, Q.Q8_0 if "down_proj" in name else Q.Q4_1))
        layer.finish_quantized_load(BF16)


@pytest.fixture(params=["llama", "qwen3", "gemma3"])
def model(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    path = _checkpoint(tmp_path / request.param, request.param)
    m: Any = load_model(ModelConfig.from_pretrained(str(path), dtype="bfloat16"), "cpu")
    _quantise(m)
    yield m


def _inner(model: Any) -> Any:
    return model.model


def _caches(model: Any, num_blocks: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [
        (torch.randn(2, num_blocks, BLOCK, a.num_kv_heads, a.head_size, generator=gen)).to(BF16)
        for a in model.attention_layers()
    ]


def _step(
    lens_before: list[int], new: list[int], table: torch.Tensor
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata and positions for requests with `lens_before` cached tokens taking `new` more."""
    positions, slots, starts = [], [], [0]
    for r, (before, n) in enumerate(zip(lens_before, new, strict=True)):
        for p in range(before, before + n):
            positions.append(p)
            slots.append(int(table[r, p // BLOCK]) * BLOCK + p % BLOCK)
        starts.append(starts[-1] + n)
    seq_lens = [b + n for b, n in zip(lens_before, new, strict=True)]
    meta = AttentionMetadata(
        num_actual_tokens=len(positions), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64), max_query_len=max(new),
        max_seq_len=max(seq_lens),
    )  # fmt: skip
    return meta, torch.tensor(positions, dtype=torch.int64)


def _run(model: Any, steps: list[tuple[list[int], list[int]]], fused_on: bool) -> Any:
    """Hidden states of each step and the final caches, fused or per op."""
    inner = _inner(model)
    inner.cpu_fused = fused.FusedLayers()  # built afresh under this setting
    table = torch.arange(12, dtype=torch.int32).view(2, 6).flip(1).contiguous()
    caches = _caches(model, 12)
    gen = torch.Generator().manual_seed(7)
    outs = []
    for before, new in steps:
        meta, positions = _step(before, new, table)
        ids = torch.randint(0, 96, (positions.shape[0],), generator=gen)
        with torch.no_grad():
            outs.append(model(ids, positions, ForwardContext(meta, caches)))
        if fused_on:
            assert inner._fused_stack() is not None, "the fused stack did not build"
    return outs, caches


STEPS = [([0, 0], [5, 3]), ([5, 3], [1, 1]), ([6, 4], [1, 1]), ([7, 5], [1, 1])]


def test_fused_stack_is_the_per_op_forward_bit_for_bit(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    if fused_build.load_fused() is None:
        pytest.skip("no C compiler: the fused library cannot build")
    kernels = [m.quant for m in model.modules() if isinstance(m, ShardedLinear) and m.quant]
    assert any(isinstance(k, RowSplitMatmul) for k in kernels)
    assert all(isinstance(k, QGemmMatmul | RowSplitMatmul) for k in kernels)
    monkeypatch.setenv(fused_build.ENABLE_ENV, "off")
    want_out, want_caches = _run(model, STEPS, fused_on=False)
    monkeypatch.delenv(fused_build.ENABLE_ENV)
    got_out, got_caches = _run(model, STEPS, fused_on=True)
    for step, (got, want) in enumerate(zip(got_out, want_out, strict=True)):
        assert got.dtype is BF16 and torch.equal(got, want), f"step {step} differs"
    for got, want in zip(got_caches, want_caches, strict=True):
        assert torch.equal(got, want)


def test_switched_off_or_unquantised_models_take_the_per_op_path(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    inner = _inner(model)
    monkeypatch.setenv(fused_build.ENABLE_ENV, "off")
    inner.cpu_fused = fused.FusedLayers()
    assert inner._fused_stack() is None
    monkeypatch.delenv(fused_build.ENABLE_ENV)
    monkeypatch.setenv(build.ENABLE_ENV, "off")  # every C step op off: no fusion either
    inner.cpu_fused = fused.FusedLayers()
    assert inner._fused_stack() is None
    monkeypatch.delenv(build.ENABLE_ENV)
    monkeypatch.setenv(fused_build.ENABLE_ENV, "maybe")
    inner.cpu_fused = fused.FusedLayers()
    with pytest.raises(ValueError, match=fused_build.ENABLE_ENV):
        inner._fused_stack()


def test_a_layer_with_another_kernel_or_a_bias_does_not_qualify(model: Any) -> None:
    layer = _inner(model).layers[0]
    assert layer.fused_spec() is not None
    down = layer.mlp.down_proj
    kernel = down.quant
    down.quant = None  # a dense layer
    assert layer.fused_spec() is None
    down.quant = kernel
    down.bias = torch.nn.Parameter(torch.zeros(down.weight.shape[0], dtype=BF16))
    assert layer.fused_spec() is None


def test_positions_outside_the_rotary_table_raise(model: Any) -> None:
    if fused_build.load_fused() is None:
        pytest.skip("no C compiler: the fused library cannot build")
    inner = _inner(model)
    inner.cpu_fused = fused.FusedLayers()
    table = torch.arange(12, dtype=torch.int32).view(2, 6).contiguous()
    meta, positions = _step([0], [2], table[:1])
    positions[1] = 10_000
    with pytest.raises(ValueError, match="rotary"), torch.no_grad():
        model(torch.tensor([1, 2]), positions, ForwardContext(meta, _caches(model, 12)))


def test_steps_above_the_scratch_limit_run_per_op(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    if fused_build.load_fused() is None:
        pytest.skip("no C compiler: the fused library cannot build")
    monkeypatch.setattr(fused, "MAX_ROWS", 4)
    calls: list[int] = []
    original = fused.FusedDecoderStack.forward

    def counting(self: fused.FusedDecoderStack, *args: Any) -> torch.Tensor:
        calls.append(args[0].shape[0])
        return original(self, *args)

    monkeypatch.setattr(fused.FusedDecoderStack, "forward", counting)
    _run(model, STEPS, fused_on=True)
    assert calls == [2, 2, 2]  # the 8-row prefill ran per op


def test_a_missing_compiler_logs_and_keeps_the_per_op_path(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc-for-paged-tests")
    with caplog.at_level("WARNING"):
        assert fused_build.load_fused() is None
    assert "fused CPU layers unavailable" in caplog.text


class _LayerHooks:
    """Records the per-layer connector calls and whether each layer's new slots were written."""

    def __init__(self, caches: list[torch.Tensor], names: list[str], slots: torch.Tensor) -> None:
        self.caches, self.names, self.slots = caches, names, slots
        self.before = [self._rows(i).clone() for i in range(len(caches))]
        self.calls: list[tuple[str, str, list[bool]]] = []

    def _rows(self, i: int) -> torch.Tensor:
        flat = self.caches[i].flatten(1, 2)  # [2, blocks * BLOCK, H, D]
        return flat[:, self.slots]

    def _written(self) -> list[bool]:
        return [not torch.equal(self._rows(i), b) for i, b in enumerate(self.before)]

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.calls.append(("wait", layer_name, self._written()))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        assert kv_layer is self.caches[self.names.index(layer_name)]
        self.calls.append(("save", layer_name, self._written()))


def test_fused_stack_calls_the_connector_around_each_layer(model: Any) -> None:
    # A layer-wise KV connector needs the fused C stack to call back per layer: wait
    # before layer i reads its cache, save after it wrote it (never all layers at once).
    if fused_build.load_fused() is None:
        pytest.skip("no C compiler: the fused library cannot build")
    inner = _inner(model)
    inner.cpu_fused = fused.FusedLayers()
    table = torch.arange(12, dtype=torch.int32).view(2, 6).flip(1).contiguous()
    caches = _caches(model, 12)
    names = [a.layer_name for a in model.attention_layers()]
    meta, positions = _step([0, 0], [5, 3], table)
    hooks = _LayerHooks(caches, names, meta.slot_mapping)
    ids = torch.randint(0, 96, (positions.shape[0],), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        model(ids, positions, ForwardContext(meta, caches, kv_connector=hooks, layer_names=names))
    assert inner._fused_stack() is not None, "the fused stack did not build"
    n = len(names)
    want = []
    for i, name in enumerate(names):
        want.append(("wait", name, [j < i for j in range(n)]))
        want.append(("save", name, [j <= i for j in range(n)]))
    assert hooks.calls == want


def _lora_manager(model: Any, max_loras: int = 2) -> Any:
    """A LoRAManager on `model` with adapters "a" (rank 8) and "b" (rank 3, q/v/down only)."""
    from paged.runner.lora.config import LoRAAdapterSpec, LoRAConfig
    from paged.runner.lora.manager import LoRAManager
    from paged.runner.lora.weights import LoRAAdapterWeights, LoRAModuleWeights

    adapters: dict[str, LoRAAdapterWeights] = {}
    config = LoRAConfig(max_loras=max_loras, max_lora_rank=8)
    lm = LoRAManager(config, model, BF16, torch.device("cpu"), lambda path: adapters[path])
    gen = torch.Generator().manual_seed(11)
    for name, rank, only in (("a", 8, None), ("b", 3, ("q_proj", "v_proj", "down_proj"))):
        modules = {
            path: LoRAModuleWeights(
                torch.randn(rank, t.full_in, generator=gen) * 0.2,
                torch.randn(t.full_out, rank, generator=gen) * 0.2,
            )
            for path, t in lm.targets.items()
            if only is None or path.rsplit(".", 1)[1] in only
        }
        adapters[name] = LoRAAdapterWeights(rank, 2.0, modules)
        lm.add_lora(LoRAAdapterSpec(name, name))
    return lm


LORA_STEPS: list[list[str | None]] = [["a", "b"], [None, "a"], ["b", "b"], ["a", None]]
NO_LORA_STEPS: list[list[str | None]] = [[None, None]] * len(STEPS)


def _run_lora(model: Any, lm: Any, fused_on: bool, adapters: list[list[str | None]]) -> Any:
    """`_run` with each step's rows on the given adapters (two requests)."""
    inner = _inner(model)
    inner.cpu_fused = fused.FusedLayers()
    inner.cpu_fused.watch_lora(lambda: lm.batch.active)
    table = torch.arange(12, dtype=torch.int32).view(2, 6).flip(1).contiguous()
    caches = _caches(model, 12)
    gen = torch.Generator().manual_seed(7)
    outs = []
    for (before, new), rows in zip(STEPS, adapters, strict=True):
        meta, positions = _step(before, new, table)
        ids = torch.randint(0, 96, (positions.shape[0],), generator=gen)
        lm.begin_step(rows, np.array(new, dtype=np.int32))
        with torch.no_grad():
            outs.append(model(ids, positions, ForwardContext(meta, caches)))
        if fused_on:
            assert inner._fused_stack() is not None, "a LoRA step left the fused stack"
        lm.end_step()
    return outs, caches


def test_fused_lora_steps_are_the_per_op_lora_steps_bit_for_bit(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused layers add each matmul's LoRA delta with the per-op path's own C call."""
    if fused_build.load_fused() is None:
        pytest.skip("no C compiler: the fused library cannot build")
    lm = _lora_manager(model)
    layers = [m.lora for m in model.modules() if isinstance(m, ShardedLinear) and m.lora]
    assert layers and all(isinstance(x, LoRALinear) and x.native is not None for x in layers)
    monkeypatch.setenv(fused_build.ENABLE_ENV, "off")
    want_out, want_caches = _run_lora(model, lm, False, LORA_STEPS)
    base_out, _ = _run_lora(model, lm, False, NO_LORA_STEPS)
    monkeypatch.delenv(fused_build.ENABLE_ENV)
    got_out, got_caches = _run_lora(model, lm, True, LORA_STEPS)
    for step, (got, want) in enumerate(zip(got_out, want_out, strict=True)):
        assert got.dtype is BF16 and torch.equal(got, want), f"step {step} differs"
    for got, want in zip(got_caches, want_caches, strict=True):
        assert torch.equal(got, want)
    assert not torch.equal(want_out[0], base_out[0]), "the adapters changed nothing"


def test_lora_steps_without_c_plans_run_per_op(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """No C LoRA kernel (or float16 stacks): base steps stay fused, LoRA steps run per op."""
    if fused_build.load_fused() is None:
        pytest.skip("no C compiler: the fused library cannot build")
    from paged.runner.cpu_kernels import lora_delta

    monkeypatch.setenv(lora_delta.ISA_ENV, "off")
    lm = _lora_manager(model)
    inner = _inner(model)
    inner.cpu_fused = fused.FusedLayers()
    inner.cpu_fused.watch_lora(lambda: lm.batch.active)
    stack = inner._fused_stack()
    assert stack is not None and not stack.lora_ready
    lm.begin_step(["a", None], np.array([1, 1], dtype=np.int32))
    assert inner._fused_stack() is None
    lm.end_step()
    assert inner._fused_stack() is stack
