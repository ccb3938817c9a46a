"""The encode-only EPD producer (`paged serve --ec-role producer`): engine settings.

An `ec_producer` (not `ec_both`) instance runs the vision encoder and nothing
else (vLLM's encoder-only instance): its worker builds `EncodeOnlyRunner`
(no language model, no KV tensors), its scheduler runs with
`SchedulerConfig.encode_only` (a request finishes, LENGTH_CAPPED with no
tokens, once its prompt and so every image went through the encoder), and:

- prefix caching is off: a prefix hit would skip the images it covers, which
  would then never be handed to the connector (vLLM's example runs its
  encoder with --no-enable-prefix-caching too);
- no KV byte budget: the runner reports the virtual KV cache it needs;
- speculative decoding and a KV connector are refused (nothing decodes).
"""

from __future__ import annotations

import dataclasses
import logging

from paged.runner.config import EngineConfig
from paged.server.ec_transfer import ECConnectorBuilder

logger = logging.getLogger(__name__)


def is_encode_only(engine_config: EngineConfig) -> bool:
    """Whether `engine_config`'s EC connector makes it an encode-only producer."""
    builder = engine_config.ec_connector_factory
    return isinstance(builder, ECConnectorBuilder) and builder.config().is_encode_only


def encode_only_engine_config(config: EngineConfig) -> EngineConfig:
    """`config` as an encode-only producer needs it (unchanged for any other engine)."""
    if not is_encode_only(config):
        return config
    if config.speculative_config is not None:
        raise ValueError(
            "speculative_config: an encode-only producer (ec_producer) decodes nothing"
        )
    if config.kv_connector_factory is not None:
        raise ValueError(
            "kv_transfer_config: an encode-only producer (ec_producer) has no KV cache; "
            "give the KV connector to the prefill instance"
        )
    if config.cache_config.enable_prefix_caching:
        logger.info("ec_producer: prefix caching off (every image must reach the encoder)")
    cache = dataclasses.replace(
        config.cache_config, enable_prefix_caching=False, kv_cache_memory_bytes=None
    )
    return dataclasses.replace(config, cache_config=cache)
