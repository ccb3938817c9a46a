"""The Ray actor that hosts one `Worker` (used by `RayDistributedExecutor`).

A plain class: `ray_distributed.py` wraps it with `ray.remote` when the Ray
backend is chosen, so this module never imports ray. Calls and replies are the
multiproc executor's msgpack bytes (`messages.WorkerCall` in, `Reply` out), so
the actor dispatches on the call's type exactly like a worker process does and
Ray only ever moves opaque bytes (no pickled engine objects per step).
"""

from __future__ import annotations

import os
import socket
import traceback

import torch

from paged.runner.config import EngineConfig
from paged.runner.executor.dispatch import serve_call
from paged.runner.executor.messages import Reply, decode_call, encode, encode_result
from paged.runner.executor.rank_layout import world_size
from paged.runner.worker import Worker


class RayWorkerActor:
    """One rank: `rendezvous_address` (rank 0 only), `start`, then `call`s."""

    def __init__(self, rank: int, env: dict[str, str]) -> None:
        # The driver's PAGED_*/TRITON_*/thread settings: a Ray worker process
        # inherits the raylet's environment, not the engine core's.
        os.environ.update(env)
        self.rank = rank
        self.worker: Worker | None = None

    def pid(self) -> int:
        return os.getpid()

    def rendezvous_address(self) -> str:
        """A tcp:// init method on this node's IP and a free port (torch.distributed's store)."""
        import ray  # inside a Ray actor ray is already imported; keeps the module ray-free

        ip: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        return f"tcp://{ip}:{port}"

    def start(self, engine_config: EngineConfig, init_method: str) -> str | None:
        """Join torch.distributed and load the model; None, or the start-up traceback."""
        try:
            size = world_size(engine_config.parallel_config)
            # Share the node's cores between ranks instead of oversubscribing them.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
            # Ray gives each GPU actor exactly its own GPU (CUDA_VISIBLE_DEVICES),
            # so the device index inside the actor is always 0.
            worker = Worker(
                engine_config, rank=self.rank, local_rank=0, distributed_init_method=init_method
            )
            worker.init_device()
            worker.load_model()
        except Exception:
            return traceback.format_exc()
        self.worker = worker
        return None

    def call(self, payload: bytes) -> bytes:
        """Serve one encoded `WorkerCall`; the encoded `Reply` (result or traceback)."""
        call = decode_call(payload)
        if self.worker is None:
            return encode(Reply(self.rank, error="the worker was not started"))
        try:
            return encode(Reply(self.rank, encode_result(call, serve_call(self.worker, call))))
        except Exception:
            return encode(Reply(self.rank, error=traceback.format_exc()))
