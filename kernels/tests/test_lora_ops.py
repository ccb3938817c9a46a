"""LoRA shrink/expand: the reference against a per-row definition, Triton against the reference."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from paged.kernels import ops, reference
from paged.kernels.lora import LORA_BLOCK_T, group_lora_rows

triton_ops = pytest.importorskip("paged.kernels.triton_ops")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


def _per_row_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The definition, row by row in float64 (slow, obviously right)."""
    y = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float64)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            y[t] = a[s].double() @ x[t].double()
    return y


def _per_row_expand(
    y: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    out: torch.Tensor,
    offset: int,
    scaling: torch.Tensor,
) -> torch.Tensor:
    want = out.double().clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want[t, offset : offset + b.shape[1]] += scaling[s].double() * (
                b[s].double() @ y[t].double()
            )
    return want


def _slots(gen: torch.Generator, t: int, s: int) -> torch.Tensor:
    return torch.randint(-1, s, (t,), generator=gen)


# ------------------------------------------------------------------ grouping
def test_group_lora_rows_layout() -> None:
    g = group_lora_rows(torch.tensor([1, -1, 0, 1, 0, 2, 2]))
    assert g.slots == (0, 1, 2)
    assert isinstance(g.rows[2], slice) and g.rows[2] == slice(5, 7)  # consecutive: a view
    assert isinstance(g.rows[0], torch.Tensor) and g.rows[0].tolist() == [2, 4]
    assert g.order.tolist() == [2, 4, 0, 3, 5, 6]
    blocks = list(
        zip(g.block_slot.tolist(), g.block_start.tolist(), g.block_end.tolist(), strict=True)
    )
    assert blocks == [(0, 0, 2), (1, 2, 4), (2, 4, 6)]
    # Three groups of 2 rows: one padded [3 slots, 2 rows] bmm, nothing left to the loop.
    assert g.padded is not None and g.loop == ()
    assert (g.padded.slot_lo, g.padded.num_slots, g.padded.rows_per_slot) == (0, 3, 2)
    assert g.padded.rows.tolist() == [2, 4, 0, 3, 5, 6]
    assert g.padded.index.tolist() == [0, 1, 2, 3, 4, 5]
    assert g.padded.entry_slots.tolist() == [0, 0, 1, 1, 2, 2] and g.padded.dense


def test_group_lora_rows_leaves_large_groups_to_the_loop() -> None:
    # A 30-row prefill chunk of slot 2 next to decode rows of slots 0, 1 and 3.
    slots = torch.tensor([0, 1, *([2] * 30), 3, 1])
    g = group_lora_rows(slots)
    assert g.slots == (0, 1, 2, 3) and g.loop == (2,) and g.rows[2] == slice(2, 32)
    p = g.padded
    assert p is not None and (p.slot_lo, p.num_slots, p.rows_per_slot) == (0, 4, 2)
    assert p.rows.tolist() == [0, 1, 33, 32]
    assert p.index.tolist() == [0, 2, 3, 6]  # slot 2's positions 4, 5 are padding
    assert not p.dense
    # Slots far apart: padding would exceed twice the rows, every group loops.
    sparse = group_lora_rows(torch.tensor([0, 7, 0, 7]))
    assert sparse.padded is None and sparse.loop == (0, 1)
    single = group_lora_rows(torch.tensor([3, 3, -1]))
    assert single.padded is None and single.loop == (0,)


def test_group_lora_rows_splits_long_segments_into_blocks() -> None:
    n = 2 * LORA_BLOCK_T + 3
    g = group_lora_rows(torch.full((n,), 4, dtype=torch.int32))
    assert g.rows == (slice(0, n),)
    assert g.block_slot.tolist() == [4, 4, 4]
    assert g.block_start.tolist() == [0, LORA_BLOCK_T, 2 * LORA_BLOCK_T]
    assert g.block_end.tolist() == [LORA_BLOCK_T, 2 * LORA_BLOCK_T, n]


def test_group_lora_rows_rejects_bad_slots() -> None:
    with pytest.raises(ValueError, match="token_slots must be >= -1"):
        group_lora_rows(torch.tensor([0, -2]))
    with pytest.raises(ValueError, match="int32 or int64"):
        group_lora_rows(torch.tensor([0.0]))
    with pytest.raises(ValueError, match=r"\[num_tokens\]"):
        group_lora_rows(torch.zeros(2, 2, dtype=torch.int64))
    g = group_lora_rows(torch.tensor([-1, -1]))
    assert g.slots == () and g.num_blocks == 0 and g.order.numel() == 0


# ------------------------------------------------------------------ reference
@pytest.mark.parametrize("layout", ["random", "prefill+decode", "sparse", "one-slot"])
@pytest.mark.parametrize("t", [1, 7, 40])
def test_reference_matches_per_row_definition(t: int, layout: str, gen: torch.Generator) -> None:
    s, r, n_in, n_out, width, off = 6, 8, 24, 20, 50, 13
    x, a = _randn(gen, t, n_in), _randn(gen, s, r, n_in)
    b, out = _randn(gen, s, n_out, r), _randn(gen, t, width)
    scaling = torch.rand(s, generator=gen) + 0.5
    if layout == "random":  # mostly the padded bmm
        slots = _slots(gen, t, s)
    elif layout == "prefill+decode":  # a chunk in the loop, the rest padded
        slots = torch.cat([torch.full((t - t // 4,), 2), _slots(gen, t // 4, s)])
    elif layout == "sparse":  # slots 0 and 5 only: the loop
        slots = torch.where(torch.arange(t) % 2 == 0, 0, 5)
    else:
        slots = torch.where(torch.arange(t) % 3 == 0, -1, 4)
    y = reference.lora_shrink(x, a, slots)
    torch.testing.assert_close(y.double(), _per_row_shrink(x, a, slots), rtol=1e-5, atol=1e-5)
    assert y[slots == -1].abs().sum() == 0
    want = _per_row_expand(y, b, slots, out, off, scaling)
    before = out.clone()
    reference.lora_expand(y, b, slots, out, off, scaling)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[slots == -1], before[slots == -1])  # base rows untouched
    keep = torch.ones(width, dtype=torch.bool)
    keep[off : off + n_out] = False
    assert torch.equal(out[:, keep], before[:, keep])  # columns outside the slice untouched


def test_reference_mixed_dtypes_accumulate_in_float32(gen: torch.Generator) -> None:
    # float32 activations with bf16 adapter weights (lora_dtype): computed in float32.
    x, a = _randn(gen, 5, 16), _randn(gen, 2, 4, 16, dtype=torch.bfloat16)
    slots = torch.tensor([0, 1, -1, 1, 0])
    y = reference.lora_shrink(x, a, slots)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), _per_row_shrink(x, a, slots), rtol=1e-5, atol=1e-5)
    # bf16 activations: fp32 sums rounded once, not a bf16 running sum.
    xb = _randn(gen, 3, 512, dtype=torch.bfloat16)
    ab = _randn(gen, 1, 4, 512, dtype=torch.bfloat16)
    yb = reference.lora_shrink(xb, ab, torch.zeros(3, dtype=torch.int64))
    exact = _per_row_shrink(xb, ab, torch.zeros(3, dtype=torch.int64)).to(torch.bfloat16)
    assert torch.equal(yb, exact)


def test_reference_reuses_precomputed_groups(gen: torch.Generator) -> None:
    x, a = _randn(gen, 6, 8), _randn(gen, 2, 4, 8)
    slots = torch.tensor([1, 1, 0, -1, 0, 1])
    groups = group_lora_rows(slots)
    assert torch.equal(
        reference.lora_shrink(x, a, slots, groups=groups), reference.lora_shrink(x, a, slots)
    )
    with pytest.raises(ValueError, match="groups were built for 6 tokens"):
        reference.lora_shrink(x[:5], a, slots[:5], groups=groups)
    with pytest.raises(ValueError, match="uses slot 1 but only 1 exist"):
        reference.lora_shrink(x, a[:1], slots, groups=groups)


def test_reference_rejects_bad_arguments(gen: torch.Generator) -> None:
    x, a, b = _randn(gen, 4, 8), _randn(gen, 2, 4, 8), _randn(gen, 2, 6, 4)
    slots, scaling, out = torch.tensor([0, 1, -1, 0]), torch.ones(2), torch.zeros(4, 10)
    with pytest.raises(ValueError, match="lora_a in_features 7 must equal x's 8"):
        reference.lora_shrink(x, _randn(gen, 2, 4, 7), slots)
    with pytest.raises(ValueError, match="token_slots has 3 entries, x 4 rows"):
        reference.lora_shrink(x, a, slots[:3])
    with pytest.raises(ValueError, match="uses slot 2 but only 2 exist"):
        reference.lora_shrink(x, a, torch.tensor([0, 2, -1, 0]))
    with pytest.raises(ValueError, match="x must be float32"):
        reference.lora_shrink(x.long(), a, slots)
    y = reference.lora_shrink(x, a, slots)
    with pytest.raises(ValueError, match="out_offset 5 \\+ out_features 6 must fit in out's 10"):
        reference.lora_expand(y, b, slots, out, 5, scaling)
    with pytest.raises(ValueError, match="scaling must be float32"):
        reference.lora_expand(y, b, slots, out, 0, scaling.double())
    with pytest.raises(ValueError, match=r"scaling must be \[num_slots=2\]"):
        reference.lora_expand(y, b, slots, out, 0, torch.ones(3))
    with pytest.raises(ValueError, match="lora_b max_rank 5 must equal y's 4"):
        reference.lora_expand(y, _randn(gen, 2, 6, 5), slots, out, 0, scaling)


# ------------------------------------------------------------------ Triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("t", "s", "r", "n_in", "n_out"),
    [(5, 3, 8, 40, 24), (37, 4, 16, 72, 100), (3, 1, 20, 16, 16)],
)
def test_triton_matches_reference(
    triton_device: str,
    dtype: torch.dtype,
    t: int,
    s: int,
    r: int,
    n_in: int,
    n_out: int,
    gen: torch.Generator,
    xfail_bf16_interp: Callable[[str, torch.dtype], None],
) -> None:
    xfail_bf16_interp(triton_device, dtype)
    dev = triton_device
    x = _randn(gen, t, n_in, dtype=dtype).to(dev)
    a = (_randn(gen, s, r, n_in, dtype=dtype) * 0.2).to(dev)
    b = (_randn(gen, s, n_out, r, dtype=dtype) * 0.2).to(dev)
    # A prefill-like run of one slot (a segment longer than a block) plus scattered rows.
    slots = torch.cat([torch.full((min(t, 20),), s - 1), _slots(gen, max(t - 20, 0), s)])
    slots = slots.to(dev)
    scaling = (torch.rand(s, generator=gen) + 0.5).to(dev)
    y = triton_ops.lora_shrink(x, a, slots)
    y_ref = reference.lora_shrink(x, a, slots)
    tol = TOL[dtype]
    torch.testing.assert_close(y, y_ref, rtol=tol, atol=tol)
    out = _randn(gen, t, n_out + 9, dtype=dtype).to(dev)
    out_ref = out.clone()
    triton_ops.lora_expand(y_ref, b, slots, out, 4, scaling)
    reference.lora_expand(y_ref, b, slots, out_ref, 4, scaling)
    torch.testing.assert_close(out, out_ref, rtol=tol, atol=tol)


def test_triton_mixed_dtypes_and_groups(triton_device: str, gen: torch.Generator) -> None:
    # float32 activations, bf16 weights: upcast in the kernel (no bf16 arithmetic).
    dev = triton_device
    x = _randn(gen, 9, 32).to(dev)
    a = _randn(gen, 2, 16, 32, dtype=torch.bfloat16).to(dev)
    b = _randn(gen, 2, 48, 16, dtype=torch.bfloat16).to(dev)
    slots = torch.tensor([1, -1, 0, 0, 1, -1, 1, 0, 0], dtype=torch.int32, device=dev)
    groups = group_lora_rows(slots)
    y = triton_ops.lora_shrink(x, a, slots, groups=groups)
    torch.testing.assert_close(y, reference.lora_shrink(x, a, slots), rtol=1e-5, atol=1e-5)
    assert y[slots == -1].abs().sum() == 0
    scaling = torch.tensor([0.5, 2.0], device=dev)
    out = torch.zeros(9, 48, device=dev)
    want = out.clone()
    triton_ops.lora_expand(y, b, slots, out, 0, scaling, groups=groups)
    reference.lora_expand(y, b, slots, want, 0, scaling)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert out[slots == -1].abs().sum() == 0


def test_triton_all_base_rows_is_a_no_op(triton_device: str) -> None:
    dev = triton_device
    slots = torch.full((4,), -1, device=dev)
    y = triton_ops.lora_shrink(
        torch.ones(4, 16, device=dev), torch.ones(1, 16, 16, device=dev), slots
    )
    assert y.abs().sum() == 0
    out = torch.ones(4, 16, device=dev)
    triton_ops.lora_expand(
        torch.ones(4, 16, device=dev), torch.ones(1, 16, 16, device=dev), slots, out, 0,
        torch.ones(1, device=dev),
    )  # fmt: skip
    assert torch.equal(out, torch.ones(4, 16, device=dev))


def test_ops_dispatch_lora(gen: torch.Generator) -> None:
    x, a, b = _randn(gen, 4, 8), _randn(gen, 2, 4, 8), _randn(gen, 2, 6, 4)
    slots = torch.tensor([0, 1, -1, 0])
    y = ops.lora_shrink(x, a, slots)
    assert torch.equal(y, reference.lora_shrink(x, a, slots))
    out, want = torch.zeros(4, 6), torch.zeros(4, 6)
    ops.lora_expand(y, b, slots, out, 0, torch.ones(2))
    reference.lora_expand(y, b, slots, want, 0, torch.ones(2))
    assert torch.equal(out, want)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_fused_qkv_usage_with_strided_views(
    backend: str, triton_device: str, gen: torch.Generator
) -> None:
    """How a fused qkv layer calls the ops: one shrink with q/k/v A stacked along the
    rank, then one expand per slice from a column view of y into its output columns.
    ``x`` is a strided view too. Must equal three independent per-row computations."""
    impl = reference if backend == "reference" else triton_ops
    dev, s, r, hidden = triton_device, 3, 16, 40
    widths = [32, 16, 16]  # q, k, v out features
    x = _randn(gen, 11, hidden + 8)[:, 4 : 4 + hidden].to(dev)  # row stride 48
    a = [_randn(gen, s, r, hidden) for _ in widths]
    b = [_randn(gen, s, w, r) for w in widths]
    slots = torch.tensor([2, 0, -1, 2, 2, 1, 0, -1, 1, 2, 0])
    scaling = torch.tensor([0.5, 1.0, 2.0])
    groups = group_lora_rows(slots.to(dev))
    y = impl.lora_shrink(x, torch.cat(a, dim=1).to(dev), slots.to(dev), groups=groups)
    out = torch.zeros(11, sum(widths), device=dev)
    offset = 0
    for i, w in enumerate(widths):
        y_slice = y[:, i * r : (i + 1) * r]  # row stride 3r
        impl.lora_expand(
            y_slice, b[i].to(dev), slots.to(dev), out, offset, scaling.to(dev), groups=groups
        )
        offset += w
    want = torch.cat(
        [
            _per_row_expand(
                _per_row_shrink(x.cpu(), a[i], slots).float(), b[i], slots,
                torch.zeros(11, w), 0, scaling,
            )
            for i, w in enumerate(widths)
        ],
        dim=1,
    )  # fmt: skip
    torch.testing.assert_close(out.cpu().double(), want, rtol=1e-4, atol=1e-4)


def test_groups_on_another_device_are_refused(gen: torch.Generator) -> None:
    groups = group_lora_rows(torch.tensor([0, 1]), device="meta")
    with pytest.raises(ValueError, match="groups are on meta"):
        reference.lora_shrink(_randn(gen, 2, 8), _randn(gen, 2, 4, 8), torch.tensor([0, 1]),
                              groups=groups)  # fmt: skip


def test_empty_step(triton_device: str) -> None:
    dev = triton_device
    slots = torch.zeros(0, dtype=torch.int64, device=dev)
    g = group_lora_rows(slots)
    assert g.num_tokens == 0 and g.slots == () and g.num_blocks == 0
    for impl in (reference, triton_ops):
        y = impl.lora_shrink(
            torch.zeros(0, 16, device=dev), torch.ones(2, 16, 16, device=dev), slots
        )
        assert y.shape == (0, 16)
        out = torch.zeros(0, 16, device=dev)
        impl.lora_expand(y, torch.ones(2, 16, 16, device=dev), slots, out, 0,
                         torch.ones(2, device=dev), groups=g)  # fmt: skip
        assert out.shape == (0, 16)
