"""`create_executor`: the executor `ParallelConfig.executor_backend` names.

In its own module, not a method of `Executor` (vLLM's `Executor.get_class`):
the implementations subclass `Executor`, so the base class cannot import them
without an import cycle.
"""

from __future__ import annotations

from paged.runner.config import EngineConfig
from paged.runner.executor.abstract import Executor


def create_executor(engine_config: EngineConfig) -> Executor:
    """The executor `engine_config.parallel_config` asks for, started and with models loaded."""
    backend = engine_config.parallel_config.executor_backend
    if backend == "uni":
        from paged.runner.executor.uniproc import UniProcExecutor

        return UniProcExecutor(engine_config)
    if backend == "ray":
        # Imported only here: ray is an optional dependency.
        from paged.runner.executor.ray_distributed import RayDistributedExecutor

        return RayDistributedExecutor(engine_config)
    from paged.runner.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(engine_config)
