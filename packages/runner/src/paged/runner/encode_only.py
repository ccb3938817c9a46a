"""`EncodeOnlyRunner`: the worker of an encode-only EPD producer (`--ec-role producer`).

vLLM's encoder-only instance (its runner returns `make_empty_encoder_model_runner_output`
and its worker allocates no KV cache). Per step:

    free(free_encoder_mm_hashes)       the scheduler's evictions
    bind the EC connector's metadata
    encode the scheduled items not in the cache, batched per modality, into the
      preallocated encoder cache; save_caches(cache, mm_hash) for each
    save_caches again for a new request's items already in the cache (encoded for
      an earlier request; the consumer of this one may not have them)
    -> ModelRunnerOutput: every scheduled request, no token (the scheduler's
       encode_only mode finishes it once its prompt went through), and the
       connector's ECConnectorOutput

What it never builds: the language model (only `VisionEncoderModel` is
loaded), KV cache tensors, a sampler, an input batch. The scheduler still
needs block accounting to admit requests; it gets a *virtual* KV cache (one
group of a one-element spec, no tensor behind it), sized for
`max_num_seqs` (at most 64) full-length requests.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch

from paged.kvcache import FullAttentionSpec, KVCacheConfig, KVCacheSpec
from paged.multimodal.inputs import MultiModalFeatureSpec
from paged.runner.config import CacheConfig, ModelConfig, SchedulerLimits
from paged.runner.ec_connector import ECConnectorWorker
from paged.runner.encoder_cache_buffer import PreallocatedEncoderCache
from paged.runner.encoder_runner import tensor_from_data
from paged.runner.layers.linear import CheckpointTensor
from paged.scheduler.boundary import (
    ECConnectorOutput,
    GrammarOutput,
    ModelRunnerOutput,
    SchedulerOutput,
)

VIRTUAL_KV_LAYER = "encode_only.virtual"
_MAX_VIRTUAL_SEQS = 64


class VisionEncoderModel(Protocol):
    """A model's encoder path alone (e.g. `models.gemma3_vision.Gemma3VisionEncoder`)."""

    output_hidden_size: int

    def embed_multimodal(
        self, modality: str, items: Sequence[dict[str, torch.Tensor]]
    ) -> list[torch.Tensor]: ...

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]: ...

    def expected_weights(self) -> set[str]: ...

    def eval(self) -> Any: ...


def _encoder_class(architecture: str) -> type[VisionEncoderModel]:
    if architecture == "Gemma3ForConditionalGeneration":
        from paged.runner.models.gemma3_vision import Gemma3VisionEncoder

        return Gemma3VisionEncoder
    raise ValueError(
        f"ec_role producer: model architecture {architecture!r} has no encoder-only "
        "implementation (supported: Gemma3ForConditionalGeneration)"
    )


def load_vision_encoder(model_config: ModelConfig, device: torch.device) -> VisionEncoderModel:
    """Build the encoder-only model on `device` and fill it from the checkpoint."""
    from paged.runner.loader.loader import iterate_weights

    cls = _encoder_class(model_config.architecture)
    with device:
        model = cls(model_config)  # type: ignore[call-arg]
    loaded = model.load_weights(iterate_weights(model_config))
    missing = sorted(model.expected_weights() - loaded)
    if missing:
        raise ValueError(
            f"model: the checkpoint at {model_config.model!r} lacks encoder weights "
            f"{', '.join(missing[:5])}"
        )
    model.eval()
    return model


def virtual_kv_spec(block_size: int) -> FullAttentionSpec:
    """One element per token: the scheduler counts blocks, nothing is allocated."""
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype="float32")


def virtual_kv_bytes(block_size: int, limits: SchedulerLimits, max_model_len: int) -> int:
    """The byte budget that gives the virtual cache its blocks (see the module doc)."""
    per_seq = math.ceil(max_model_len / block_size)
    num_blocks = min(limits.max_num_seqs, _MAX_VIRTUAL_SEQS) * per_seq + 1
    return num_blocks * virtual_kv_spec(block_size).page_size_bytes


class EncodeOnlyRunner:
    """See the module docstring. The worker drives it like a `ModelRunner`."""

    kv_connector = None  # an encode-only instance has no KV cache to transfer

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_limits: SchedulerLimits,
        device: torch.device | str,
        ec_connector: ECConnectorWorker,
        *,
        encoder_cache_size: int | None = None,
    ) -> None:
        if not ec_connector.is_producer or ec_connector.is_consumer:
            raise ValueError("EncodeOnlyRunner needs an ec_producer connector (not ec_both)")
        self.model_config = model_config
        self.cache_config = cache_config
        self.limits = scheduler_limits
        self.device = torch.device(device)
        self.ec_connector = ec_connector
        # The scheduler's encoder_cache_size (embeddings); vLLM's default is the token budget.
        self.encoder_cache_size = encoder_cache_size or scheduler_limits.max_num_batched_tokens
        self.model: VisionEncoderModel | None = None
        self.encoder_cache: PreallocatedEncoderCache | None = None
        self.features: dict[str, list[MultiModalFeatureSpec]] = {}
        # Counters for tests and metrics.
        self.num_encoder_calls = 0
        self.num_encoded_items = 0
        self.encoder_seconds = 0.0

    # ----------------------------------------------------------- start-up

    def load_model(self, model: VisionEncoderModel | None = None) -> None:
        self.model = model or load_vision_encoder(self.model_config, self.device)
        self.encoder_cache = PreallocatedEncoderCache(
            self.encoder_cache_size,
            self.model.output_hidden_size,
            self.model_config.dtype,
            self.device,
        )
        self.ec_connector.register_caches(self.encoder_cache)

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        return {VIRTUAL_KV_LAYER: virtual_kv_spec(self.cache_config.block_size)}

    def determine_available_memory(self) -> int:
        return virtual_kv_bytes(
            self.cache_config.block_size, self.limits, self.model_config.max_model_len
        )

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Nothing to allocate: the blocks are the scheduler's bookkeeping only."""

    # ---------------------------------------------------------------- step

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        so = scheduler_output
        model, cache = self._require_loaded()
        for req_id in so.finished_req_ids:
            self.features.pop(req_id, None)
        for mm_hash in so.free_encoder_mm_hashes:
            cache.free(mm_hash)
        for new in so.scheduled_new_reqs:
            self.features[new.req_id] = list(new.mm_features or [])
        connector = self.ec_connector
        if so.ec_connector_metadata is not None:
            connector.bind_connector_metadata(so.ec_connector_metadata)
        try:
            saved = self._encode(model, cache, so.scheduled_encoder_inputs)
            for new in so.scheduled_new_reqs:
                for feature in new.mm_features or []:
                    if feature.identifier in cache and feature.identifier not in saved:
                        connector.save_caches(cache, feature.identifier)
                        saved.add(feature.identifier)
            sending, recving = connector.get_finished(set(so.finished_req_ids))
            ec_output = ECConnectorOutput(
                finished_sending=sorted(sending or ()),
                finished_recving=sorted(recving or ()),
                failed_recving=sorted(connector.get_failed_loads()),
            )
        finally:
            connector.clear_connector_metadata()
        req_ids = list(so.num_scheduled_tokens)
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=[[] for _ in req_ids],
            ec_connector_output=ec_output,
        )

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        raise RuntimeError("an encode-only runner samples nothing (execute_model returns)")

    def _require_loaded(self) -> tuple[VisionEncoderModel, PreallocatedEncoderCache]:
        if self.model is None or self.encoder_cache is None:
            raise RuntimeError("load_model() must be called before execute_model()")
        return self.model, self.encoder_cache

    def _encode(
        self,
        model: VisionEncoderModel,
        cache: PreallocatedEncoderCache,
        scheduled: Mapping[str, list[int]],
    ) -> set[str]:
        """Encode the scheduled items not cached yet; returns the hashes saved."""
        by_modality: dict[str, list[MultiModalFeatureSpec]] = {}
        chosen: set[str] = set()
        for req_id, indices in scheduled.items():
            features = self.features.get(req_id)
            if features is None:
                raise ValueError(f"scheduled_encoder_inputs: unknown request {req_id!r}")
            for i in indices:
                if not 0 <= i < len(features):
                    raise ValueError(
                        f"scheduled_encoder_inputs[{req_id!r}]: item {i} out of range "
                        f"({len(features)} items)"
                    )
                feature = features[i]
                if feature.identifier in cache or feature.identifier in chosen:
                    continue
                if feature.data is None:
                    raise ValueError(
                        f"request {req_id!r} item {i} (mm_hash {feature.identifier}) reached "
                        "the runner without data"
                    )
                chosen.add(feature.identifier)
                by_modality.setdefault(feature.modality, []).append(feature)
        saved: set[str] = set()
        for modality, items in by_modality.items():
            data = [
                {k: tensor_from_data(t).to(self.device) for k, t in (f.data or {}).items()}
                for f in items
            ]
            start = time.perf_counter()
            outputs = model.embed_multimodal(modality, data)
            self.encoder_seconds += time.perf_counter() - start
            self.num_encoder_calls += 1
            self.num_encoded_items += len(items)
            for feature, output in zip(items, outputs, strict=True):
                expected = feature.mm_position.get_num_embeds()
                if output.shape[0] != expected:
                    raise ValueError(
                        f"mm_hash {feature.identifier}: the encoder gave {output.shape[0]} "
                        f"embeddings for a placeholder with {expected} embedded positions"
                    )
                cache.store(feature.identifier, output)
                self.ec_connector.save_caches(cache, feature.identifier)
                saved.add(feature.identifier)
        return saved
