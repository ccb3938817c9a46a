"""paged.server.engine: the engine core, its process loop, and the clients that reach it.

Light on purpose (no torch): the engine process and the clients import this
package. `EngineCore` and `make_engine_core_factory` live in
`paged.server.engine.core`, which imports the runner.
"""

from paged.server.engine.client import (
    AsyncEngineCoreClient,
    AsyncMPClient,
    EngineCoreClient,
    InprocClient,
    SyncMPClient,
)
from paged.server.engine.errors import EngineDeadError, EngineStartupError
from paged.server.engine.interfaces import (
    EngineCoreFactory,
    EngineCoreLike,
    ExecutorInterface,
    SchedulerInterface,
)
from paged.server.engine.messages import UTILITY_RESULT_TYPES, EngineCoreInfo, EngineCoreStats

__all__ = [
    "UTILITY_RESULT_TYPES",
    "AsyncEngineCoreClient",
    "AsyncMPClient",
    "EngineCoreClient",
    "EngineCoreFactory",
    "EngineCoreInfo",
    "EngineCoreLike",
    "EngineCoreStats",
    "EngineDeadError",
    "EngineStartupError",
    "ExecutorInterface",
    "InprocClient",
    "SchedulerInterface",
    "SyncMPClient",
]
