"""`PreallocatedEncoderCache`: the worker's encoder cache as one fixed buffer (vLLM's gap 4).

vLLM keeps `encoder_cache: dict[str, Tensor]`, one allocation per image. Here
the cache is a single `[capacity, hidden_size]` tensor allocated at start-up,
sized from the scheduler's `encoder_cache_size` (in embeddings), so that it
mirrors the scheduler's `EncoderCacheManager`: the scheduler allocates an
item's embeddings before the worker sees it and frees it only by listing its
hash in `free_encoder_mm_hashes`, so the rows in use here never exceed what the
scheduler counted, and an allocation the scheduler admitted always fits.

Each item occupies one contiguous run of rows (so `get` is a view, never a
gather). Allocation is first fit; when no hole is large enough but the free
rows suffice (fragmentation the scheduler's byte count cannot see), the live
runs are slid to the front in address order and the new run goes at the end:

    before   [A A . . B B B . . . C .]   allocate 4: no hole of 4, 5 rows free
    compact  [A A B B B C . . . . . .]
    after    [A A B B B C D D D D . .]

Compaction moves rows, so a view from `get`/`allocate` is valid only until
the next `allocate` or `free`. Everything runs on the worker's main thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch


class EncoderCacheFullError(RuntimeError):
    """No room for an allocation: the scheduler's accounting was not mirrored (a bug)."""


@dataclass(slots=True)
class _Run:
    """Rows `[start, start + length)` of the buffer hold one item's embeddings."""

    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


class PreallocatedEncoderCache:
    """Fixed `[capacity, hidden_size]` buffer keyed by mm hash; see the module docstring.

    Invariants (`check_integrity`): runs are disjoint and inside the buffer;
    `num_used + num_free == capacity`.
    """

    def __init__(
        self, capacity: int, hidden_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 embedding, got {capacity}")
        if hidden_size < 1:
            raise ValueError(f"hidden_size must be >= 1, got {hidden_size}")
        self._buffer = torch.empty(capacity, hidden_size, dtype=dtype, device=device)
        self._runs: dict[str, _Run] = {}
        self._num_used = 0
        self.num_compactions = 0  # for tests and metrics

    # ------------------------------------------------------------ properties

    @property
    def capacity(self) -> int:
        return int(self._buffer.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self._buffer.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        return self._buffer.dtype

    @property
    def device(self) -> torch.device:
        return self._buffer.device

    @property
    def buffer(self) -> torch.Tensor:
        """The whole preallocated tensor (for connectors that register memory once)."""
        return self._buffer

    @property
    def num_used(self) -> int:
        return self._num_used

    @property
    def num_free(self) -> int:
        return self.capacity - self._num_used

    def __contains__(self, mm_hash: object) -> bool:
        return mm_hash in self._runs

    def __len__(self) -> int:
        return len(self._runs)

    def __iter__(self) -> Iterator[str]:
        return iter(self._runs)

    # ------------------------------------------------------------ operations

    def get(self, mm_hash: str) -> torch.Tensor | None:
        """The `[num_embeds, hidden_size]` rows of `mm_hash` (a view), or None if absent."""
        run = self._runs.get(mm_hash)
        if run is None:
            return None
        return self._buffer[run.start : run.end]

    def run_of(self, mm_hash: str) -> tuple[int, int] | None:
        """(first row, number of rows) of `mm_hash`, or None (for tests and transports)."""
        run = self._runs.get(mm_hash)
        return None if run is None else (run.start, run.length)

    def allocate(self, mm_hash: str, num_embeds: int) -> torch.Tensor:
        """Reserve `num_embeds` contiguous rows for `mm_hash`; returns them (uninitialised).

        `ValueError` if `mm_hash` is present or `num_embeds` < 1;
        `EncoderCacheFullError` if fewer than `num_embeds` rows are free.
        """
        if num_embeds < 1:
            raise ValueError(f"num_embeds must be >= 1, got {num_embeds}")
        if mm_hash in self._runs:
            raise ValueError(f"mm_hash {mm_hash}: already in the encoder cache")
        if num_embeds > self.num_free:
            raise EncoderCacheFullError(
                f"mm_hash {mm_hash}: {num_embeds} embeddings do not fit the encoder cache "
                f"({self.num_free} of {self.capacity} free)"
            )
        start = self._first_fit(num_embeds)
        if start is None:
            start = self._compact()
        run = _Run(start, num_embeds)
        self._runs[mm_hash] = run
        self._num_used += num_embeds
        return self._buffer[run.start : run.end]

    def store(self, mm_hash: str, output: torch.Tensor) -> torch.Tensor:
        """Allocate rows for `output` (`[n, hidden_size]`) and copy it in; returns the rows."""
        if output.dim() != 2 or output.shape[1] != self.hidden_size:
            raise ValueError(
                f"mm_hash {mm_hash}: encoder output of shape {tuple(output.shape)}, "
                f"the encoder cache holds [n, {self.hidden_size}] rows"
            )
        rows = self.allocate(mm_hash, int(output.shape[0]))
        rows.copy_(output)
        return rows

    def free(self, mm_hash: str) -> None:
        """Release `mm_hash`'s rows (absent: no-op, as a hash the worker never held)."""
        run = self._runs.pop(mm_hash, None)
        if run is not None:
            self._num_used -= run.length

    def check_integrity(self) -> None:
        """Raise `AssertionError` naming the broken invariant (tests call it after every op)."""
        runs = sorted(self._runs.values(), key=lambda r: r.start)
        used = 0
        prev_end = 0
        for run in runs:
            if run.start < prev_end or run.length < 1 or run.end > self.capacity:
                raise AssertionError(f"run {run} overlaps or leaves the buffer")
            prev_end = run.end
            used += run.length
        if used != self._num_used:
            raise AssertionError(f"used rows {used} != counter {self._num_used}")

    # ------------------------------------------------------------ internals

    def _first_fit(self, num_embeds: int) -> int | None:
        position = 0
        for run in sorted(self._runs.values(), key=lambda r: r.start):
            if run.start - position >= num_embeds:
                return position
            position = run.end
        return position if self.capacity - position >= num_embeds else None

    def _compact(self) -> int:
        """Slide every run to the front, in address order; returns the first free row."""
        position = 0
        for run in sorted(self._runs.values(), key=lambda r: r.start):
            if run.start != position:
                source = self._buffer[run.start : run.end]
                if run.start < position + run.length:  # overlapping move: copy out first
                    source = source.clone()
                self._buffer[position : position + run.length].copy_(source)
                run.start = position
            position += run.length
        self.num_compactions += 1
        return position
