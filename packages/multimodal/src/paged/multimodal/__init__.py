"""paged.multimodal: placeholder ranges, feature specs and the encoder-cache bookkeeping."""

from paged.multimodal.encoder_cache import (
    EncoderBudget,
    EncoderCacheManager,
    EncoderCacheRequest,
    compute_mm_encoder_budget,
    num_encoder_embeds,
)
from paged.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange, TensorData

__all__ = [
    "EncoderBudget",
    "EncoderCacheManager",
    "EncoderCacheRequest",
    "MultiModalFeatureSpec",
    "PlaceholderRange",
    "TensorData",
    "compute_mm_encoder_budget",
    "num_encoder_embeds",
]
