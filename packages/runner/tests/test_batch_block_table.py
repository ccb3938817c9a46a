"""BlockTable / MultiGroupBlockTable: slot mapping, kernel-block mapping, row moves."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged.runner.block_table import (
    PAD_SLOT_ID,
    BlockTable,
    MultiGroupBlockTable,
)
from paged.runner.buffers import CpuGpuBuffer


def test_cpu_gpu_buffer_shares_storage_on_cpu() -> None:
    buf = CpuGpuBuffer(4, 3, dtype=torch.int32, device="cpu")
    buf.np[1, 2] = 7
    assert buf.shares_storage
    assert buf.copy_to_gpu(2)[1, 2].item() == 7
    assert buf.copy_to_gpu().shape == (4, 3)
    with pytest.raises(ValueError, match="n must be"):
        buf.copy_to_gpu(5)
    with pytest.raises(ValueError, match="shape"):
        CpuGpuBuffer(dtype=torch.int32, device="cpu")


def test_slot_mapping_formula() -> None:
    table = BlockTable(
        4, max_num_reqs=3, max_num_blocks_per_req=4, max_num_batched_tokens=32, device="cpu"
    )
    table.add_row([7, 2], 0)
    table.add_row([5], 1)
    table.append_row([9], 1)
    req = np.array([0, 0, 0, 1, 1], dtype=np.int32)
    pos = np.array([0, 3, 5, 2, 6], dtype=np.int64)
    slots = table.compute_slot_mapping(req, pos)
    assert slots.tolist() == [28, 31, 9, 22, 38]
    dev = table.commit_slot_mapping(5, padded_num_tokens=8)
    assert dev.tolist() == [28, 31, 9, 22, 38, PAD_SLOT_ID, PAD_SLOT_ID, PAD_SLOT_ID]
    assert table.commit_block_table(2)[1, :2].tolist() == [5, 9]


def test_row_moves_and_errors() -> None:
    table = BlockTable(2, 3, 3, 8, "cpu")
    table.add_row([1, 2], 0)
    table.add_row([3], 1)
    table.swap_row(0, 1)
    assert (table.row(0), table.row(1)) == ([3], [1, 2])
    table.move_row(1, 2)
    assert table.row(2) == [1, 2]
    with pytest.raises(ValueError, match="max_num_blocks_per_req"):
        table.append_row([4, 5], 2)
    with pytest.raises(ValueError, match="row_idx"):
        table.add_row([1], 3)
    with pytest.raises(ValueError, match="has no block"):
        table.compute_slot_mapping(np.array([0], dtype=np.int32), np.array([2], dtype=np.int64))
    with pytest.raises(ValueError, match="equal length"):
        table.compute_slot_mapping(np.array([0, 0], dtype=np.int32), np.array([0], dtype=np.int64))


def test_multi_group_fans_out() -> None:
    tables = MultiGroupBlockTable(2, 32, 16, "cpu", block_sizes=[4, 8])
    tables.add_row(([1, 2], [3]), 0)
    tables.append_row(([4], []), 0)
    assert tables[0].row(0) == [1, 2, 4]
    assert tables[1].row(0) == [3]
    tables.compute_slot_mapping(np.zeros(2, dtype=np.int32), np.array([0, 5], dtype=np.int64))
    assert tables[0].slot_mapping.np[:2].tolist() == [4, 9]
    assert tables[1].slot_mapping.np[:2].tolist() == [24, 29]
    with pytest.raises(ValueError, match="one list per KV cache group"):
        tables.add_row(([1],), 1)


@settings(max_examples=60, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4, 16]),
    rows=st.lists(st.lists(st.integers(0, 500), min_size=1, max_size=6), min_size=1, max_size=4),
    data=st.data(),
)
def test_slot_mapping_matches_naive(
    block_size: int, rows: list[list[int]], data: st.DataObject
) -> None:
    table = BlockTable(block_size, len(rows), 6, 64, "cpu")
    for i, ids in enumerate(rows):
        table.add_row(ids, i)
    req = data.draw(st.lists(st.integers(0, len(rows) - 1), min_size=1, max_size=64))
    pos = [data.draw(st.integers(0, len(rows[r]) * block_size - 1)) for r in req]
    slots = table.compute_slot_mapping(np.array(req, dtype=np.int32), np.array(pos, dtype=np.int64))
    naive = [
        rows[r][p // block_size] * block_size + p % block_size
        for r, p in zip(req, pos, strict=True)
    ]
    assert slots.tolist() == naive
