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
    "PrefixCacheStats",
    "RequestOutputKind",
    "SamplingParams",
    "SchedulerOutput",
    "SchedulerStats",
    "StructuredOutputsParams",
]
