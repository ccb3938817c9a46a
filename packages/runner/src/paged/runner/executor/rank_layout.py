"""World size and the rank -> (pipeline stage, tensor rank) map, for the executors.

Every executor that starts one worker per rank (multiproc, Ray) asks here how
many workers to start and what each global rank is. vLLM's order is kept:
tensor ranks vary fastest, so the TP group of pipeline stage p is the
contiguous ranks [p * tp, (p + 1) * tp) and lands on one node under a PACK
placement.

    rank:     0    1    2    3        (tp=2, pp=2)
    pp_rank:  0    0    1    1
    tp_rank:  0    1    0    1

The arithmetic itself lives in one place, `PipelineStage.of_rank` (the
worker's own view of its rank); this module only reads the sizes from a
`ParallelConfig`, which validates them.
"""

from __future__ import annotations

from dataclasses import dataclass

from paged.runner.config import ParallelConfig
from paged.runner.pipeline.stage import PipelineStage


@dataclass(frozen=True)
class RankCoords:
    """Where one global rank sits in the TP x PP grid."""

    rank: int
    pp_rank: int
    tp_rank: int


def world_size(parallel_config: ParallelConfig) -> int:
    """Workers an executor starts: TP x PP."""
    return parallel_config.world_size


def rank_coords(rank: int, parallel_config: ParallelConfig) -> RankCoords:
    """The (pp_rank, tp_rank) of global `rank`; ValueError outside the world."""
    stage = PipelineStage.of_rank(
        rank, parallel_config.tensor_parallel_size, parallel_config.pipeline_parallel_size
    )
    return RankCoords(stage.rank, stage.pp_rank, stage.tp_rank)


def node_ranks(parallel_config: ParallelConfig, node_rank: int) -> range:
    """The global ranks node `node_rank` runs: node-major, world_size / nnodes each.

        nnodes=2, tp=2, pp=2:  node 0 -> ranks 0, 1 (stage 0)   node 1 -> ranks 2, 3 (stage 1)

    So a TP group stays inside one node whenever nnodes divides PP (vLLM's layout).
    """
    nnodes = parallel_config.nnodes
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank: must be in [0, {nnodes}), got {node_rank}")
    per_node = world_size(parallel_config) // nnodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)
