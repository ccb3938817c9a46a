"""Gemma 3's image encoder alone (SigLIP + projector): what an EPD producer loads.

An encode-only instance (`paged serve --ec-role producer`) runs no language
model, so it builds only `model.vision_tower` and `model.multi_modal_projector`
under the checkpoint's own names and skips every other tensor of the
checkpoint: the language model's weights are never kept in memory. The
forward is the full model's (`gemma3_mm.encode_images`), so the producer's
embeddings are bit-identical to a colocated run's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from paged.runner.config import ModelConfig
from paged.runner.layers.linear import CheckpointTensor
from paged.runner.models.gemma3 import Gemma3ArchConfig
from paged.runner.models.gemma3_mm import (
    Gemma3MultiModalProjector,
    encode_images,
    normalize_name,
)
from paged.runner.models.siglip import SiglipVisionArchConfig, SiglipVisionModel
from paged.runner.models.weight_loading import load_named_weights

_KEPT_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.")


class _VisionParts(nn.Module):
    """The two encoder parts under the full model's names (model.vision_tower, ...)."""

    def __init__(self, vision: SiglipVisionModel, projector: Gemma3MultiModalProjector) -> None:
        super().__init__()
        self.vision_tower = vision
        self.multi_modal_projector = projector


class Gemma3VisionEncoder(nn.Module):
    """`Gemma3ForConditionalGeneration`'s image path only; satisfies `VisionEncoderModel`."""

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__()
        hf = model_config.hf_config
        text = Gemma3ArchConfig.from_hf(model_config.text_config)
        self.vision_config = SiglipVisionArchConfig.from_hf(hf.vision_config)
        self.tokens_per_image = int(hf.mm_tokens_per_image)
        # Rows of one image's output: the language model's width.
        self.output_hidden_size = text.hidden_size
        dtype = model_config.dtype
        self.model = _VisionParts(
            SiglipVisionModel(self.vision_config, dtype),
            Gemma3MultiModalProjector(
                self.vision_config, text.hidden_size, self.tokens_per_image, dtype
            ),
        )

    def embed_multimodal(
        self, modality: str, items: Sequence[dict[str, torch.Tensor]]
    ) -> list[torch.Tensor]:
        device = self.model.multi_modal_projector.mm_input_projection_weight.device
        return encode_images(
            self.model.vision_tower, self.model.multi_modal_projector, modality, items, device
        )

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        def encoder_only() -> Iterable[tuple[str, CheckpointTensor]]:
            for name, tensor in weights:
                name = normalize_name(name)
                if name.startswith("model.vision_tower.head."):
                    continue  # SigLIP's pooling head: unused by Gemma 3
                if name.startswith(_KEPT_PREFIXES):
                    yield name, tensor

        return load_named_weights(self, encoder_only(), skip=set())

    def expected_weights(self) -> set[str]:
        return {name for name, _ in self.named_parameters()}
