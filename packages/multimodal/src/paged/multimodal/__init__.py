"""paged.multimodal: media loading, content hashing, processor and encoder caches."""

from paged.multimodal.encoder_cache import (
    EncoderBudget,
    EncoderCacheManager,
    EncoderCacheRequest,
    compute_mm_encoder_budget,
    num_encoder_embeds,
)
from paged.multimodal.hasher import MultiModalHasher
from paged.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange, TensorData
from paged.multimodal.media import MediaConnector, MediaError, MediaLimits, decode_image
from paged.multimodal.media_url_policy import (
    MediaUrlPolicy,
    MediaUrlRefused,
    parse_allowed_media_domains,
)
from paged.multimodal.processing import (
    Gemma3MultiModalProcessor,
    ProcessedPrompt,
    PromptError,
    from_tensor_data,
    to_tensor_data,
)
from paged.multimodal.processor_cache import (
    PROCESSOR_CACHE_TYPES,
    ProcessorCacheConfig,
    ProcessorCacheError,
    ReceiverCache,
    SenderCache,
    make_receiver_cache,
    make_sender_cache,
)

__all__ = [
    "PROCESSOR_CACHE_TYPES",
    "EncoderBudget",
    "EncoderCacheManager",
    "EncoderCacheRequest",
    "Gemma3MultiModalProcessor",
    "MediaConnector",
    "MediaError",
    "MediaLimits",
    "MediaUrlPolicy",
    "MediaUrlRefused",
    "MultiModalFeatureSpec",
    "MultiModalHasher",
    "PlaceholderRange",
    "ProcessedPrompt",
    "ProcessorCacheConfig",
    "ProcessorCacheError",
    "PromptError",
    "ReceiverCache",
    "SenderCache",
    "TensorData",
    "compute_mm_encoder_budget",
    "decode_image",
    "from_tensor_data",
    "make_receiver_cache",
    "make_sender_cache",
    "num_encoder_embeds",
    "parse_allowed_media_domains",
    "to_tensor_data",
]
