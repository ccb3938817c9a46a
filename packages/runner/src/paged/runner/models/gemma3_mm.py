"""Gemma 3 with images (`Gemma3ForConditionalGeneration`): SigLIP + projector + Gemma 3 text.

    pixel_values [N, 3, S, S] -> SiglipVisionModel -> [N, P, Hv]
      -> Gemma3MultiModalProjector: average-pool the sqrt(P) x sqrt(P) patch grid to
         sqrt(mm_tokens_per_image) per side, GemmaRMSNorm, @ mm_input_projection_weight
      -> [N, mm_tokens_per_image, H]  (one row per image soft token)
    embed_input_ids: text embeddings (scaled by sqrt(H)), then masked_scatter of the
      image rows into the positions marked is_mm_embed (image rows are not scaled)

Attention: the soft tokens of one image attend to each other both ways, text
stays causal (the runner passes the spans as AttentionMetadata.bidirectional_ranges);
`bidirectional_mm_attention` tells the runner and the scheduler (which must
then never split an image across steps: disable_chunked_mm_input).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from paged.kvcache import KVCacheSpec
from paged.runner.attention.layer import Attention
from paged.runner.attention.metadata import ForwardContext
from paged.runner.config import ModelConfig
from paged.runner.layers.layernorm import GemmaRMSNorm
from paged.runner.layers.linear import CheckpointTensor
from paged.runner.layers.parallel import TPGroup
from paged.runner.layers.vocab_embedding import ParallelLMHead
from paged.runner.models.gemma3 import (
    Gemma3ArchConfig,
    Gemma3TextModel,
    attention_specs,
    soft_capped_logits,
)
from paged.runner.models.siglip import SiglipVisionArchConfig, SiglipVisionModel
from paged.runner.models.weight_loading import load_named_weights

# Checkpoints name the parts in several layouts (Google's releases and
# transformers' save_pretrained nest them differently from its module tree);
# the first matching prefix wins.
_RENAMES: list[tuple[str, str]] = [
    ("language_model.model.", "model.language_model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.vision_model.", "model.vision_tower."),
    ("vision_tower.vision_model.", "model.vision_tower."),
    ("vision_tower.", "model.vision_tower."),
    ("multi_modal_projector.", "model.multi_modal_projector."),
]


def normalize_name(name: str) -> str:
    """A Gemma3ForConditionalGeneration tensor name in transformers' current layout."""
    for old, new in _RENAMES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


class Gemma3MultiModalProjector(nn.Module):
    def __init__(
        self, vision: SiglipVisionArchConfig, text_hidden: int, tokens_per_image: int,
        dtype: torch.dtype,
    ) -> None:  # fmt: skip
        super().__init__()
        side = round(tokens_per_image**0.5)
        if side * side != tokens_per_image or vision.patches_per_side % side:
            raise ValueError(
                f"mm_tokens_per_image: {tokens_per_image} is not a square dividing the "
                f"{vision.patches_per_side}x{vision.patches_per_side} patch grid"
            )
        self.patches_per_side = vision.patches_per_side
        self.kernel = vision.patches_per_side // side
        self.mm_soft_emb_norm = GemmaRMSNorm(vision.hidden_size, vision.layer_norm_eps, dtype=dtype)
        self.mm_input_projection_weight = nn.Parameter(
            torch.empty(vision.hidden_size, text_hidden, dtype=dtype), requires_grad=False
        )

    def forward(self, vision_outputs: torch.Tensor) -> torch.Tensor:
        n, _, hidden = vision_outputs.shape
        grid = vision_outputs.transpose(1, 2).reshape(
            n, hidden, self.patches_per_side, self.patches_per_side
        )
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        normed = self.mm_soft_emb_norm(pooled.reshape(-1, hidden)).view(pooled.shape)
        out: torch.Tensor = torch.matmul(normed, self.mm_input_projection_weight)
        return out.type_as(vision_outputs)


def encode_images(
    vision_tower: SiglipVisionModel,
    projector: Gemma3MultiModalProjector,
    modality: str,
    items: Sequence[dict[str, torch.Tensor]],
    device: torch.device,
) -> list[torch.Tensor]:
    """SigLIP + projector over a batch of images: one [mm_tokens_per_image, H] per item.

    Shared by the full model and the encoder-only one (`gemma3_vision.py`), so
    an EPD producer computes exactly the colocated model's embeddings.
    """
    if modality != "image":
        raise ValueError(f"modality: Gemma3 takes images only, got {modality!r}")
    pixels = []
    for i, item in enumerate(items):
        if "pixel_values" not in item:
            raise ValueError(f"items[{i}]: no pixel_values (keys: {sorted(item)})")
        p = item["pixel_values"]
        if p.dim() == 4 and p.shape[0] == 1:
            p = p[0]
        if p.dim() != 3:
            raise ValueError(
                f"items[{i}].pixel_values: expected one image [3, S, S] or [1, 3, S, S], "
                f"got {list(p.shape)} (pan-and-scan crops are not supported)"
            )
        pixels.append(p)
    batch = torch.stack(pixels).to(device)
    features = projector(vision_tower(batch))
    return list(features.unbind(0))


class _Gemma3Parts(nn.Module):
    """Holds the three parts under HF's names (model.vision_tower, ...)."""

    def __init__(
        self, vision: SiglipVisionModel, projector: Gemma3MultiModalProjector,
        language_model: Gemma3TextModel,
    ) -> None:  # fmt: skip
        super().__init__()
        self.vision_tower = vision
        self.multi_modal_projector = projector
        self.language_model = language_model


class Gemma3ForConditionalGeneration(nn.Module):
    """Gemma 3 vision-language model: `CausalLM` plus `SupportsMultiModal`."""

    bidirectional_mm_attention: ClassVar[bool] = True

    def __init__(self, model_config: ModelConfig, *, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        hf = model_config.hf_config
        if tp_size != 1:
            raise ValueError(
                "tensor_parallel_size: Gemma3ForConditionalGeneration runs at TP=1 only "
                "(the vision tower is not sharded)"
            )
        self.model_config = model_config
        self.config = Gemma3ArchConfig.from_hf(model_config.text_config)
        self.vision_config = SiglipVisionArchConfig.from_hf(hf.vision_config)
        self.tokens_per_image = int(hf.mm_tokens_per_image)
        self.image_token_id = int(hf.image_token_id)
        self.tp = TPGroup(tp_rank, tp_size)
        dtype = model_config.dtype
        self.model = _Gemma3Parts(
            SiglipVisionModel(self.vision_config, dtype),
            Gemma3MultiModalProjector(
                self.vision_config, self.config.hidden_size, self.tokens_per_image, dtype
            ),
            Gemma3TextModel(self.config, self.tp, model_config, "model.language_model"),
        )
        self.lm_head = ParallelLMHead(
            self.config.vocab_size, self.config.hidden_size, tp=self.tp, dtype=dtype
        )
        self.lm_head.tie_to(self.model.language_model.embed_tokens)

    # ------------------------------------------------------------ multimodal

    def embed_multimodal(
        self, modality: str, items: Sequence[dict[str, torch.Tensor]]
    ) -> list[torch.Tensor]:
        """Encode a batch of items of one modality in one vision forward.

        Each item's `pixel_values` is [3, S, S] or [1, 3, S, S] (no pan-and-scan
        crops); returns one [mm_tokens_per_image, H] tensor per item.
        """
        return encode_images(
            self.model.vision_tower,
            self.model.multi_modal_projector,
            modality,
            items,
            self.lm_head.weight.device,
        )

    def embed_input_ids(
        self,
        input_ids: torch.Tensor,
        mm_embeds: torch.Tensor | None = None,
        is_mm_embed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Text embeddings with `mm_embeds` rows scattered (in order) where is_mm_embed."""
        # The image token may lie outside the text vocabulary (tiny checkpoints);
        # its embedding is overwritten anyway, so look up id 0 instead, as HF does.
        ids = torch.where(input_ids >= self.config.vocab_size, 0, input_ids)
        embeds = self.model.language_model.embed_input_ids(ids)
        if mm_embeds is None or is_mm_embed is None:
            return embeds
        if int(is_mm_embed.sum()) != mm_embeds.shape[0]:
            raise ValueError(
                f"mm_embeds: {mm_embeds.shape[0]} rows for {int(is_mm_embed.sum())} "
                "placeholder positions"
            )
        return embeds.masked_scatter(is_mm_embed[:, None], mm_embeds.to(embeds.dtype))

    # ------------------------------------------------------------- CausalLM

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        hidden: torch.Tensor = self.model.language_model(
            input_ids, positions, ctx, inputs_embeds=inputs_embeds
        )
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return soft_capped_logits(self.lm_head, hidden_states, self.config.final_logit_softcapping)

    def attention_layers(self) -> list[Attention]:
        return [m for m in self.model.language_model.modules() if isinstance(m, Attention)]

    def kv_cache_specs(self, block_size: int) -> dict[str, KVCacheSpec]:
        return attention_specs(self.attention_layers(), block_size, self.model_config.dtype_name)

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        def renamed() -> Iterable[tuple[str, CheckpointTensor]]:
            for name, tensor in weights:
                name = normalize_name(name)
                if name.startswith("model.vision_tower.head."):
                    continue  # SigLIP's pooling head: unused by Gemma 3
                yield name, tensor

        return load_named_weights(self, renamed(), skip={"lm_head.weight"})

    def expected_weights(self) -> set[str]:
        return {name for name, _ in self.named_parameters()}
