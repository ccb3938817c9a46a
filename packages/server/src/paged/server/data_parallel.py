"""Data parallelism: vLLM's `--data-parallel-*` / `--headless` flags, and the client they build.

    paged serve M -dp 2                         two engines here, one API server
    paged serve M -dp 4 -dpl 2 -dpa HOST -dpp P  ranks 0-1 here, ranks 2-3 register from
    paged serve M --headless -dp 4 -dpl 2 -dpr 2 -dpa HOST -dpp P   another node

With `--data-parallel-size 1` (the default) nothing here runs: the server
builds its single `AsyncMPClient` exactly as before.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from paged.runner.config import EngineConfig
    from paged.server.async_llm import AsyncLLM
    from paged.server.engine.client import AsyncMPClient
    from paged.server.engine.dp_client import DPLBAsyncClient
    from paged.server.engine.interfaces import EngineCoreFactory
    from paged.server.engine_args import EngineArgs
    from paged.server.metrics import StatLogger

logger = logging.getLogger(__name__)

DEFAULT_DP_RPC_PORT = 29550  # vLLM's default --data-parallel-rpc-port
DEFAULT_REGISTER_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class DataParallelOptions:
    """vLLM's DP flags. `size_local` None: every rank not below `start_rank` runs here."""

    size: int = 1
    size_local: int | None = None
    start_rank: int = 0
    address: str = "127.0.0.1"
    rpc_port: int = DEFAULT_DP_RPC_PORT
    headless: bool = False
    register_timeout_s: float = DEFAULT_REGISTER_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.size}")
        if not 0 <= self.start_rank < self.size:
            raise ValueError(
                f"data_parallel_start_rank must be in [0, {self.size}), got {self.start_rank}"
            )
        if not self.headless and self.start_rank != 0:
            raise ValueError(
                "data_parallel_start_rank: only a --headless node starts above rank 0 "
                f"(got {self.start_rank}); the API server's node holds ranks from 0"
            )
        if self.size_local is not None and not 0 <= self.size_local <= self.size - self.start_rank:
            raise ValueError(
                f"data_parallel_size_local must be in [0, {self.size - self.start_rank}] "
                f"(size {self.size}, start rank {self.start_rank}), got {self.size_local}"
            )
        if self.headless and self.num_local == 0:
            raise ValueError("data_parallel_size_local: a --headless node must run >= 1 engine")
        if not 0 < self.rpc_port < 65536:
            raise ValueError(f"data_parallel_rpc_port must be in 1..65535, got {self.rpc_port}")
        if self.register_timeout_s <= 0:
            raise ValueError(f"register_timeout_s must be > 0, got {self.register_timeout_s}")

    @property
    def num_local(self) -> int:
        return self.size - self.start_rank if self.size_local is None else self.size_local

    @property
    def remote_ranks(self) -> list[int]:
        """Ranks the API server waits for from headless nodes."""
        return [] if self.headless else list(range(self.num_local, self.size))


def add_data_parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data parallelism (vLLM's flags)")
    g.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="engine cores (each its own scheduler and KV cache) behind one API server",
    )
    g.add_argument(
        "--data-parallel-size-local",
        "-dpl",
        type=int,
        default=None,
        help="how many of them run on this node (default: all from the start rank)",
    )
    g.add_argument(
        "--data-parallel-start-rank",
        "-dpr",
        type=int,
        default=0,
        help="first DP rank on this node (a --headless node)",
    )
    g.add_argument(
        "--data-parallel-address",
        "-dpa",
        default="127.0.0.1",
        help="the API server node's address, which engines on other nodes connect to",
    )
    g.add_argument(
        "--data-parallel-rpc-port",
        "-dpp",
        type=int,
        default=DEFAULT_DP_RPC_PORT,
        help=f"its port for engine registration (default {DEFAULT_DP_RPC_PORT})",
    )
    g.add_argument(
        "--headless",
        action="store_true",
        help="run this node's DP engines only, no API server; they register with "
        "--data-parallel-address:--data-parallel-rpc-port",
    )


def data_parallel_options_from(ns: argparse.Namespace) -> DataParallelOptions:
    return DataParallelOptions(
        size=ns.data_parallel_size,
        size_local=ns.data_parallel_size_local,
        start_rank=ns.data_parallel_start_rank,
        address=ns.data_parallel_address,
        rpc_port=ns.data_parallel_rpc_port,
        headless=ns.headless,
    )


def engines_world_size(config: EngineConfig) -> int:
    """Devices one engine occupies: TP x PP."""
    return config.parallel_config.world_size


def build_engine_client(
    core_factory: EngineCoreFactory,
    options: DataParallelOptions,
    *,
    device: str,
    world_size: int,
    startup_timeout_s: float | None = None,
) -> AsyncMPClient | DPLBAsyncClient:
    """The API server's engine client: one engine, or a load balancer over DP engines."""
    from paged.server.engine.client import AsyncMPClient
    from paged.server.engine.dp_client import DPLBAsyncClient
    from paged.server.engine.dp_launch import rank_factories, start_local_engines

    if options.size == 1:
        return AsyncMPClient(core_factory, startup_timeout_s=startup_timeout_s)
    factories = rank_factories(
        core_factory,
        start_rank=0,
        num_local=options.num_local,
        world_size=world_size,
        device=device,
    )
    closers: list[Callable[[], None]] = []
    rendezvous = None
    if options.remote_ranks:
        from paged.server.engine.dp_remote import DPRendezvous

        # Bound first, and accepted while the local engines start: remote ranks
        # spawn their engines only once registered, so both startups overlap.
        rendezvous = DPRendezvous(options.address, options.rpc_port)
        closers.append(rendezvous.close)
        logger.info(
            "waiting for data-parallel ranks %s at %s:%d",
            options.remote_ranks,
            options.address,
            options.rpc_port,
        )
    clients: list[AsyncMPClient] = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        remote = None
        if rendezvous is not None:
            remote = pool.submit(
                rendezvous.accept, options.remote_ranks, options.register_timeout_s
            )
        try:
            clients = start_local_engines(factories, startup_timeout_s=startup_timeout_s)
            if remote is not None:
                clients.extend(AsyncMPClient.attach(engine) for engine in remote.result())
        except BaseException:
            if rendezvous is not None:
                rendezvous.cancel.set()
            if remote is not None:
                concurrent.futures.wait([remote])
            for client in clients:
                client.shutdown()
            for close in closers:
                close()
            raise
    logger.info("data parallelism: %d engines (%d on this node)", options.size, options.num_local)
    return DPLBAsyncClient(clients, closers=closers)


def run_headless_node(
    core_factory: EngineCoreFactory, options: DataParallelOptions, *, device: str, world_size: int
) -> int:
    """`paged serve --headless`: this node's DP engines, until the API server goes away."""
    from paged.server.engine.dp_launch import rank_factories
    from paged.server.engine.dp_remote import run_headless

    factories = rank_factories(
        core_factory,
        start_rank=options.start_rank,
        num_local=options.num_local,
        world_size=world_size,
        device=device,
    )
    logger.info(
        "headless: DP ranks %d..%d register with %s:%d",
        options.start_rank,
        options.start_rank + options.num_local - 1,
        options.address,
        options.rpc_port,
    )
    return run_headless(
        factories,
        options.address,
        options.rpc_port,
        register_timeout_s=options.register_timeout_s,
        log_level=logging.getLogger("paged").getEffectiveLevel(),
    )


def open_async_llm(
    args: EngineArgs,
    options: DataParallelOptions,
    *,
    stat_loggers: Sequence[StatLogger] = (),
    startup_timeout_s: float | None = None,
) -> AsyncLLM:
    """An `AsyncLLM` over `options.size` engines of `args`' model (benchmarks, tests).

    Text only, no grammar backend: `paged serve` also wires structured
    outputs, images and the API's metrics around the same engine client.
    """
    from paged.server.async_llm import AsyncLLM
    from paged.server.engine.core import make_engine_core_factory
    from paged.server.engine_args import tokenizer_path
    from paged.server.pooling_frontend import PoolingFrontend
    from paged.server.tokenizer import load_tokenizer

    core_options = args.engine_core_options()
    config = args.create_engine_config()
    mc = config.model_config
    tokenizer = load_tokenizer(tokenizer_path(config, args.tokenizer))
    client = build_engine_client(
        make_engine_core_factory(config, **core_options),
        options,
        device=mc.device,
        world_size=engines_world_size(config),
        startup_timeout_s=startup_timeout_s,
    )
    return AsyncLLM(
        client,
        tokenizer,
        max_model_len=mc.max_model_len,
        vocab_size=mc.vocab_size,
        eos_token_ids=mc.eos_token_ids,
        max_logprobs=config.scheduler_limits.max_logprobs,
        stat_loggers=stat_loggers,
        pooling=PoolingFrontend.from_model_config(mc, args.model_name(), tokenizer),
    )
