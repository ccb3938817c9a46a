"""paged.scheduler: continuous batching and the engine's boundary types."""

from paged.scheduler.boundary import (
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    KVConnectorOutput,
    KVTransferParams,
    LogprobsLists,
    ModelRunnerOutput,
    NewRequestData,
    PrefixCacheStats,
    SchedulerOutput,
    SchedulerStats,
)
from paged.scheduler.pooling_params import PoolingModelInfo, PoolingParams
from paged.scheduler.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

__all__ = [
    "CachedRequestData",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreRequest",
    "FinishReason",
    "KVConnectorOutput",
    "KVTransferParams",
    "LogprobsLists",
    "ModelRunnerOutput",
    "NewRequestData",
    "PoolingModelInfo",
    "PoolingParams",
    "PrefixCacheStats",
    "RequestOutputKind",
    "SamplingParams",
    "SchedulerOutput",
    "SchedulerStats",
    "StructuredOutputsParams",
]
