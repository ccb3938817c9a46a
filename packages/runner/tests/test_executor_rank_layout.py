"""rank_layout: world size and rank -> (pp_rank, tp_rank), tensor ranks fastest (vLLM's order)."""

from __future__ import annotations

import pytest

from paged.runner.config import ParallelConfig
from paged.runner.executor.rank_layout import RankCoords, rank_coords, world_size
from paged.runner.pipeline.stage import PipelineStage


def test_tp_only() -> None:
    cfg = ParallelConfig(tensor_parallel_size=2)
    assert world_size(cfg) == 2
    assert [rank_coords(r, cfg) for r in range(2)] == [RankCoords(0, 0, 0), RankCoords(1, 0, 1)]
    with pytest.raises(ValueError, match=r"rank: must be in \[0, 2\)"):
        rank_coords(2, cfg)


def test_tp_times_pp() -> None:
    cfg = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
    assert world_size(cfg) == 4
    assert [(c.pp_rank, c.tp_rank) for c in (rank_coords(r, cfg) for r in range(4))] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        ParallelConfig(pipeline_parallel_size=0)


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (1, 3), (3, 1), (2, 3), (4, 2)])
def test_executor_and_worker_agree_on_every_rank(tp: int, pp: int) -> None:
    """What the executor starts a rank as is what that rank's worker thinks it is."""
    cfg = ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    for rank in range(world_size(cfg)):
        coords = rank_coords(rank, cfg)
        stage = PipelineStage.of_rank(rank, tp, pp)
        assert (coords.rank, coords.pp_rank, coords.tp_rank) == (rank, rank // tp, rank % tp)
        assert (stage.pp_rank, stage.tp_rank, stage.rank) == (coords.pp_rank, coords.tp_rank, rank)
        assert rank in stage.tp_ranks and len(stage.tp_ranks) == tp
