"""Engine settings of pooling models: `--pooler-config`, chunking and prefix caching.

vLLM 0.33 turns chunked prefill and prefix caching off for pooling models
that cannot use them (vllm/config/model.py:2193-2280, applied as defaults in
vllm/engine/arg_utils.py:3044-3045): bidirectional encoders (a token attends
to later ones), and causal models whose pooling reads more than the last
token (MEAN, CLS) or STEP pooling. LAST / ALL pooling on a decoder keeps both
(ALL-token tasks skip prefix-cache reads per request, PoolingParams.verify).
With chunking off a step must fit a whole prompt, so the token budget is
raised to max_model_len as vLLM's SchedulerConfig does.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from paged.runner.config import ModelConfig
    from paged.runner.pooling import PoolerConfig
    from paged.scheduler.pooling_params import PoolingModelInfo

logger = logging.getLogger(__name__)


def parse_pooler_config(value: str | dict[str, Any] | None) -> PoolerConfig | None:
    """`--pooler-config` JSON text (or a dict from `LLM(...)`); ValueError naming the key."""
    if value is None:
        return None
    from paged.runner.json_flag import parse_json_object
    from paged.runner.pooling import PoolerConfig

    return PoolerConfig.from_json(parse_json_object(value, "pooler_config"))


def _supports_chunking_and_caching(model_config: ModelConfig) -> bool:
    """vLLM's is_chunked_prefill_supported / is_prefix_caching_supported (same rule)."""
    config = model_config.pooler_config
    if config is None:
        return True
    if model_config.is_encoder_only:
        return False
    return not (config.seq_pooling_type in ("MEAN", "CLS") or config.tok_pooling_type == "STEP")


def pooling_scheduler_settings(
    model_config: ModelConfig,
    *,
    enable_chunked_prefill: bool,
    enable_prefix_caching: bool,
    max_num_batched_tokens: int,
) -> tuple[bool, bool, int]:
    """(enable_chunked_prefill, enable_prefix_caching, max_num_batched_tokens) in effect."""
    if model_config.pooler_config is None or _supports_chunking_and_caching(model_config):
        return enable_chunked_prefill, enable_prefix_caching, max_num_batched_tokens
    if enable_chunked_prefill or enable_prefix_caching:
        logger.info(
            "%s with %s pooling: chunked prefill and prefix caching are off (as vLLM)",
            model_config.architecture,
            model_config.pooler_config.seq_pooling_type,
        )
    return False, False, max(max_num_batched_tokens, model_config.max_model_len)


def pooling_model_info(model_config: ModelConfig, served_model_name: str) -> PoolingModelInfo:
    """What `PoolingParams.verify` checks requests against (vLLM's ModelConfig facts)."""
    from paged.scheduler.pooling_params import PoolingModelInfo

    config = model_config.pooler_config
    hf = model_config.hf_config
    dims = getattr(hf, "matryoshka_dimensions", None)
    return PoolingModelInfo(
        served_model_name=served_model_name,
        embedding_size=_embedding_size(model_config),
        is_matryoshka=bool(dims) or bool(getattr(hf, "is_matryoshka", False)),
        matryoshka_dimensions=tuple(int(d) for d in dims) if dims else None,
        has_pooler_config=config is not None,
        default_dimensions=None if config is None else config.dimensions,
        default_use_activation=None if config is None else config.use_activation,
        tok_pooling_type=None if config is None else config.tok_pooling_type,
        default_step_tag_id=None if config is None else config.step_tag_id,
        default_returned_token_ids=(
            tuple(config.returned_token_ids)
            if config is not None and config.returned_token_ids is not None
            else None
        ),
    )


def _embedding_size(model_config: ModelConfig) -> int:
    """The embedding width: the last sentence-transformers Dense module's, else hidden size."""
    override = getattr(model_config.hf_config, "embedding_size", None)
    if override:
        return int(override)
    if model_config.weights_format == "safetensors":
        from paged.runner.pooling import load_st_dense_layers

        layers = load_st_dense_layers(model_config.model)
        if layers:
            return int(layers[-1].weight.shape[0])
    return model_config.hidden_size
