"""Start the data-parallel engines of this node, each in its own process.

Every DP rank is a whole engine core (scheduler, KV cache, executor, and its
own TP workers when TP > 1), started with `AsyncMPClient` like the single
engine. `DPRankFactory` wraps the core factory so that, inside the engine
process and before CUDA is initialised, the rank sees only its own GPUs
(``CUDA_VISIBLE_DEVICES``: local rank r of world size w gets GPUs
r*w .. r*w+w-1 of those the frontend sees), as vLLM assigns them.
On CPU every engine runs with the usual thread count (`paged.runner.cpu_threads`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

from paged.server.engine.client import AsyncMPClient
from paged.server.engine.interfaces import EngineCoreFactory, EngineCoreLike

logger = logging.getLogger(__name__)

DP_RANK_ENV = "PAGED_DP_RANK"  # set in each engine process, for its logs and tests


@dataclass(frozen=True)
class DPRankFactory:
    """Picklable: builds rank `dp_rank`'s engine core with only its devices visible."""

    core_factory: EngineCoreFactory
    dp_rank: int
    visible_devices: tuple[str, ...] | None = None  # None: leave CUDA_VISIBLE_DEVICES alone

    def __call__(self) -> EngineCoreLike:
        os.environ[DP_RANK_ENV] = str(self.dp_rank)
        if self.visible_devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(self.visible_devices)
        return self.core_factory()


def rank_devices(local_rank: int, world_size: int, visible: Sequence[str]) -> tuple[str, ...]:
    """The GPUs (as listed in `visible`) of local DP rank `local_rank`; ValueError if too few."""
    start = local_rank * world_size
    if start + world_size > len(visible):
        raise ValueError(
            f"data_parallel_size_local: local DP rank {local_rank} needs GPUs "
            f"{start}..{start + world_size - 1} ({world_size} per engine) but only "
            f"{len(visible)} are visible"
        )
    return tuple(visible[start : start + world_size])


def visible_cuda_devices() -> list[str]:
    """The GPUs this process may use, as `CUDA_VISIBLE_DEVICES` entries."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def rank_factories(
    core_factory: EngineCoreFactory,
    *,
    start_rank: int,
    num_local: int,
    world_size: int,
    device: str,
) -> list[DPRankFactory]:
    """One factory per local DP rank start_rank .. start_rank + num_local - 1."""
    visible = visible_cuda_devices() if device.startswith("cuda") else None
    factories = []
    for local in range(num_local):
        devices = None if visible is None else rank_devices(local, world_size, visible)
        factories.append(DPRankFactory(core_factory, start_rank + local, devices))
    return factories


def start_local_engines(
    factories: Sequence[DPRankFactory], *, startup_timeout_s: float | None = None
) -> list[AsyncMPClient]:
    """Start every rank's engine process at once; all ready, or none left running."""
    if not factories:
        return []
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(factories)) as pool:
        futures = [
            pool.submit(AsyncMPClient, f, startup_timeout_s=startup_timeout_s) for f in factories
        ]
        concurrent.futures.wait(futures)
    clients = [f.result() for f in futures if f.exception() is None]
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        for client in clients:
            client.shutdown()
        raise failed[0]  # type: ignore[misc]
    for f, client in zip(factories, clients, strict=True):
        logger.info("data-parallel engine %d ready: %s", f.dp_rank, client.info)
    return clients
