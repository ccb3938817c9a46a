"""Prompt + images -> token ids with placeholders, per-item tensors and `PlaceholderRange`s.

Seed: MM処理パイプライン §2-§5 (HF processor, prompt updates, MultiModalFeatureSpec).
The HF processor object (`Gemma3Processor` from transformers, loaded by the
server from the model directory) is used through the small Protocols below,
so this package does not import transformers.

Gemma3, as its HF processor does: every `<start_of_image>` (the boi token the
chat template writes for an image part) becomes

    "\\n\\n" <start_of_image> <image_soft_token> x mm_tokens_per_image <end_of_image> "\\n\\n"

The item's `PlaceholderRange` spans boi .. eoi (`mm_tokens_per_image + 2`
tokens) with `is_embed` true on the soft tokens only: the special tokens keep
their text embeddings, and the encoder cache counts only real embeddings.
The boi/eoi pair, not the surrounding newlines, bounds the span because
newlines may merge with neighbouring text when tokenized; special tokens never do.

Per image the processing is: content hash (`MultiModalHasher`) -> the sender
cache may already hold or have sent it -> otherwise the HF image processor
runs (all misses of a request in one batch) -> `pixel_values` of shape
(1, 3, H, W) as `TensorData` (float32, row-major; no pan-and-scan crops).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from PIL import Image

from paged.multimodal.hasher import MultiModalHasher
from paged.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange, TensorData
from paged.multimodal.processor_cache import ItemData, SenderCache


class PromptError(ValueError):
    """Prompt and multimodal data do not fit together (the API answers 400)."""


class HFTokenizerLike(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def convert_tokens_to_ids(self, tokens: str) -> Any: ...


class HFImageProcessorLike(Protocol):
    def __call__(self, images: Any, **kwargs: Any) -> Mapping[str, Any]: ...


class Gemma3ProcessorLike(Protocol):
    """What `transformers.Gemma3Processor` offers that this module uses."""

    @property
    def tokenizer(self) -> Any: ...

    @property
    def image_processor(self) -> Any: ...

    image_seq_length: int
    boi_token: str
    full_image_sequence: str


def to_tensor_data(array: np.ndarray[Any, Any]) -> TensorData:
    arr = np.ascontiguousarray(array)
    return TensorData(dtype=arr.dtype.str, shape=list(arr.shape), data=arr.tobytes())


def from_tensor_data(tensor: TensorData) -> np.ndarray[Any, Any]:
    """A read-only numpy view over the tensor's bytes (no copy)."""
    return np.frombuffer(tensor.data, dtype=np.dtype(tensor.dtype)).reshape(tensor.shape)


@dataclass(slots=True)
class ProcessedPrompt:
    """The output of `process`: what goes into `EngineCoreRequest`.

    `features[i].data` is None where the sender cache let processing be
    skipped; `SenderCache.commit` (right before sending) decides what travels.
    `images[i]` is kept for that commit's rare re-processing.
    """

    token_ids: list[int]
    features: list[MultiModalFeatureSpec]
    images: list[Image.Image] = field(default_factory=list)
    num_processed: int = 0  # items the HF image processor ran on (cache misses)

    @property
    def num_image_tokens(self) -> int:
        return sum(f.mm_position.get_num_embeds() for f in self.features)


class Gemma3MultiModalProcessor:
    """Gemma3's prompt expansion and image processing, with content hashes and the P0 cache.

    `model_id` enters every hash (two models' processors differ); so do the
    processor kwargs this class passes (none beyond the defaults today).
    """

    modality = "image"

    def __init__(
        self, hf_processor: Gemma3ProcessorLike, model_id: str, cache: SenderCache | None = None
    ) -> None:
        self.hf_processor = hf_processor
        self.model_id = model_id
        self.cache = cache if cache is not None else SenderCache()
        tokenizer = hf_processor.tokenizer
        self.tokenizer: HFTokenizerLike = tokenizer
        self.boi_token: str = hf_processor.boi_token
        self.boi_token_id = _token_id(tokenizer, tokenizer.boi_token)
        self.eoi_token_id = _token_id(tokenizer, tokenizer.eoi_token)
        self.image_token_id = _token_id(tokenizer, tokenizer.image_token)
        self.mm_tokens_per_image = int(hf_processor.image_seq_length)
        self.full_image_sequence: str = hf_processor.full_image_sequence
        self._full_sequence_ids = list(
            tokenizer.encode(self.full_image_sequence, add_special_tokens=False)
        )

    @property
    def placeholder(self) -> str:
        """The text a prompt holds for each image (the chat template writes it)."""
        return self.boi_token

    @property
    def max_tokens_per_item(self) -> int:
        """Encoder embeddings of the largest item (the scheduler's encoder budget floor)."""
        return self.mm_tokens_per_image

    def hash_image(self, image: Image.Image) -> str:
        return MultiModalHasher.hash_kwargs(model_id=self.model_id, image=image)

    # -- prompt ------------------------------------------------------------------
    def expand_text(self, prompt: str, num_images: int) -> str:
        count = prompt.count(self.boi_token)
        if count != num_images:
            raise PromptError(_count_message(count, num_images, self.boi_token))
        return prompt.replace(self.boi_token, self.full_image_sequence)

    def expand_token_ids(self, token_ids: Sequence[int], num_images: int) -> list[int]:
        if self.image_token_id in token_ids:
            raise PromptError(
                "prompt_token_ids already hold expanded image tokens; give one "
                f"{self.boi_token} token id ({self.boi_token_id}) per image instead"
            )
        count = sum(1 for t in token_ids if t == self.boi_token_id)
        if count != num_images:
            raise PromptError(_count_message(count, num_images, self.boi_token))
        out: list[int] = []
        for t in token_ids:
            if t == self.boi_token_id:
                out.extend(self._full_sequence_ids)
            else:
                out.append(t)
        return out

    def placeholder_ranges(self, token_ids: Sequence[int]) -> list[PlaceholderRange]:
        """One range per image: boi, the soft tokens, eoi (see the module docstring)."""
        n = self.mm_tokens_per_image
        ranges: list[PlaceholderRange] = []
        i = 0
        while i < len(token_ids):
            if token_ids[i] != self.boi_token_id:
                i += 1
                continue
            span = token_ids[i : i + n + 2]
            if (
                len(span) != n + 2
                or span[-1] != self.eoi_token_id
                or any(t != self.image_token_id for t in span[1:-1])
            ):
                raise PromptError(
                    f"image placeholder at token {i} is not {self.boi_token} followed by "
                    f"{n} image tokens and the end-of-image token"
                )
            ranges.append(PlaceholderRange(i, n + 2, [False, *([True] * n), False]))
            i += n + 2
        return ranges

    # -- the whole step ------------------------------------------------------------
    def process(
        self,
        prompt: str | Sequence[int],
        images: Sequence[Image.Image],
        *,
        add_special_tokens: bool = True,
    ) -> ProcessedPrompt:
        """Token ids with expanded placeholders and one feature per image, in prompt order."""
        if isinstance(prompt, str):
            text = self.expand_text(prompt, len(images))
            token_ids = list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        else:
            token_ids = self.expand_token_ids(prompt, len(images))
        ranges = self.placeholder_ranges(token_ids)
        if len(ranges) != len(images):
            # The text itself spelled a boi token in a way the tokenizer split.
            raise PromptError(_count_message(len(ranges), len(images), self.boi_token))
        hashes = [self.hash_image(image) for image in images]
        data: list[ItemData | None] = []
        to_process: list[int] = []
        for i, mm_hash in enumerate(hashes):
            cached = self.cache.cached_data(mm_hash)
            if cached is None and not self.cache.is_cached(mm_hash) and mm_hash not in hashes[:i]:
                to_process.append(i)
            data.append(cached)
        processed = self._run_image_processor([images[i] for i in to_process])
        for i, item in zip(to_process, processed, strict=True):
            data[i] = item
        for i, mm_hash in enumerate(hashes):
            if data[i] is None and mm_hash in hashes[:i]:
                data[i] = data[hashes.index(mm_hash)]  # the same picture twice in one prompt
        features = [
            MultiModalFeatureSpec(modality=self.modality, identifier=h, mm_position=r, data=d)
            for h, r, d in zip(hashes, ranges, data, strict=True)
        ]
        return ProcessedPrompt(token_ids, features, list(images), len(to_process))

    def reprocess(self, images: Sequence[Image.Image], index: int) -> ItemData:
        """Tensors of `images[index]` alone (a commit-time miss)."""
        (item,) = self._run_image_processor([images[index]])
        return item

    def _run_image_processor(self, images: Sequence[Image.Image]) -> list[ItemData]:
        if not images:
            return []
        out = self.hf_processor.image_processor(list(images), return_tensors="np")
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)
        if pixels.shape[0] != len(images):
            raise RuntimeError(
                f"the image processor returned {pixels.shape[0]} images for {len(images)} "
                "(pan-and-scan crops are not supported)"
            )
        return [{"pixel_values": to_tensor_data(pixels[i : i + 1])} for i in range(len(images))]


def _token_id(tokenizer: Any, token: str | None) -> int:
    if token is None:
        raise ValueError("the tokenizer does not define the Gemma3 image special tokens")
    token_id = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(token_id, int):
        raise ValueError(f"the tokenizer has no id for {token!r}")
    return token_id


def _count_message(placeholders: int, images: int, token: str) -> str:
    if images == 0:
        return (
            f"the prompt holds {placeholders} image placeholder(s) ({token}) but no images "
            "were given"
        )
    return (
        f"the prompt holds {placeholders} image placeholder(s) ({token}) but {images} "
        "image(s) were given"
    )
