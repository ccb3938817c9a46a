"""Executors: how the engine core reaches its workers (in-process or one process per rank)."""

from paged.runner.executor.abstract import Executor, WorkerDiedError, WorkerError
from paged.runner.executor.factory import create_executor
from paged.runner.executor.multiproc import MultiprocExecutor
from paged.runner.executor.uniproc import UniProcExecutor

__all__ = [
    "Executor",
    "MultiprocExecutor",
    "UniProcExecutor",
    "WorkerDiedError",
    "WorkerError",
    "create_executor",
]
