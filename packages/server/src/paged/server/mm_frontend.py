"""The frontend's multimodal step: image parts -> images -> processed prompt (seed: InputProcessor).

    chat image_url parts --MediaConnector (limits, MediaUrlPolicy)--> PIL images
    prompt + images --Gemma3MultiModalProcessor (hash, P0 cache, HF image processor)-->
        token ids with placeholders + MultiModalFeatureSpec per image
    right before the request is sent: SenderCache.commit (what travels over ZMQ)

Built once per server from the model directory (`AutoProcessor`), only for
models with a vision tower; a text-only model has none, and every image it is
sent is refused with a 400 naming the model.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from paged.multimodal.inputs import MultiModalFeatureSpec
from paged.multimodal.media import MediaConnector, MediaLimits
from paged.multimodal.media_url_policy import MediaUrlPolicy, parse_allowed_media_domains
from paged.multimodal.processing import Gemma3MultiModalProcessor, ProcessedPrompt
from paged.multimodal.processor_cache import ProcessorCacheConfig, SenderCache
from paged.server.errors import InvalidRequestError

SUPPORTED_MODALITIES = ("image",)
# vLLM's default --limit-mm-per-prompt is 999 per modality for most models;
# each Gemma3 image costs 256 prompt tokens, so the context bounds it anyway.
DEFAULT_LIMIT_PER_PROMPT = 999
# Processed requests awaiting their send (normally one or two at a time).
MAX_PENDING = 1024


def parse_limit_mm_per_prompt(value: str | Mapping[str, int] | None) -> dict[str, int]:
    """vLLM's `--limit-mm-per-prompt` ('{"image": 2}' or a dict) -> {modality: max count}."""
    if value is None:
        return {}
    raw: object = value
    if isinstance(value, str):
        try:
            raw = json.loads(value)
        except ValueError:
            raise ValueError(
                f"limit_mm_per_prompt must be JSON such as '{{\"image\": 2}}', got {value!r}"
            ) from None
    if not isinstance(raw, Mapping):
        raise ValueError(f"limit_mm_per_prompt must be a JSON object, got {value!r}")
    limits: dict[str, int] = {}
    for modality, count in raw.items():
        # vLLM also accepts {"image": {"count": 2, ...}} (per-item size hints).
        if isinstance(count, Mapping):
            count = count.get("count")
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(
                f"limit_mm_per_prompt[{modality!r}] must be an integer >= 0, got {count!r}"
            )
        limits[str(modality)] = count
    return limits


def media_limits_from_env(environ: Mapping[str, str]) -> MediaLimits:
    """`MediaLimits` with vLLM's VLLM_IMAGE_FETCH_TIMEOUT (seconds, default 5) applied."""
    raw = environ.get("VLLM_IMAGE_FETCH_TIMEOUT")
    if raw is None or raw.strip() == "":
        return MediaLimits()
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:  # also refuses nan
        raise ValueError(f"VLLM_IMAGE_FETCH_TIMEOUT must be a number of seconds > 0, got {raw!r}")
    return MediaLimits(fetch_timeout_s=seconds)


def media_url_policy(
    allowed_media_domains: Sequence[str] | str | None,
    bind_host: str | None,
    environ: Mapping[str, str],
) -> MediaUrlPolicy:
    """The http(s) media policy of a server listening on `bind_host` (None: in-process).

    `bind_host` None is the offline `LLM` (no listener): vLLM's behaviour, no
    address filtering. VLLM_MEDIA_URL_ALLOW_REDIRECTS is vLLM's (0 or 1, default 1).
    """
    raw = environ.get("VLLM_MEDIA_URL_ALLOW_REDIRECTS", "1").strip() or "1"
    try:
        allow_redirects = bool(int(raw))
    except ValueError:
        raise ValueError(f"VLLM_MEDIA_URL_ALLOW_REDIRECTS must be 0 or 1, got {raw!r}") from None
    if bind_host is None:
        return MediaUrlPolicy(
            parse_allowed_media_domains(allowed_media_domains), allow_redirects=allow_redirects
        )
    return MediaUrlPolicy.for_bind_host(
        bind_host, allowed_media_domains, allow_redirects=allow_redirects
    )


def mm_tokens_per_item(hf_config: Any) -> int:
    """Encoder embeddings of one image for a model with a vision tower; 0 when text-only."""
    if getattr(hf_config, "vision_config", None) is None:
        return 0
    return int(getattr(hf_config, "mm_tokens_per_image", 0) or 0)


@dataclass(frozen=True, slots=True)
class MultiModalEngineOptions:
    """The engine core's multimodal settings (picklable: they travel to the engine process)."""

    processor_cache: ProcessorCacheConfig = field(default_factory=ProcessorCacheConfig)
    # vLLM's --disable-chunked-mm-input: never split one item's placeholder across steps.
    disable_chunked_mm_input: bool = False


@dataclass
class MultiModalFrontend:
    """Loads, limits, processes and (at send time) commits the images of requests."""

    processor: Gemma3MultiModalProcessor
    media: MediaConnector
    limits: dict[str, int] = field(default_factory=dict)
    # Requests processed but not sent yet: their images, for commit-time re-processing.
    # Bounded: a request cancelled while its images were processed on the worker
    # thread may never be committed or discarded.
    _pending: OrderedDict[str, ProcessedPrompt] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def cache(self) -> SenderCache:
        return self.processor.cache

    def limit(self, modality: str) -> int:
        return self.limits.get(modality, DEFAULT_LIMIT_PER_PROMPT)

    def check_counts(self, counts: Mapping[str, int], param: str) -> None:
        """400 when a prompt carries more items than `--limit-mm-per-prompt` allows."""
        for modality, n in counts.items():
            if modality not in SUPPORTED_MODALITIES:
                raise InvalidRequestError(
                    param, f"modality {modality!r} is not supported (supported: image)"
                )
            limit = self.limit(modality)
            if n > limit:
                raise InvalidRequestError(
                    param,
                    f"At most {limit} {modality}(s) may be provided in one prompt, got {n} "
                    "(raise --limit-mm-per-prompt)",
                )

    def load_images(self, urls: Sequence[str]) -> list[Image.Image]:
        """Blocking: fetch and decode every URL (MediaError, a ValueError, names the problem)."""
        return [self.media.load_image(url) for url in urls]

    def process(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        images: Sequence[Image.Image],
        *,
        add_special_tokens: bool,
    ) -> ProcessedPrompt:
        """Expand placeholders and process images; remembered until `commit` or `discard`."""
        self.check_counts({"image": len(images)}, "multi_modal_data")
        for i, image in enumerate(images):
            if not isinstance(image, Image.Image):
                raise InvalidRequestError(
                    "multi_modal_data",
                    f"multi_modal_data['image'][{i}] must be a PIL image, "
                    f"got {type(image).__name__}",
                )
        processed = self.processor.process(prompt, images, add_special_tokens=add_special_tokens)
        with self._lock:
            self._pending[request_id] = processed
            while len(self._pending) > MAX_PENDING:
                self._pending.popitem(last=False)
        return processed

    def commit(
        self, request_id: str, features: Sequence[MultiModalFeatureSpec]
    ) -> list[MultiModalFeatureSpec]:
        """The features to send, updating the P0 cache; call right before sending, in order."""
        with self._lock:
            processed = self._pending.pop(request_id, None)
        images = processed.images if processed is not None else []

        def reprocess(index: int) -> dict[str, Any]:
            if not images:
                raise RuntimeError(f"request {request_id!r}: no image kept for re-processing")
            return self.processor.reprocess(images, index)

        return self.cache.commit(features, reprocess)

    def discard(self, request_id: str) -> None:
        with self._lock:
            self._pending.pop(request_id, None)

    def close(self) -> None:
        self.cache.close()


def build_mm_frontend(
    model_dir: str,
    model_id: str,
    *,
    cache_config: ProcessorCacheConfig,
    limit_mm_per_prompt: str | Mapping[str, int] | None = None,
    allowed_local_media_path: str | None = None,
    media_limits: MediaLimits | None = None,
    media_url_policy: MediaUrlPolicy | None = None,
) -> MultiModalFrontend:
    """Load the model's HF processor (Gemma3Processor) and wire the P0 pieces."""
    from transformers import AutoProcessor

    auto: Any = AutoProcessor  # untyped in transformers
    try:
        hf_processor = auto.from_pretrained(model_dir)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"the model {model_dir!r} has a vision tower but its image processor could not "
            f"be loaded: {e}"
        ) from e
    processor = Gemma3MultiModalProcessor(hf_processor, model_id, cache_config.make_sender())
    return MultiModalFrontend(
        processor=processor,
        media=MediaConnector(
            media_limits,
            allowed_local_media_path=allowed_local_media_path,
            url_policy=media_url_policy,
        ),
        limits=parse_limit_mm_per_prompt(limit_mm_per_prompt),
    )
