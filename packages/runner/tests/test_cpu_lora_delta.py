"""The LoRA delta C kernel (cpu_kernels/lora_delta.c) against the torch reference.

The reference is what LoRALinear.add_to ran before the kernel (and still runs
off the CPU): x in the adapters' dtype, `lora_shrink`, then `lora_expand` adding
into y. The kernel sums in another order, so the results agree within float32
rounding (float32 outputs) or one bfloat16 rounding (bfloat16 outputs); rows
without an adapter must be untouched, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from paged.kernels import reference
from paged.runner.cpu_kernels import lora_delta as kernel
from paged.runner.cpu_kernels.lora_delta import LoRADeltaPlan, load_lora_delta, lora_delta

BF16, F32 = torch.bfloat16, torch.float32


@pytest.fixture(scope="module")
def lib() -> kernel.LoRADeltaLibrary:
    built = load_lora_delta("native")
    if built is None:
        pytest.skip("no C compiler: the LoRA kernel cannot build")
    return built


def _stacks(
    slots: int, rank: int, in_features: int, offsets: list[int], ranks: list[int],
    dtype: torch.dtype, seed: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """A [S, n*R, in], block-diagonal B [S, out, n*R] (zero past each slot's rank), scaling."""
    gen = torch.Generator().manual_seed(seed)
    n = len(offsets) - 1
    a = torch.zeros(slots, n * rank, in_features)
    b = torch.zeros(slots, offsets[-1], n * rank)
    for s, r in enumerate(ranks):
        for i in range(n):
            a[s, i * rank : i * rank + r] = torch.randn(r, in_features, generator=gen) * 0.2
            rows = slice(offsets[i], offsets[i + 1])
            b[s, rows, i * rank : i * rank + r] = (
                torch.randn(offsets[i + 1] - offsets[i], r, generator=gen) * 0.2
            )
    scaling = torch.rand(slots, generator=gen) * 2 + 0.25
    return a.to(dtype), b.to(dtype), scaling


def _reference(
    x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    scaling: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    out = y.clone()
    xd = x if x.dtype == a.dtype else x.to(a.dtype)
    shrunk = reference.lora_shrink(xd, a, slots)
    reference.lora_expand(shrunk, b, slots, out, 0, scaling)
    return out


PATTERNS = {
    "all_base": lambda t: [-1] * t,
    "one_slot": lambda t: [3] * t,
    "eight_interleaved": lambda t: [i % 8 for i in range(t)],
    "prefill_and_decode": lambda t: [5] * (t - 12) + [0, -1, 2, 7, 1, 1, -1, 4, 6, 3, 2, 0],
}
SHAPES = {  # in_features, slice offsets (qkv-like, gate_up-like, o-like)
    "qkv": (64, [0, 64, 96, 128]),
    "gate_up": (48, [0, 80, 160]),
    "down": (160, [0, 48]),
}


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize(("ab", "xy"), [(BF16, BF16), (F32, F32), (BF16, F32), (F32, BF16)])
def test_kernel_equals_the_reference(
    lib: kernel.LoRADeltaLibrary, pattern: str, shape: str, ab: torch.dtype, xy: torch.dtype
) -> None:
    in_features, offsets = SHAPES[shape]
    t = 70 if pattern == "prefill_and_decode" else 32
    slots = torch.tensor(PATTERNS[pattern](t), dtype=torch.int64)
    ranks = [16, 3, 16, 1, 9, 16, 12, 16]
    a, b, scaling = _stacks(8, 16, in_features, offsets, ranks, ab, seed=len(pattern))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(t, in_features, generator=gen).to(xy)
    y = torch.randn(t, offsets[-1], generator=gen).to(xy)
    want = _reference(x, y, slots, a, b, scaling)
    got = y.clone()
    lora_delta(x, got, slots, a, b, scaling, offsets,
               ranks=torch.tensor(ranks, dtype=torch.int64), lib=lib)  # fmt: skip
    base = slots < 0
    assert torch.equal(got[base], y[base]), "a row without an adapter changed"
    tol = 1e-5 if (ab, xy) == (F32, F32) else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    if pattern != "all_base":
        assert not torch.equal(got[~base], y[~base]), "no delta was added"


@pytest.mark.parametrize("rank", [1, 8, 16, 32, 64])
def test_every_rank_with_and_without_per_slot_ranks(
    lib: kernel.LoRADeltaLibrary, rank: int
) -> None:
    in_features, offsets = SHAPES["qkv"]
    ranks = [rank, max(1, rank // 2), rank, max(1, rank - 1)]
    a, b, scaling = _stacks(4, rank, in_features, offsets, ranks, BF16, seed=rank)
    slots = torch.tensor([i % 4 for i in range(19)], dtype=torch.int64)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(19, in_features, generator=gen).to(BF16)
    y = torch.randn(19, offsets[-1], generator=gen).to(BF16)
    want = _reference(x, y, slots, a, b, scaling)
    full, trimmed = y.clone(), y.clone()
    lora_delta(x, full, slots, a, b, scaling, offsets, lib=lib)
    lora_delta(x, trimmed, slots, a, b, scaling, offsets,
               ranks=torch.tensor(ranks, dtype=torch.int64), lib=lib)  # fmt: skip
    torch.testing.assert_close(full.float(), want.float(), rtol=2e-2, atol=2e-2)
    # Skipping the zero padding past a slot's rank changes nothing.
    assert torch.equal(full, trimmed)


def test_portable_build_gives_the_same_bits(lib: kernel.LoRADeltaLibrary) -> None:
    portable = load_lora_delta("scalar")
    assert portable is not None and portable.isa == "portable"
    in_features, offsets = 200, [0, 37, 75, 131]  # tails in every lane/column loop
    a, b, scaling = _stacks(3, 8, in_features, offsets, [8, 5, 2], BF16, seed=9)
    slots = torch.tensor([2, -1, 0, 0, 1, 2, 2, 0, 1, 1, 0, 2, -1], dtype=torch.int64)
    x = torch.randn(13, in_features).to(BF16)
    y = torch.randn(13, offsets[-1]).to(BF16)
    got = [y.clone(), y.clone()]
    for out, which in zip(got, (lib, portable), strict=True):
        lora_delta(x, out, slots, a, b, scaling, offsets, lib=which)
    assert torch.equal(got[0], got[1])


def test_bad_arguments_raise_value_errors_naming_them(lib: kernel.LoRADeltaLibrary) -> None:
    in_features, offsets = SHAPES["gate_up"]
    a, b, scaling = _stacks(2, 4, in_features, offsets, [4, 4], BF16, seed=3)
    bt = b.transpose(1, 2).contiguous()
    plan = LoRADeltaPlan(lib, a, bt, scaling, None, offsets)
    x = torch.randn(3, in_features).to(BF16)
    y = torch.zeros(3, offsets[-1], dtype=BF16)
    ok = torch.tensor([0, 1, -1])
    with pytest.raises(ValueError, match="token_slots holds a slot outside"):
        plan.add_to(x, y, torch.tensor([0, 2, -1]))
    with pytest.raises(ValueError, match="token_slots holds a slot outside"):
        plan.add_to(x, y, torch.tensor([0, -2, -1]))
    assert torch.equal(y, torch.zeros_like(y)), "a refused call wrote into y"
    with pytest.raises(ValueError, match=r"token_slots must be \[3\] int64"):
        plan.add_to(x, y, ok.to(torch.int32))
    with pytest.raises(ValueError, match=r"x must be \[T, 48\]"):
        plan.add_to(x[:, :40], y, ok)
    with pytest.raises(ValueError, match=r"y must be \[3, 160\]"):
        plan.add_to(x, y[:, :100], ok)
    with pytest.raises(ValueError, match="x must be bfloat16 or float32"):
        plan.add_to(x.half(), y, ok)
    with pytest.raises(ValueError, match="y must have contiguous rows"):
        plan.add_to(x, torch.zeros(160, 3, dtype=BF16).t(), ok)
    with pytest.raises(ValueError, match="a_all and bt_all must both be"):
        LoRADeltaPlan(lib, a, bt.float(), scaling, None, offsets)
    with pytest.raises(ValueError, match="offsets must rise from 0 to out=160"):
        LoRADeltaPlan(lib, a, bt, scaling, None, [0, 90, 150])
    with pytest.raises(ValueError, match="offsets: 3 slices"):
        LoRADeltaPlan(lib, a, bt, scaling, None, [0, 50, 100, 160])
    with pytest.raises(ValueError, match=r"scaling must be \[2\] float32"):
        LoRADeltaPlan(lib, a, bt, scaling.double(), None, offsets)
    with pytest.raises(ValueError, match=r"ranks must be \[2\] int64"):
        LoRADeltaPlan(lib, a, bt, scaling, torch.tensor([4, 4, 4]), offsets)
    wide = LoRADeltaPlan(lib, a, bt, scaling, torch.tensor([4, 5]), offsets)
    with pytest.raises(ValueError, match="a slot's rank above the stacks' width"):
        wide.add_to(x, y, ok)


def test_the_isa_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernel.ISA_ENV, "off")
    assert load_lora_delta() is None
    monkeypatch.setenv(kernel.ISA_ENV, "avx9")
    with pytest.raises(ValueError, match=kernel.ISA_ENV):
        load_lora_delta()
