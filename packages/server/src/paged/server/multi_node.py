"""Multi-node tensor/pipeline parallelism without Ray: vLLM's --nnodes flags for the mp backend.

    node 0: paged serve M -tp 2 --nnodes 2 --node-rank 0 --master-addr A [--master-port P]
    node R: paged serve M -tp 2 --nnodes 2 --node-rank R --master-addr A [--master-port P] \
              --headless

Node 0 runs the API server, the engine core and its ranks; a `--headless`
node R >= 1 runs only its ranks (`paged.runner.executor.node_agent`), which
node 0's executor drives over TCP at A:P+1; torch.distributed meets at A:P.
docs/multi-node.md section 4 is the guide.
"""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from paged.server.engine_args import EngineArgs

logger = logging.getLogger(__name__)

DEFAULT_MASTER_PORT = 29501  # vLLM's default --master-port


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 < value < 65535:
        raise argparse.ArgumentTypeError(f"must be in 1..65534, got {value}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_multi_node_args(group: argparse._ArgumentGroup) -> None:
    """vLLM's multi-node flags of the mp executor, into the parallelism group."""
    group.add_argument(
        "--nnodes",
        type=_count,
        default=1,
        help="machines the TP x PP ranks spread over (mp backend; each runs world/nnodes "
        "ranks, node-major); node 0 serves the API, the others run with --headless",
    )
    group.add_argument(
        "--node-rank",
        type=_count,
        default=0,
        help="this machine's index among the --nnodes (0: the API server's node)",
    )
    group.add_argument(
        "--master-addr",
        default=None,
        help="node 0's address, reachable from every node (required with --nnodes > 1)",
    )
    group.add_argument(
        "--master-port",
        type=_port,
        default=DEFAULT_MASTER_PORT,
        help="torch.distributed's rendezvous port on node 0; the executor's node link uses "
        f"the next port (default {DEFAULT_MASTER_PORT} and {DEFAULT_MASTER_PORT + 1})",
    )


def check_node_role(nnodes: int, node_rank: int, headless: bool, data_parallel_size: int) -> bool:
    """Whether this process is a headless worker node; ValueError for a contradictory mix.

    The ranges of the values themselves are `ParallelConfig`'s to check.
    """
    if nnodes <= 1:
        if node_rank != 0:
            raise ValueError(f"node_rank: {node_rank} needs --nnodes > {node_rank}")
        return False
    if data_parallel_size > 1:
        raise ValueError(
            "nnodes: --nnodes spreads one engine's TP/PP ranks over machines; with "
            "--data-parallel-size > 1 place engines on other nodes with --headless "
            "--data-parallel-start-rank instead (docs/data_parallel.md)"
        )
    if node_rank == 0 and headless:
        raise ValueError(
            "headless: node 0 (--node-rank 0) runs the API server and the engine; drop "
            "--headless there, or give this node its --node-rank"
        )
    if node_rank > 0 and not headless:
        raise ValueError(
            f"headless: node {node_rank} runs only its workers; add --headless (the API "
            "server runs on node 0)"
        )
    return node_rank > 0


def run_headless_workers(args: EngineArgs) -> int:
    """`paged serve --headless --node-rank R`: this node's ranks, until node 0 ends; exit status."""
    from paged.runner.executor.node_agent import run_worker_node

    config = args.create_engine_config()
    parallel = config.parallel_config
    logger.info(
        "headless node %d of %d: ranks of TP=%d x PP=%d, node 0 at %s:%d",
        parallel.node_rank,
        parallel.nnodes,
        parallel.tensor_parallel_size,
        parallel.pipeline_parallel_size,
        parallel.master_addr,
        parallel.master_port,
    )
    return run_worker_node(config)
