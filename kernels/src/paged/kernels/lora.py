"""LoRA row grouping and the argument checks shared by both LoRA backends.

A step's rows each use one adapter slot (``token_slots[t]``, ``-1`` = base model
only). Both ``lora_shrink`` and ``lora_expand`` work per *group* of rows sharing a
slot: one matmul per slot on the reference path (never a ``[T, R, in]`` gather),
one run of Triton programs per segment of the slot-sorted rows on the Triton path
(SGMV style). A model calls the two ops several times per layer with the same
``token_slots`` (q/k/v, o, gate/up, down), so the grouping is computed once per
step by ``group_lora_rows`` and passed as ``groups=``; without it each call groups
again (one host sync per call on CUDA).

Sorted-row layout (``order`` holds the row ids with slot != -1, stably sorted by
slot; Triton programs each take ``LORA_BLOCK_T`` consecutive entries of one slot)::

    token_slots   [ 1, -1,  0,  1,  0]
    order         [ 2,  4,  0,  3]          rows of slot 0, then rows of slot 1
    blocks        (slot 0, 0..2) (slot 1, 2..4)   start/end index into order

Many small groups (a decode step: one row per request, several adapters) make
the reference's per-slot loop cost a few torch calls per adapter, per call,
which dominates on a CPU. When padding every group to the largest one wastes at
most ``_MAX_PAD_WASTE`` x the rows, ``padded`` lays the rows out as
``[slots lo..hi, rows_per_slot]`` so that one ``bmm`` against the weight stack's
slice ``lo..hi`` (a view, no copy) serves all of them::

    padded rows   slot 0: [2, 4]   slot 1: [0, 3]     rows_per_slot 2
    rows, index   [2, 4, 0, 3], [0, 1, 2, 3]   flat positions in the [2 * 2] layout

Groups too large for that (a prefill chunk next to decode rows) stay in the
per-slot loop (``loop``), the small ones still share one ``bmm``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "LORA_BLOCK_T",
    "LoRARowGroups",
    "PaddedLoRARows",
    "check_lora_expand",
    "check_lora_groups",
    "check_lora_shrink",
    "group_lora_rows",
]

# Rows per Triton program: tl.dot needs every tile dimension >= 16.
LORA_BLOCK_T = 16
# The padded [slots, rows_per_slot] layout is used while it holds at most this
# many times the real rows (a prefill chunk next to decode rows would pad every
# other adapter to the chunk's length: the per-slot loop is cheaper then).
_MAX_PAD_WASTE = 2

_FLOAT = (torch.float32, torch.float16, torch.bfloat16)
_INT = (torch.int32, torch.int64)


@dataclass(frozen=True, slots=True)
class PaddedLoRARows:
    """Active rows as ``[num_slots, rows_per_slot]`` for slots ``slot_lo..`` (module docstring)."""

    slot_lo: int
    num_slots: int  # hi - lo + 1; slots without rows are all padding
    rows_per_slot: int
    rows: torch.Tensor  # [P] int64: the rows laid out (those of the chosen groups)
    index: torch.Tensor  # [P] int64: flat position of rows[i] in [num_slots * rows_per_slot]
    entry_slots: torch.Tensor  # [P] int64: slot of rows[i]
    dense: bool  # no padding at all: index == arange(P), gathers/scatters can be skipped


@dataclass(frozen=True, slots=True)
class LoRARowGroups:
    """The rows of one step grouped by adapter slot; built by ``group_lora_rows``.

    ``slots`` ascending, without -1; ``rows[i]`` selects the rows of ``slots[i]``:
    a ``slice`` when they are consecutive (a prefill chunk: views, no copies), else
    an int64 index tensor on ``device``. ``order``/``block_*`` are the Triton
    layout described in the module docstring, on ``device``. ``padded`` is the
    one-``bmm`` layout of the small groups when it pays (several slots, little
    padding), else None; ``loop`` indexes the groups (into ``slots``/``rows``)
    the reference handles one matmul at a time: all of them without ``padded``.
    """

    num_tokens: int
    slots: tuple[int, ...]
    rows: tuple[slice | torch.Tensor, ...]
    order: torch.Tensor  # [A] int64, A = rows with a slot
    block_slot: torch.Tensor  # [NB] int32
    block_start: torch.Tensor  # [NB] int32, index into order
    block_end: torch.Tensor  # [NB] int32, exclusive
    device: torch.device
    padded: PaddedLoRARows | None
    loop: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        return int(self.block_slot.shape[0])


def _check_token_slots(token_slots: torch.Tensor) -> None:
    if token_slots.dim() != 1:
        raise ValueError(f"token_slots must be [num_tokens], got shape {tuple(token_slots.shape)}")
    if token_slots.dtype not in _INT:
        raise ValueError(f"token_slots must be int32 or int64, got {token_slots.dtype}")


def group_lora_rows(
    token_slots: torch.Tensor, device: torch.device | str | None = None
) -> LoRARowGroups:
    """Group rows by slot once per step (reads the values: one host sync on CUDA).

    ``device`` is where the index tensors go (default: ``token_slots``'s); a runner
    that holds the slots on the host anyway passes the CPU tensor and its GPU.
    """
    _check_token_slots(token_slots)
    target = torch.device(device) if device is not None else token_slots.device
    host = token_slots.to("cpu", torch.int64)
    if host.numel() and int(host.min()) < -1:
        raise ValueError(f"token_slots must be >= -1 (-1 = no adapter), got {int(host.min())}")
    sorted_slots, order = torch.sort(host, stable=True)
    values, counts = torch.unique_consecutive(sorted_slots, return_counts=True)
    slots: list[int] = []
    rows: list[slice | torch.Tensor] = []
    group_sizes: list[int] = []
    host_rows: list[torch.Tensor] = []
    block_meta: list[tuple[int, int, int]] = []
    start = 0
    active_from = 0
    for value, count in zip(values.tolist(), counts.tolist(), strict=True):
        if value == -1:  # sorts first: the active rows begin after it
            active_from = count
            start = count
            continue
        idx = order[start : start + count]
        first, last = int(idx[0]), int(idx[-1])
        # Stable sort keeps each slot's rows ascending: consecutive iff the span fits.
        rows.append(slice(first, last + 1) if last - first + 1 == count else idx.to(target))
        slots.append(value)
        group_sizes.append(count)
        host_rows.append(idx)
        for b in range(start - active_from, start - active_from + count, LORA_BLOCK_T):
            end = min(b + LORA_BLOCK_T, start - active_from + count)
            block_meta.append((value, b, end))
        start += count
    meta = torch.tensor(block_meta, dtype=torch.int32).reshape(-1, 3).to(target)
    padded, loop = _padded(slots, group_sizes, host_rows, target)
    return LoRARowGroups(
        num_tokens=int(host.shape[0]),
        slots=tuple(slots),
        rows=tuple(rows),
        order=order[active_from:].to(target),
        block_slot=meta[:, 0].contiguous(),
        block_start=meta[:, 1].contiguous(),
        block_end=meta[:, 2].contiguous(),
        device=meta.device,  # normalised ("cuda" -> "cuda:0"), compared with tensors' devices
        padded=padded,
        loop=loop,
    )


def _padded(
    slots: list[int],
    counts: list[int],
    host_rows: list[torch.Tensor],
    device: torch.device,
) -> tuple[PaddedLoRARows | None, tuple[int, ...]]:
    """The padded layout over the smallest groups that keep the padding bounded.

    Returns it (None when fewer than two groups qualify) and the indices into
    ``slots`` of the groups left to the per-slot loop (e.g. a long prefill chunk).
    """
    by_size = sorted(range(len(slots)), key=lambda i: counts[i])
    for k in range(len(slots), 1, -1):
        chosen = sorted(by_size[:k])
        lo, hi = slots[chosen[0]], slots[chosen[-1]]
        per_slot = max(counts[i] for i in chosen)
        active = sum(counts[i] for i in chosen)
        if (hi - lo + 1) * per_slot <= _MAX_PAD_WASTE * active:
            break
    else:
        return None, tuple(range(len(slots)))
    row_ids = torch.cat([host_rows[i] for i in chosen])
    entry_slots = torch.cat([torch.full((counts[i],), slots[i]) for i in chosen])
    index = torch.cat([(slots[i] - lo) * per_slot + torch.arange(counts[i]) for i in chosen])
    padded = PaddedLoRARows(
        slot_lo=lo,
        num_slots=hi - lo + 1,
        rows_per_slot=per_slot,
        rows=row_ids.to(device),
        index=index.to(device),
        entry_slots=entry_slots.to(device),
        dense=(hi - lo + 1) * per_slot == len(row_ids),
    )
    return padded, tuple(i for i in range(len(slots)) if i not in set(chosen))


def _check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _FLOAT:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def _check_devices(**tensors: torch.Tensor) -> None:
    if len({t.device for t in tensors.values()}) > 1:
        where = ", ".join(f"{n}={t.device}" for n, t in tensors.items())
        raise ValueError(f"tensors must be on one device, got {where}")


def check_lora_groups(
    groups: LoRARowGroups, token_slots: torch.Tensor, num_slots: int, device: torch.device
) -> None:
    """``groups`` fits this call: same token count and device, every slot < ``num_slots``."""
    if groups.num_tokens != token_slots.shape[0]:
        raise ValueError(
            f"groups were built for {groups.num_tokens} tokens, token_slots has "
            f"{token_slots.shape[0]}"
        )
    if groups.slots and groups.slots[-1] >= num_slots:
        raise ValueError(f"token_slots uses slot {groups.slots[-1]} but only {num_slots} exist")
    if groups.device != device:
        raise ValueError(f"groups are on {groups.device}, the tensors on {device}")


def check_lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    token_slots: torch.Tensor,
    groups: LoRARowGroups | None,
) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [num_tokens, in_features], got shape {tuple(x.shape)}")
    if lora_a.dim() != 3:
        raise ValueError(
            f"lora_a must be [num_slots, max_rank, in_features], got shape {tuple(lora_a.shape)}"
        )
    if lora_a.shape[2] != x.shape[1]:
        raise ValueError(
            f"lora_a in_features {lora_a.shape[2]} must equal x's {x.shape[1]} "
            f"(x {tuple(x.shape)}, lora_a {tuple(lora_a.shape)})"
        )
    _check_float("x", x)
    _check_float("lora_a", lora_a)
    _check_token_slots(token_slots)
    if token_slots.shape[0] != x.shape[0]:
        raise ValueError(f"token_slots has {token_slots.shape[0]} entries, x {x.shape[0]} rows")
    _check_devices(x=x, lora_a=lora_a, token_slots=token_slots)
    if groups is not None:
        check_lora_groups(groups, token_slots, lora_a.shape[0], x.device)


def check_lora_expand(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    out: torch.Tensor,
    out_offset: int,
    scaling: torch.Tensor,
    groups: LoRARowGroups | None,
) -> None:
    if y.dim() != 2:
        raise ValueError(f"y must be [num_tokens, max_rank], got shape {tuple(y.shape)}")
    if lora_b.dim() != 3:
        raise ValueError(
            f"lora_b must be [num_slots, out_features, max_rank], got shape {tuple(lora_b.shape)}"
        )
    if lora_b.shape[2] != y.shape[1]:
        raise ValueError(
            f"lora_b max_rank {lora_b.shape[2]} must equal y's {y.shape[1]} "
            f"(y {tuple(y.shape)}, lora_b {tuple(lora_b.shape)})"
        )
    if out.dim() != 2 or out.shape[0] != y.shape[0]:
        raise ValueError(
            f"out must be [num_tokens={y.shape[0]}, total_out], got shape {tuple(out.shape)}"
        )
    n = lora_b.shape[1]
    if out_offset < 0 or out_offset + n > out.shape[1]:
        raise ValueError(
            f"out_offset {out_offset} + out_features {n} must fit in out's {out.shape[1]} columns"
        )
    if scaling.dim() != 1 or scaling.shape[0] != lora_b.shape[0]:
        raise ValueError(
            f"scaling must be [num_slots={lora_b.shape[0]}], got shape {tuple(scaling.shape)}"
        )
    if scaling.dtype != torch.float32:
        raise ValueError(f"scaling must be float32, got {scaling.dtype}")
    for name, t in (("y", y), ("lora_b", lora_b), ("out", out)):
        _check_float(name, t)
    _check_token_slots(token_slots)
    if token_slots.shape[0] != y.shape[0]:
        raise ValueError(f"token_slots has {token_slots.shape[0]} entries, y {y.shape[0]} rows")
    _check_devices(y=y, lora_b=lora_b, token_slots=token_slots, out=out, scaling=scaling)
    if groups is not None:
        check_lora_groups(groups, token_slots, lora_b.shape[0], y.device)
