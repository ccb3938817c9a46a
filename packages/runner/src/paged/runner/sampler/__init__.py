"""Sampling: `Sampler`, its per-step `SamplingMetadata`, and the logits transforms."""

from paged.runner.sampler.metadata import SamplingMetadata
from paged.runner.sampler.sampler import (
    LogprobsTensors,
    Sampler,
    SamplerOutput,
    compute_logprobs_tensors,
)

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "compute_logprobs_tensors",
]
