"""Block tables and slot mapping (seed: KVCache-GPU Interface).

The scheduler's KV cache manager owns memory; the runner only receives
block ids. `BlockTable` keeps one row of block ids per batch slot and turns
(request row, token position) pairs into cache slots:

    block_table_index = row * max_num_blocks_per_req + position // block_size
    slot              = block_table[block_table_index] * block_size + position % block_size

The table holds the manager's block ids as they are: the attention kernels
(torch and Triton) take any block size (a tile gathers each key through
`position // block_size`), so no allocation block is split into smaller
kernel blocks. vLLM splits them for hybrid models whose attention block is
raised to the mamba state's page size beyond what FlashAttention supports;
paged has neither that kernel constraint nor a hybrid model in the runner.

`MultiGroupBlockTable` holds one `BlockTable` per KV cache group (hybrid
models) and fans every row operation out to all of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from paged.runner.buffers import CpuGpuBuffer

PAD_SLOT_ID = -1


class BlockTable:
    """Per-row block ids for one KV cache group, in host memory with a device copy.

    Invariant: row r holds `num_blocks_per_row[r]` valid block ids in
    columns `[0, num_blocks_per_row[r])`; columns past that are stale and
    never read (slot mapping only indexes positions the row covers).
    """

    def __init__(
        self,
        block_size: int,
        max_num_reqs: int,
        max_num_blocks_per_req: int,
        max_num_batched_tokens: int,
        device: torch.device | str,
        pin_memory: bool | None = None,
    ) -> None:
        for name, value in (
            ("block_size", block_size),
            ("max_num_reqs", max_num_reqs),
            ("max_num_blocks_per_req", max_num_blocks_per_req),
            ("max_num_batched_tokens", max_num_batched_tokens),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        self.block_size = block_size
        self.max_num_reqs = max_num_reqs
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.max_num_batched_tokens = max_num_batched_tokens
        self.device = torch.device(device)
        self.block_table = CpuGpuBuffer(
            max_num_reqs,
            self.max_num_blocks_per_req,
            dtype=torch.int32,
            device=device,
            pin_memory=pin_memory,
        )
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)
        self.slot_mapping = CpuGpuBuffer(
            max_num_batched_tokens, dtype=torch.int64, device=device, pin_memory=pin_memory
        )

    def _check_row(self, row_idx: int) -> None:
        if not 0 <= row_idx < self.max_num_reqs:
            raise ValueError(f"row_idx must be in [0, {self.max_num_reqs}), got {row_idx}")

    def append_row(self, block_ids: Sequence[int], row_idx: int) -> None:
        """Append block ids to row `row_idx`."""
        self._check_row(row_idx)
        if len(block_ids) == 0:
            return
        start = int(self.num_blocks_per_row[row_idx])
        end = start + len(block_ids)
        if end > self.max_num_blocks_per_req:
            raise ValueError(
                f"block_ids: row {row_idx} would hold {end} blocks, more than "
                f"max_num_blocks_per_req={self.max_num_blocks_per_req}"
            )
        self.block_table.np[row_idx, start:end] = block_ids
        self.num_blocks_per_row[row_idx] = end

    def add_row(self, block_ids: Sequence[int], row_idx: int) -> None:
        """Replace row `row_idx` with `block_ids`."""
        self._check_row(row_idx)
        self.num_blocks_per_row[row_idx] = 0
        self.append_row(block_ids, row_idx)

    def clear_row(self, row_idx: int) -> None:
        self._check_row(row_idx)
        self.num_blocks_per_row[row_idx] = 0

    def move_row(self, src: int, tgt: int) -> None:
        """Copy row `src` onto row `tgt` (src keeps its data; the caller drops it)."""
        self._check_row(src)
        self._check_row(tgt)
        n = int(self.num_blocks_per_row[src])
        self.block_table.np[tgt, :n] = self.block_table.np[src, :n]
        self.num_blocks_per_row[tgt] = n

    def swap_row(self, a: int, b: int) -> None:
        self._check_row(a)
        self._check_row(b)
        table = self.block_table.np
        table[[a, b]] = table[[b, a]]
        rows = self.num_blocks_per_row
        rows[a], rows[b] = rows[b], rows[a]

    def row(self, row_idx: int) -> list[int]:
        """The block ids of one row (for tests and debugging)."""
        self._check_row(row_idx)
        return [int(x) for x in self.block_table.np[row_idx, : self.num_blocks_per_row[row_idx]]]

    def compute_slot_mapping(
        self, req_indices: npt.NDArray[np.int32], positions: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.int64]:
        """Fill `slot_mapping.np[:T]` for T tokens (row of each token, its position)."""
        num_tokens = len(positions)
        if len(req_indices) != num_tokens:
            raise ValueError(
                f"req_indices and positions must have equal length, got "
                f"{len(req_indices)} and {num_tokens}"
            )
        if num_tokens > self.max_num_batched_tokens:
            raise ValueError(
                f"positions: {num_tokens} tokens exceed max_num_batched_tokens="
                f"{self.max_num_batched_tokens}"
            )
        block_idx = positions // self.block_size
        if num_tokens and (block_idx >= self.num_blocks_per_row[req_indices]).any():
            bad = int(np.argmax(block_idx >= self.num_blocks_per_row[req_indices]))
            raise ValueError(
                f"positions: token {bad} at position {int(positions[bad])} of row "
                f"{int(req_indices[bad])} has no block (row holds "
                f"{int(self.num_blocks_per_row[req_indices[bad]])} blocks of {self.block_size})"
            )
        flat = req_indices.astype(np.int64) * self.max_num_blocks_per_req + block_idx
        block_numbers = self.block_table.np.reshape(-1)[flat].astype(np.int64)
        out: npt.NDArray[np.int64] = self.slot_mapping.np[:num_tokens]
        np.add(block_numbers * self.block_size, positions % self.block_size, out=out)
        return out

    def commit_block_table(self, num_reqs: int) -> torch.Tensor:
        """Copy the first `num_reqs` rows to the device (non-blocking); return them."""
        return self.block_table.copy_to_gpu(num_reqs)

    def commit_slot_mapping(
        self, num_tokens: int, padded_num_tokens: int | None = None
    ) -> torch.Tensor:
        """Copy `num_tokens` slots to the device; pad up to `padded_num_tokens` with PAD_SLOT_ID."""
        total = num_tokens if padded_num_tokens is None else padded_num_tokens
        if total < num_tokens:
            raise ValueError(f"padded_num_tokens must be >= num_tokens={num_tokens}, got {total}")
        self.slot_mapping.np[num_tokens:total] = PAD_SLOT_ID
        return self.slot_mapping.copy_to_gpu(total)

    def get_device_tensor(self, num_reqs: int) -> torch.Tensor:
        return self.block_table.gpu[:num_reqs]

    def get_cpu_tensor(self) -> torch.Tensor:
        return self.block_table.cpu

    def get_numpy_array(self) -> npt.NDArray[np.int32]:
        return self.block_table.np

    def clear(self) -> None:
        self.block_table.np.fill(0)
        self.num_blocks_per_row.fill(0)


class MultiGroupBlockTable:
    """One `BlockTable` per KV cache group; row operations apply to all groups.

    `block_ids` arguments are `tuple[list[int], ...]`: entry g belongs to group g.
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        device: torch.device | str,
        block_sizes: Sequence[int],
        pin_memory: bool | None = None,
    ) -> None:
        if not block_sizes:
            raise ValueError("block_sizes must name at least one KV cache group")
        self.block_tables = [
            BlockTable(
                block_size=bs,
                max_num_reqs=max_num_reqs,
                max_num_blocks_per_req=-(-max_model_len // bs),
                max_num_batched_tokens=max_num_batched_tokens,
                device=device,
                pin_memory=pin_memory,
            )
            for bs in block_sizes
        ]

    def __getitem__(self, group_id: int) -> BlockTable:
        return self.block_tables[group_id]

    def __len__(self) -> int:
        return len(self.block_tables)

    def _check_groups(self, block_ids: tuple[list[int], ...]) -> None:
        if len(block_ids) != len(self.block_tables):
            raise ValueError(
                f"block_ids must have one list per KV cache group ({len(self.block_tables)}), "
                f"got {len(block_ids)}"
            )

    def append_row(self, block_ids: tuple[list[int], ...], row_idx: int) -> None:
        self._check_groups(block_ids)
        for table, ids in zip(self.block_tables, block_ids, strict=True):
            table.append_row(ids, row_idx)

    def add_row(self, block_ids: tuple[list[int], ...], row_idx: int) -> None:
        self._check_groups(block_ids)
        for table, ids in zip(self.block_tables, block_ids, strict=True):
            table.add_row(ids, row_idx)

    def move_row(self, src: int, tgt: int) -> None:
        for table in self.block_tables:
            table.move_row(src, tgt)

    def swap_row(self, a: int, b: int) -> None:
        for table in self.block_tables:
            table.swap_row(a, b)

    def clear_row(self, row_idx: int) -> None:
        for table in self.block_tables:
            table.clear_row(row_idx)

    def compute_slot_mapping(
        self, req_indices: npt.NDArray[np.int32], positions: npt.NDArray[np.int64]
    ) -> None:
        for table in self.block_tables:
            table.compute_slot_mapping(req_indices, positions)

    def commit_block_table(self, num_reqs: int) -> None:
        for table in self.block_tables:
            table.commit_block_table(num_reqs)

    def commit_slot_mapping(self, num_tokens: int, padded_num_tokens: int | None = None) -> None:
        for table in self.block_tables:
            table.commit_slot_mapping(num_tokens, padded_num_tokens)

    def clear(self) -> None:
        for table in self.block_tables:
            table.clear()
