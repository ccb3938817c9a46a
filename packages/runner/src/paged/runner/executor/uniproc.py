"""`UniProcExecutor`: one worker in the engine core's own process (no IPC at all)."""

from __future__ import annotations

import traceback
from typing import Any

from paged.runner.config import EngineConfig
from paged.runner.executor.abstract import Executor, WorkerError
from paged.runner.executor.dispatch import serve_call
from paged.runner.executor.messages import Crash, Shutdown, WorkerCall
from paged.runner.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, engine_config: EngineConfig) -> None:
        super().__init__(engine_config)
        if engine_config.parallel_config.tensor_parallel_size != 1:
            raise ValueError(
                "tensor_parallel_size: UniProcExecutor runs one worker; use the 'mp' backend"
            )
        self.worker = Worker(engine_config)
        self.worker.init_device()
        self.worker.load_model()
        self._closed = False

    def collective_rpc(self, call: WorkerCall, timeout: float | None = None) -> list[Any]:
        if self._closed:
            raise RuntimeError("the executor is shut down")
        if isinstance(call, Crash):
            raise ValueError("Crash is a multiprocess test hook; it would kill this process")
        try:
            return [serve_call(self.worker, call)]
        except (ValueError, RuntimeError):
            raise
        except Exception as exc:  # surfaced with the worker's traceback, like the mp executor
            raise WorkerError(f"worker 0 failed: {traceback.format_exc()}") from exc

    def shutdown(self) -> None:
        if not self._closed:
            serve_call(self.worker, Shutdown())
            self._closed = True
