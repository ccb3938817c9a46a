"""The LoRA delta of one layer on the CPU in one C call (lora_delta.c), compiled on first use.

    y[t] += scaling[s] * B[s] @ (A[s] @ x[t])   for every row t with s = token_slots[t] >= 0

The torch reference (paged.kernels.reference.lora) takes ~130 us per layer call
for one adapter and ~390 us for eight at 32 rows, for ~1.5 MFLOP: per-call torch
overhead and a padded bmm, not arithmetic. This is one ctypes call per layer, and
the fused decoder layers (cpu_step/fused_layer.c) call the same C function through
a pointer without leaving C.

`LoRADeltaPlan` describes one layer's stacks once (a C struct pointing at them:
the tensors must stay where they are, which the LoRA layers' in-place slot writes
do); `plan.add_to(x, y, token_slots)` runs it. `lora_delta(...)` is the same for
loose tensors (tests, benchmarks).

$PAGED_CPU_LORA picks the build: "native" (default: `-march=native`, AVX-512
where the CPU has it), "scalar" (the portable C path only; the same bits, for
tests) or "off" (never build: the torch ops run). $CC picks the compiler. A
failure to build logs one warning and returns None: callers fall back to torch.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from paged.runner.c_compile import compiled_library, first_line, open_checked, package_source

logger = logging.getLogger(__name__)

__all__ = ["ISA_ENV", "LoRADeltaLibrary", "LoRADeltaPlan", "load_lora_delta", "lora_delta"]

ISA_ENV = "PAGED_CPU_LORA"
ISAS = ("native", "scalar")
MAX_SLICES = 4  # lora_delta.c's limit (q/k/v of a fused qkv is 3)
_ABI = 2  # paged_lora_abi() of the source this module drives
# -ffp-contract=off: only the source's explicit fused multiply-adds (fmaf, vfmadd) fuse,
# so the AVX-512 and portable builds give the same bits (tested).
_FLAGS = [
    "-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC", "-std=c11",
    "-Werror=implicit-function-declaration", "-Wl,--no-undefined",
]  # fmt: skip
_FORCE = {"native": [], "scalar": ["-DPAGED_LORA_FORCE_SCALAR"]}
_ERRORS = {
    -1: "token_slots holds a slot outside [-1, slots)",
    -2: "out of memory",
    -3: "inconsistent adapter stacks (a slot's rank above the stacks' width?)",
}
_DTYPES = (torch.bfloat16, torch.float32)
_loaded: dict[tuple[str, str], LoRADeltaLibrary | None] = {}

_vp, _i64 = ctypes.c_void_p, ctypes.c_int64


class _LoRAWeights(ctypes.Structure):
    """lora_delta.c's LoraWeights."""

    _fields_ = [
        ("a", _vp), ("bt", _vp), ("scaling", _vp), ("ranks", _vp),
        ("slots", _i64), ("rank", _i64), ("num_slices", _i64), ("in_features", _i64),
        ("out_features", _i64), ("ab_bf16", _i64), ("offsets", _i64 * (MAX_SLICES + 1)),
    ]  # fmt: skip


@dataclass(frozen=True)
class LoRADeltaLibrary:
    """The loaded kernel; `isa` is the path compiled in ("avx512" or "portable")."""

    lib: ctypes.CDLL
    isa: str
    path: Path

    @property
    def address(self) -> int:
        """paged_lora_delta's address (the fused layers call it through a pointer)."""
        return ctypes.cast(self.lib.paged_lora_delta, ctypes.c_void_p).value or 0


def requested_isa() -> str:
    """$PAGED_CPU_LORA, checked: "native", "scalar" or "off"."""
    isa = os.environ.get(ISA_ENV, "native").strip().lower() or "native"
    if isa not in (*ISAS, "off"):
        raise ValueError(f"{ISA_ENV} must be one of native, scalar, off; got {isa!r}")
    return isa


def load_lora_delta(isa: str | None = None) -> LoRADeltaLibrary | None:
    """The kernel for `isa` (default $PAGED_CPU_LORA), compiled if needed; None if off or
    unavailable. Kept per (isa, compiler): later calls cost a dict lookup."""
    isa = requested_isa() if isa is None else isa
    if isa == "off":
        return None
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {', '.join(ISAS)}, got {isa!r}")
    cc = os.environ.get("CC") or "cc"
    if (isa, cc) not in _loaded:
        _loaded[(isa, cc)] = _build_and_load(isa, cc)
    return _loaded[(isa, cc)]


def _build_and_load(isa: str, cc: str) -> LoRADeltaLibrary | None:
    try:
        source = package_source("paged.runner.cpu_kernels", "lora_delta.c")
        path = compiled_library(cc, source, "lora_delta.c", f"lora_delta-{isa}",
                                [*_FLAGS, *_FORCE[isa]])  # fmt: skip
        lib = open_checked(path, "paged_lora_abi", _ABI)
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("LoRA C kernel unavailable (%s); using the torch ops", first_line(exc))
        return None
    lib.paged_lora_isa.restype = ctypes.c_int
    lib.paged_lora_delta.restype = ctypes.c_int
    lib.paged_lora_delta.argtypes = [_vp, _vp, _i64, _vp, _i64, ctypes.c_int, _vp, _i64,
                                     ctypes.c_int]  # fmt: skip
    return LoRADeltaLibrary(lib, "avx512" if lib.paged_lora_isa() else "portable", path)


def _check_stack(name: str, t: torch.Tensor, ndim: int) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got {t.device}")


class LoRADeltaPlan:
    """One layer's adapter stacks as lora_delta.c reads them (see the module docstring).

    a_all [S, n*R, in] contiguous; bt_all [S, n*R, out] contiguous (B transposed);
    both bfloat16 or both float32. scaling [S] float32; ranks [S] int64 (each slot's
    adapter rank, 0: empty) or None (every slot R wide). `offsets` [n + 1]: slice i
    adds to output columns [offsets[i], offsets[i+1]), offsets[0] = 0, offsets[n] = out.
    ValueError naming the argument when they do not fit together.
    """

    def __init__(
        self,
        lib: LoRADeltaLibrary,
        a_all: torch.Tensor,
        bt_all: torch.Tensor,
        scaling: torch.Tensor,
        ranks: torch.Tensor | None,
        offsets: Sequence[int],
    ) -> None:
        _check_stack("a_all", a_all, 3)
        _check_stack("bt_all", bt_all, 3)
        slots, width, in_features = a_all.shape
        n = len(offsets) - 1
        if a_all.dtype not in _DTYPES or bt_all.dtype != a_all.dtype:
            raise ValueError(
                f"a_all and bt_all must both be bfloat16 or float32, got {a_all.dtype} and "
                f"{bt_all.dtype}"
            )
        if not (a_all.is_contiguous() and bt_all.is_contiguous()):
            raise ValueError("a_all and bt_all must be contiguous")
        if not 1 <= n <= MAX_SLICES or width % n or width == 0:
            raise ValueError(
                f"offsets: {n} slices must be 1..{MAX_SLICES} and divide a_all's {width} rows"
            )
        out = bt_all.shape[2]
        if bt_all.shape[:2] != (slots, width):
            raise ValueError(
                f"bt_all must be [{slots}, {width}, out] like a_all, got {tuple(bt_all.shape)}"
            )
        if (
            offsets[0] != 0
            or offsets[-1] != out
            or any(b < e for b, e in zip(offsets[1:], offsets[:-1], strict=True))
        ):
            raise ValueError(f"offsets must rise from 0 to out={out}, got {list(offsets)}")
        _check_stack("scaling", scaling, 1)
        if scaling.shape[0] != slots or scaling.dtype != torch.float32:
            raise ValueError(
                f"scaling must be [{slots}] float32, got {tuple(scaling.shape)} {scaling.dtype}"
            )
        if ranks is not None:
            _check_stack("ranks", ranks, 1)
            if ranks.shape[0] != slots or ranks.dtype != torch.int64:
                raise ValueError(
                    f"ranks must be [{slots}] int64, got {tuple(ranks.shape)} {ranks.dtype}"
                )
        self.lib = lib
        self.in_features, self.out_features = in_features, out
        self._keep = (a_all, bt_all, scaling, ranks)  # the struct points at them
        w = _LoRAWeights()
        w.a, w.bt, w.scaling = a_all.data_ptr(), bt_all.data_ptr(), scaling.data_ptr()
        w.ranks = None if ranks is None else ranks.data_ptr()
        w.slots, w.rank, w.num_slices = slots, width // n, n
        w.in_features, w.out_features = in_features, out
        w.ab_bf16 = int(a_all.dtype is torch.bfloat16)
        for i, off in enumerate(offsets):
            w.offsets[i] = off
        self._weights = w
        self.address = ctypes.addressof(w)  # for the fused layers' plans

    def add_to(self, x: torch.Tensor, y: torch.Tensor, token_slots: torch.Tensor) -> None:
        """y [T, out] += the deltas of x [T, in] (rows with token_slots -1 untouched), in place.

        x and y: bfloat16 or float32 CPU tensors with contiguous rows; token_slots:
        [T] int64 contiguous. ValueError naming the argument otherwise.
        """
        m = x.shape[0] if x.dim() == 2 else -1
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"x must be [T, {self.in_features}], got shape {tuple(x.shape)}")
        if y.dim() != 2 or y.shape != (m, self.out_features):
            raise ValueError(f"y must be [{m}, {self.out_features}], got shape {tuple(y.shape)}")
        if token_slots.shape != (m,) or token_slots.dtype != torch.int64:
            raise ValueError(
                f"token_slots must be [{m}] int64, got {tuple(token_slots.shape)} "
                f"{token_slots.dtype}"
            )
        for name, t in (("x", x), ("y", y)):
            if t.dtype not in _DTYPES:
                raise ValueError(f"{name} must be bfloat16 or float32, got {t.dtype}")
        for name, t in (("x", x), ("y", y), ("token_slots", token_slots)):
            if t.device.type != "cpu":
                raise ValueError(f"{name} must be on the CPU, got {t.device}")
            rows_ok = t.dim() == 1 or m <= 1 or t.stride(0) >= t.shape[1]
            if not (t.stride(-1) == 1 or t.shape[-1] == 1) or not rows_ok:
                raise ValueError(f"{name} must have contiguous rows, got strides {t.stride()}")
        rc = self.lib.lib.paged_lora_delta(
            self.address, token_slots.data_ptr(), m, x.data_ptr(), x.stride(0),
            int(x.dtype is torch.bfloat16), y.data_ptr(), y.stride(0),
            int(y.dtype is torch.bfloat16),
        )  # fmt: skip
        if rc != 0:
            raise ValueError(f"lora_delta: {_ERRORS.get(rc, f'error {rc}')}")


def lora_delta(
    x: torch.Tensor,
    y: torch.Tensor,
    token_slots: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: torch.Tensor,
    offsets: Sequence[int],
    *,
    ranks: torch.Tensor | None = None,
    lib: LoRADeltaLibrary | None = None,
) -> None:
    """`LoRADeltaPlan(...).add_to(x, y, token_slots)` for loose tensors (tests, benchmarks).

    lora_b is B as the torch ops take it, [S, out, n*R] (any strides: transposed
    here when it is not already a transposed view). RuntimeError if the kernel
    could not be built.
    """
    lib = lib or load_lora_delta()
    if lib is None:
        raise RuntimeError("the LoRA C kernel is unavailable (see the log)")
    if lora_b.dim() != 3:
        raise ValueError(f"lora_b must be [S, out, n*R], got shape {tuple(lora_b.shape)}")
    plan = LoRADeltaPlan(lib, lora_a, lora_b.transpose(1, 2).contiguous(), scaling, ranks, offsets)
    plan.add_to(x, y, token_slots)
