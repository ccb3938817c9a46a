"""rank_layout: world size and rank -> (pp_rank, tp_rank), tensor ranks fastest (vLLM's order)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from paged.runner.config import ParallelConfig
from paged.runner.executor.rank_layout import RankCoords, rank_coords, world_size


@dataclass(frozen=True)
class WithPipeline(ParallelConfig):
    """Stands in for ParallelConfig once it has pipeline_parallel_size (issue 19 part P)."""

    pipeline_parallel_size: int = 1


def test_tp_only() -> None:
    cfg = ParallelConfig(tensor_parallel_size=2)
    assert world_size(cfg) == 2
    assert [rank_coords(r, cfg) for r in range(2)] == [RankCoords(0, 0, 0), RankCoords(1, 0, 1)]
    with pytest.raises(ValueError, match=r"rank: must be in \[0, 2\)"):
        rank_coords(2, cfg)


def test_tp_times_pp() -> None:
    cfg = WithPipeline(tensor_parallel_size=2, pipeline_parallel_size=2)
    assert world_size(cfg) == 4
    assert [(c.pp_rank, c.tp_rank) for c in (rank_coords(r, cfg) for r in range(4))] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        world_size(WithPipeline(pipeline_parallel_size=0))
