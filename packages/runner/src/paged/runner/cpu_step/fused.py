"""A decoder stack of the CPU quantised path run as two C calls a layer around its attention.

    embed -> residual (float32 scratch)
    per layer i:  paged_fused_pre_attention(plan_i)     [+ pending] norm, qkv, [q/k norm], rotary
                  attn_i(q, k, v, kv_cache_i, metadata)   the model's Attention module, unchanged
                  paged_fused_post_attention(plan_i)    o, norms + residual, gate/up, act, down
    final norm -> hidden [T, H] bf16 (a fresh tensor: the caller may keep it)

The maths is the per-op path's, call for call (fused_layer.c): a layer's output
equals the unfused forward's bit for bit (packages/runner/tests/test_cpu_fused_layers.py).
What the fusion removes is Python: at batch 1 the per-op forward of SmolLM2-135M
made ~300 module calls, ~300 tensor allocations and ~1,100 data_ptr reads a step.

`LayerPlan`s are built once from the loaded layers (`layer_spec` says whether a
layer qualifies: every projection on paged's C qgemm kernel without a bias, a
NeoX rotary over the whole head, SiLU or GeLU-tanh gating, one tensor-parallel
rank) and point at scratch buffers sized for `capacity` rows, grown on demand
up to MAX_ROWS; a step with more rows (a long prefill chunk) or any layer that
does not qualify runs the model's per-op forward instead. The attention is
called through its module so that every attention path (the C decode kernel,
the torch backend for prefill, connectors' hooks) stays as it is.

LoRA: a projection with a `LoRALinear` whose C plan exists (lora/layer.py's
`native`) gets that plan in the layer plan, and a step with LoRA rows passes its
token slots: each matmul is followed by the same paged_lora_delta call the per-op
path makes, so a fused LoRA step equals the per-op one bit for bit (tested). A
stack with a LoRA layer lacking a C plan (float16 stacks, no compiler) has
`lora_ready` False, and `FusedLayers` sends its LoRA steps per op.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from paged.kernels import ops as kernel_ops
from paged.kernels import reference
from paged.runner.attention.metadata import ForwardContext
from paged.runner.cpu_step import ops as native
from paged.runner.cpu_step.fused_build import load_fused
from paged.runner.layers.activation import GeluTanhAndMul, SiluAndMul
from paged.runner.layers.layernorm import RMSNorm
from paged.runner.layers.linear import ShardedLinear
from paged.runner.layers.quantized_linear import QGemmMatmul, RowSplitMatmul
from paged.runner.layers.rotary import RotaryEmbedding
from paged.runner.lora.layer import LoRABatch, LoRALinear

BF16 = torch.bfloat16
# Steps with more rows run the per-op path. 2048 is the scheduler's default token
# budget (vLLM's), so every step of a default engine runs fused: on a batch of 32
# prompts (~5.4k prompt tokens, 2048-row chunks) the prefill steps took 4.3-4.5 s
# of CPU fused against 4.7 s per op (one thread). The scratch (SmolLM2: ~19 KiB a
# row, ~38 MiB at 2048) is grown by powers of two only when such a step comes; a
# raised --max-num-batched-tokens runs its longer steps per op.
MAX_ROWS = 2048
MAX_PARTS = 4  # fused_layer.c's limit on kernels side by side in one projection
_ERRORS = {
    -1: "positions outside the rotary table",
    -2: "a quantised matmul refused its arguments",
    -3: "out of memory",
    -4: "more rows than the scratch buffers hold",
    -5: "the LoRA delta failed (a token slot out of range, or out of memory)",
}

_vp, _i64, _f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double


class _Kernels(ctypes.Structure):
    _fields_ = [
        ("qgemm_q4", _vp), ("qgemm_q8", _vp), ("rms_norm", _vp), ("add_rms_norm", _vp),
        ("gated_act", _vp), ("rotary_neox", _vp), ("qgemm_native", _vp), ("lora_delta", _vp),
    ]  # fmt: skip


class _Part(ctypes.Structure):
    _fields_ = [
        ("fmt", _i64), ("n", _i64), ("k", _i64), ("sub", _i64), ("levels", _i64),
        ("ratio", _f64), ("w", _vp),
    ]  # fmt: skip


class _Proj(ctypes.Structure):
    _fields_ = [("num_parts", _i64), ("n", _i64), ("parts", _Part * MAX_PARTS)]


_SCRATCH_BUFFERS = (
    "residual", "normed", "qkv", "q_normed", "k_normed", "q_rot", "k_rot", "o_out", "gate_up",
    "act", "mlp_out",
)  # fmt: skip


class _Scratch(ctypes.Structure):
    _fields_ = [("capacity", _i64), *((name, _vp) for name in _SCRATCH_BUFFERS)]


class _LayerPlan(ctypes.Structure):
    _fields_ = [
        ("kernels", _vp), ("scratch", _vp),
        ("hidden", _i64), ("q_size", _i64), ("kv_size", _i64), ("head_dim", _i64),
        ("inter", _i64), ("act_kind", _i64), ("max_pos", _i64), ("eps", _f64),
        ("cos_sin", _vp),
        ("input_norm", _vp), ("post_attn_norm", _vp), ("pre_ff_norm", _vp),
        ("post_ff_norm", _vp), ("q_norm", _vp), ("k_norm", _vp),
        ("qkv", _Proj), ("o", _Proj), ("gate_up", _Proj), ("down", _Proj),
        ("lora_qkv", _vp), ("lora_o", _vp), ("lora_gate_up", _vp), ("lora_down", _vp),
    ]  # fmt: skip


@dataclass(frozen=True)
class LayerSpec:
    """What a decoder layer is made of, as the fused calls need it (see `layer_spec`).

    sandwich=False (Llama): input_norm and post_attn_norm each fuse the residual
    add of the sub-layer before them. sandwich=True (Gemma 3): post_attn_norm and
    post_ff_norm normalise a sub-layer's output before its residual add, and
    pre_ff_norm normalises the stream before the MLP.
    """

    qkv: ShardedLinear
    o: ShardedLinear
    gate_up: ShardedLinear
    down: ShardedLinear
    act_kind: int  # native.SILU or native.GELU_TANH
    rotary: RotaryEmbedding
    attn: nn.Module  # called as attn(q, k, v, kv_cache, metadata) -> [T, q_size] bf16
    q_size: int
    kv_size: int
    head_dim: int
    input_norm: RMSNorm
    post_attn_norm: RMSNorm
    pre_ff_norm: RMSNorm | None = None
    post_ff_norm: RMSNorm | None = None
    q_norm: RMSNorm | None = None
    k_norm: RMSNorm | None = None

    @property
    def sandwich(self) -> bool:
        return self.pre_ff_norm is not None


def layer_spec(
    *, qkv: ShardedLinear, o: ShardedLinear, gate_up: ShardedLinear, down: ShardedLinear,
    act: nn.Module, rotary: RotaryEmbedding, attn: nn.Module, q_size: int, kv_size: int,
    head_dim: int, input_norm: RMSNorm, post_attn_norm: RMSNorm,
    pre_ff_norm: RMSNorm | None = None, post_ff_norm: RMSNorm | None = None,
    q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None,
) -> LayerSpec | None:  # fmt: skip
    """The layer's spec, or None when the fused calls cannot compute exactly what it does."""
    kinds = {SiluAndMul: native.SILU, GeluTanhAndMul: native.GELU_TANH}
    act_kind = kinds.get(type(act))
    projections = (qkv, o, gate_up, down)
    if act_kind is None or (q_norm is None) != (k_norm is None):
        return None
    if any(p.bias is not None or p.tp.size != 1 or _parts(p) is None for p in projections):
        return None
    if not (rotary.is_neox_style and rotary.rotary_dim == rotary.head_size == head_dim):
        return None
    # The C code trusts these shapes (its buffers are sized from them): check them once.
    hidden, inter = input_norm.weight.shape[0], down.weight.shape[1]
    expected = {
        id(qkv): (q_size + 2 * kv_size, hidden), id(o): (hidden, q_size),
        id(gate_up): (2 * inter, hidden), id(down): (hidden, inter),
    }  # fmt: skip
    for p in projections:
        parts = _parts(p) or []
        if (sum(k.out_features for k in parts), parts[0].in_features) != expected[id(p)]:
            return None
        if any(k.in_features != parts[0].in_features for k in parts):
            return None
    return LayerSpec(
        qkv, o, gate_up, down, act_kind, rotary, attn, q_size, kv_size, head_dim,
        input_norm, post_attn_norm, pre_ff_norm, post_ff_norm, q_norm, k_norm,
    )  # fmt: skip


def _parts(layer: ShardedLinear) -> list[QGemmMatmul] | None:
    """The layer's C-kernel matmuls in output-row order, or None if one is another kernel."""
    kernel = layer.quant
    parts = kernel.parts if isinstance(kernel, RowSplitMatmul) else [kernel]
    if len(parts) > MAX_PARTS or not all(isinstance(p, QGemmMatmul) for p in parts):
        return None
    return parts  # type: ignore[return-value]


class FusedDecoderStack:
    """The fused forward of one model's decoder layers (built by `build_stack`)."""

    def __init__(
        self, lib: ctypes.CDLL, specs: Sequence[LayerSpec], final_norm: RMSNorm,
        kernels: _Kernels,
    ) -> None:  # fmt: skip
        self.specs = list(specs)
        self.final_norm = final_norm
        self.sandwich = specs[0].sandwich
        self._pre = lib.paged_fused_pre_attention
        self._post = lib.paged_fused_post_attention
        self._kernels = kernels
        self._scratch = _Scratch()
        first = specs[0]
        self.hidden = first.input_norm.weight.shape[0]
        self.q_size, self.kv_size = first.q_size, first.kv_size
        self.inter = first.down.weight.shape[1]
        self.qk_norm = first.q_norm is not None
        self._keep: list[torch.Tensor] = []  # every tensor a plan points at
        # LoRA: the step's rows (shared by every LoRALinear); lora_ready: every LoRA
        # layer has a C plan (else steps with LoRA rows must run per op).
        self.lora_batch: LoRABatch | None = None
        self.lora_ready = True
        self._lora_plans: list[object] = []  # every LoRA C plan a layer plan points at
        self._plans = [self._plan(spec) for spec in specs]
        self._plan_ptrs = [ctypes.addressof(p) for p in self._plans]
        self._buffers: dict[str, torch.Tensor] = {}
        self._views: dict[int, tuple[torch.Tensor, ...]] = {}
        self._grow(8)

    def _plan(self, spec: LayerSpec) -> _LayerPlan:
        plan = _LayerPlan()
        plan.kernels = ctypes.addressof(self._kernels)
        plan.scratch = ctypes.addressof(self._scratch)
        plan.hidden, plan.q_size, plan.kv_size = self.hidden, spec.q_size, spec.kv_size
        plan.head_dim, plan.inter, plan.act_kind = spec.head_dim, self.inter, spec.act_kind
        table = spec.rotary.cos_sin_cache
        plan.cos_sin, plan.max_pos = self._ptr(table), table.shape[0]
        plan.eps = spec.input_norm.eps
        for field in ("input_norm", "post_attn_norm", "pre_ff_norm", "post_ff_norm", "q_norm",
                      "k_norm"):  # fmt: skip
            norm: RMSNorm | None = getattr(spec, field)
            setattr(plan, field, None if norm is None else self._ptr(norm._float_weight()))
        for field in ("qkv", "o", "gate_up", "down"):
            self._fill_proj(getattr(plan, field), getattr(spec, field))
            setattr(plan, f"lora_{field}", self._lora_plan(getattr(spec, field)))
        return plan

    def _lora_plan(self, layer: ShardedLinear) -> int | None:
        """The address of the layer's LoRA C plan; None without LoRA (or without a plan,
        which clears lora_ready)."""
        lora = layer.lora
        if lora is None:
            return None
        if not isinstance(lora, LoRALinear) or lora.native is None:
            self.lora_ready = False
            return None
        if self.lora_batch is not None and lora.batch is not self.lora_batch:
            self.lora_ready = False  # one step, one set of token slots
        self.lora_batch = lora.batch
        address = lora.native.lib.address
        if self._kernels.lora_delta not in (None, address):
            self.lora_ready = False  # two builds of the kernel: one pointer only
        self._kernels.lora_delta = address
        self._lora_plans.append(lora.native)
        return lora.native.address

    def _ptr(self, t: torch.Tensor) -> int:
        self._keep.append(t)
        return t.data_ptr()

    def _fill_proj(self, proj: _Proj, layer: ShardedLinear) -> None:
        parts = _parts(layer)
        assert parts is not None  # layer_spec checked it
        proj.num_parts = len(parts)
        proj.n = sum(p.out_features for p in parts)
        for slot, kernel in zip(proj.parts, parts, strict=False):
            gemm = kernel.gemm
            ratio = kernel.outlier_ratio
            slot.fmt, slot.sub = gemm.fmt, gemm.sub
            slot.n, slot.k = gemm.out_features, gemm.in_features
            slot.levels, slot.ratio = (1, 0.0) if ratio is None else (2, float(ratio))
            slot.w = self._ptr(gemm.packed)

    def _grow(self, rows: int) -> None:
        """Scratch for `rows` rows (a power of two, at most MAX_ROWS); drops the cached views."""
        h, q, kv, inter = self.hidden, self.q_size, self.kv_size, self.inter
        widths = {
            "residual": h, "normed": h, "qkv": q + 2 * kv, "q_normed": q if self.qk_norm else 0,
            "k_normed": kv if self.qk_norm else 0, "q_rot": q, "k_rot": kv, "o_out": h,
            "gate_up": 2 * inter, "act": inter, "mlp_out": h,
        }  # fmt: skip
        for name in _SCRATCH_BUFFERS:
            dtype = torch.float32 if name == "residual" else BF16
            buf = torch.empty(rows, widths[name], dtype=dtype)
            self._buffers[name] = buf
            setattr(self._scratch, name, buf.data_ptr() if widths[name] else None)
        self._scratch.capacity = rows
        self._views.clear()

    def _step_views(self, m: int) -> tuple[torch.Tensor, ...]:
        """(residual, q, k, v, mlp_out) for m rows: views of the scratch, made once per m."""
        views = self._views.get(m)
        if views is None:
            if m > self._scratch.capacity:
                self._grow(min(MAX_ROWS, 1 << (m - 1).bit_length()))
            b, q = self._buffers, self.q_size
            v = b["qkv"][:m, q + self.kv_size :]
            views = (b["residual"][:m], b["q_rot"][:m], b["k_rot"][:m], v, b["mlp_out"][:m])
            self._views[m] = views
        return views

    def takes(self, hidden: torch.Tensor) -> bool:
        """True when this step's embedded input can run fused (else the per-op forward)."""
        return (
            hidden.dim() == 2
            and 0 < hidden.shape[0] <= MAX_ROWS
            and hidden.device.type == "cpu"
            and hidden.shape[1] == self.hidden
        )

    def forward(
        self, hidden: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """hidden [T, H] (the embedded input) -> the final norm's output [T, H] bf16."""
        m = hidden.shape[0]
        residual, q, k, v, mlp_out = self._step_views(m)
        residual.copy_(hidden)  # the stream's float32 copy (x.float() of the per-op path)
        if positions.dtype is not torch.int64 or not positions.is_contiguous():
            positions = positions.to(torch.int64).contiguous()
        if positions.shape != (m,):
            raise ValueError(f"positions: expected [{m}], got {tuple(positions.shape)}")
        pos = positions.data_ptr()
        token_slots = self._token_slots(m)
        slots = None if token_slots is None else token_slots.data_ptr()
        pending = None  # Llama: the previous MLP's output, added by the next norm
        pre, post, plans, specs = self._pre, self._post, self._plan_ptrs, self.specs
        mlp_ptr = None if self.sandwich else mlp_out.data_ptr()
        kv_caches = ctx.kv_caches
        for i in range(len(plans)):
            ctx.wait_for_layer_load(i)
            _check(pre(plans[i], m, pending, pos, slots))
            out = specs[i].attn(q, k, v, kv_caches[i] if kv_caches else None, ctx.metadata_for(i))
            if out.dtype is not BF16 or out.shape != (m, self.q_size):
                raise RuntimeError(f"attention returned {out.dtype} {tuple(out.shape)}")
            out = out.contiguous()  # bound to a name: it must outlive the C call
            _check(post(plans[i], m, out.data_ptr(), slots))
            ctx.save_kv_layer(i)
            pending = mlp_ptr
        norm = self.final_norm
        if self.sandwich:
            return native.rms_norm(residual, norm._float_weight(), norm.eps)
        return native.add_rms_norm_(mlp_out, residual, norm._float_weight(), norm.eps)

    def _token_slots(self, m: int) -> torch.Tensor | None:
        """This step's LoRA token slots ([m] int64 on the CPU), None without LoRA rows."""
        batch = self.lora_batch
        slots = batch.token_slots if batch is not None else None
        if slots is None:
            return None
        if not self.lora_ready:
            raise RuntimeError("this fused stack cannot add LoRA deltas: run the step per op")
        if slots.shape != (m,) or slots.dtype is not torch.int64 or slots.device.type != "cpu":
            raise ValueError(
                f"LoRA token_slots: expected [{m}] int64 on the CPU, got "
                f"{tuple(slots.shape)} {slots.dtype} on {slots.device}"
            )
        return slots.contiguous()


def _check(code: int) -> None:
    if code != 0:
        raise ValueError(f"fused CPU layer: {_ERRORS.get(code, f'error {code}')}")


def _kernels(qgemm_lib: ctypes.CDLL, step_lib: ctypes.CDLL) -> _Kernels:
    def address(lib: ctypes.CDLL, name: str) -> int | None:
        return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value

    k = _Kernels()
    for field, lib, name in (
        ("qgemm_q4", qgemm_lib, "paged_qgemm_q4"), ("qgemm_q8", qgemm_lib, "paged_qgemm_q8"),
        ("rms_norm", step_lib, "paged_rms_norm"), ("add_rms_norm", step_lib, "paged_add_rms_norm"),
        ("gated_act", step_lib, "paged_gated_act"), ("rotary_neox", step_lib, "paged_rotary_neox"),
        ("qgemm_native", qgemm_lib, "paged_qgemm_native"),
    ):  # fmt: skip
        setattr(k, field, address(lib, name))
    return k


def build_stack(specs: Sequence[LayerSpec | None], final_norm: RMSNorm) -> FusedDecoderStack | None:
    """The fused stack for these layers, or None (a layer does not qualify, a library is
    missing, the model is not bfloat16 on the CPU reference backend)."""
    if not specs or any(s is None for s in specs):
        return None
    checked = [s for s in specs if s is not None]
    first = checked[0]
    probe = torch.empty(1, dtype=first.input_norm.weight.dtype)
    if probe.dtype is not BF16 or kernel_ops.backend_for(probe) is not reference:
        return None
    if first.input_norm.weight.device.type != "cpu" or not native.available():
        return None
    lib = load_fused()
    step_lib = native.step_library()
    libs = {id(p.gemm.lib) for s in checked for layer in (s.qkv, s.o, s.gate_up, s.down)
            for p in _parts(layer) or []}  # fmt: skip
    if lib is None or step_lib is None or len(libs) != 1:
        return None
    gemm_lib = _parts(first.qkv)[0].gemm.lib.lib  # type: ignore[index]
    shapes = {(s.q_size, s.kv_size, s.head_dim, s.sandwich, s.q_norm is not None) for s in checked}
    norms = [n for s in checked for n in (s.input_norm, s.post_attn_norm, s.pre_ff_norm,
             s.post_ff_norm, s.q_norm, s.k_norm) if n is not None]  # fmt: skip
    if len(shapes) != 1 or len({n.eps for n in norms}) != 1:
        return None  # layers that differ in shape or eps: one scratch layout, one eps
    return FusedDecoderStack(lib, checked, final_norm, _kernels(gemm_lib, step_lib))


class FusedLayers:
    """A model's handle on its fused stack: built on first use, rebuilt when the weights change.

    `stack(make_specs)` returns the stack (or None) for the model's current
    kernels; the cache is keyed by the first layer's qkv kernel object, which a
    (re)load replaces, so a model read before its quantised weights were
    finalised, or loaded again, gets a fresh answer.
    """

    def __init__(self) -> None:
        self._key: object = None
        self._stack: FusedDecoderStack | None = None
        # True while the step has LoRA rows (the LoRA manager's hook); None: never.
        self._lora_active: Callable[[], bool] | None = None

    def watch_lora(self, active: Callable[[], bool]) -> None:
        """Give the stack the LoRA layers attached since it was built (it is rebuilt), and
        send steps for which `active()` is true per op when the stack cannot add their
        deltas (`FusedDecoderStack.lora_ready` false: a LoRA layer without a C plan)."""
        self._lora_active = active
        self._key = None

    def stack(
        self, first_kernel: object, build: Callable[[], FusedDecoderStack | None]
    ) -> FusedDecoderStack | None:
        if first_kernel is None:
            return None  # not quantised (or not loaded yet)
        if first_kernel is not self._key:
            self._stack = build()
            self._key = first_kernel
        stack = self._stack
        if stack is not None and not stack.lora_ready and self._lora_active is not None:
            return None if self._lora_active() else stack
        return stack
