"""World size and the rank -> (pipeline stage, tensor rank) map, in one place.

Every executor that starts one worker per rank (multiproc, Ray) asks here how
many workers to start and what each global rank is. vLLM's order is kept:
tensor ranks vary fastest, so the TP group of pipeline stage p is the
contiguous ranks [p * tp, (p + 1) * tp) and lands on one node under a PACK
placement.

    rank:     0    1    2    3        (tp=2, pp=2)
    pp_rank:  0    0    1    1
    tp_rank:  0    1    0    1

Pipeline parallelism is read from `ParallelConfig.pipeline_parallel_size`
when that field exists (it comes with PP support); without it every rank is
in stage 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from paged.runner.config import ParallelConfig


@dataclass(frozen=True)
class RankCoords:
    """Where one global rank sits in the TP x PP grid."""

    rank: int
    pp_rank: int
    tp_rank: int


def pipeline_parallel_size(parallel_config: ParallelConfig) -> int:
    # getattr: the field arrives with pipeline parallelism; 1 until then.
    size = getattr(parallel_config, "pipeline_parallel_size", 1)
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"pipeline_parallel_size: must be an int >= 1, got {size!r}")
    return size


def world_size(parallel_config: ParallelConfig) -> int:
    """Workers an executor starts: TP x PP."""
    return parallel_config.tensor_parallel_size * pipeline_parallel_size(parallel_config)


def rank_coords(rank: int, parallel_config: ParallelConfig) -> RankCoords:
    """The (pp_rank, tp_rank) of global `rank`; ValueError outside the world."""
    size = world_size(parallel_config)
    if not 0 <= rank < size:
        raise ValueError(f"rank: must be in [0, {size}), got {rank}")
    pp_rank, tp_rank = divmod(rank, parallel_config.tensor_parallel_size)
    return RankCoords(rank, pp_rank, tp_rank)


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
