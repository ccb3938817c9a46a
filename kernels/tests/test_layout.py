from __future__ import annotations

import pytest
import torch

from paged.kernels import PAD_SLOT_ID, kv_cache_shape, slot_mapping_from_block_table, split_kv_cache


def test_kv_cache_shape_and_split_are_views() -> None:
    shape = kv_cache_shape(5, 4, 2, 8)
    assert shape == (2, 5, 4, 2, 8)
    kv = torch.zeros(shape)
    k, v = split_kv_cache(kv)
    assert k.shape == v.shape == (5, 4, 2, 8)
    k[1, 2, 0, 3] = 7.0
    v[4, 0, 1, 0] = 9.0
    assert kv[0, 1, 2, 0, 3] == 7.0
    assert kv[1, 4, 0, 1, 0] == 9.0
    assert k.data_ptr() == kv.data_ptr()


@pytest.mark.parametrize("bad", [0, -1])
def test_kv_cache_shape_rejects_non_positive(bad: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        kv_cache_shape(5, bad, 2, 8)


def test_split_rejects_wrong_rank() -> None:
    with pytest.raises(ValueError, match="kv_cache must have shape"):
        split_kv_cache(torch.zeros(3, 5, 4, 2, 8))


def test_slot_mapping_from_block_table() -> None:
    block_table = torch.tensor([[7, 2, 0], [5, 1, 0]], dtype=torch.int32)
    positions = torch.tensor([0, 3, 4, 9, 5, -1])
    reqs = torch.tensor([0, 0, 0, 0, 1, 1])
    slots = slot_mapping_from_block_table(block_table, positions, reqs, block_size=4)
    assert slots.tolist() == [28, 31, 8, 1, 5, PAD_SLOT_ID]
    assert slots.dtype == torch.int64
