"""The model protocol the runner drives.

A model takes one step's flattened tokens (all requests concatenated, no
padding dimension) with their positions and a `ForwardContext`, and returns
hidden states; logits are computed separately and only for the rows that are
sampled, which saves the LM head on prefill tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from paged.kvcache import KVCacheSpec

if TYPE_CHECKING:
    from paged.runner.attention.metadata import ForwardContext
    from paged.runner.layers.linear import CheckpointTensor
    from paged.runner.model_config import ModelConfig
    from paged.runner.pipeline.tensors import IntermediateTensors


class CausalLM(Protocol):
    """A decoder-only language model.

    forward: input_ids [T] int64, positions [T] int64 -> hidden [T, H] in the
      model dtype. Writes this step's K/V into ctx.kv_caches (one tensor per
      attention layer, layout [2, num_blocks, block_size, Hkv, D]) at
      ctx.attn_metadata.slot_mapping before attending.
    compute_logits: hidden [N, H] -> logits [N, V] float32 (V = the true vocab
      size, padding from vocab-parallel sharding removed).
    kv_cache_specs: layer name -> KV cache spec, in layer order;
      ctx.kv_caches[i] belongs to the i-th entry.
    """

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor: ...

    def kv_cache_specs(self, block_size: int) -> dict[str, KVCacheSpec]: ...


class SupportsMultiModal(CausalLM, Protocol):
    """A CausalLM that also takes encoder inputs (images), vLLM's SupportsMultiModal.

    embed_multimodal: a batch of items of one modality (each a dict of its
      processed tensors, e.g. "pixel_values") -> one [num_embeds, H] tensor per
      item, in order; num_embeds = the item's PlaceholderRange.get_num_embeds().
    embed_input_ids: ids [T] -> inputs_embeds [T, H], with mm_embeds rows
      (in order) written where is_mm_embed [T] is true (masked_scatter).
    forward: as CausalLM, with inputs_embeds replacing the ids' embeddings.
    bidirectional_mm_attention: an item's embedded tokens attend to each other
      both ways (Gemma3); the runner then sets AttentionMetadata.bidirectional_ranges.
    """

    bidirectional_mm_attention: ClassVar[bool]

    def embed_multimodal(
        self, modality: str, items: Sequence[dict[str, torch.Tensor]]
    ) -> list[torch.Tensor]: ...

    def embed_input_ids(
        self,
        input_ids: torch.Tensor,
        mm_embeds: torch.Tensor | None = None,
        is_mm_embed: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


def supports_multimodal(model: object) -> bool:
    """Whether `model` implements SupportsMultiModal (checked by its methods)."""
    return callable(getattr(model, "embed_multimodal", None)) and callable(
        getattr(model, "embed_input_ids", None)
    )


class LoadableCausalLM(CausalLM, Protocol):
    """What the loader needs on top of CausalLM."""

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        """Copy HF-named full tensors in; return the parameter names now filled."""
        ...

    def expected_weights(self) -> set[str]:
        """Every parameter name the checkpoint must fill."""
        ...

    def eval(self) -> Any: ...

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]: ...


class CausalLMClass(Protocol):
    """A model class: built from the config for one tensor-parallel rank."""

    def __call__(
        self, model_config: ModelConfig, *, tp_rank: int = 0, tp_size: int = 1
    ) -> LoadableCausalLM: ...


class SupportsPipelineParallel(CausalLM, Protocol):
    """A CausalLM that can run as one pipeline stage (built with a `PipelineStage`).

    forward_stage: as forward, but a stage after the first takes the previous
    stage's `IntermediateTensors` (input_ids are then unused), and a stage
    before the last returns its `IntermediateTensors` instead of hidden [T, H].
    """

    def forward_stage(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        intermediate: IntermediateTensors | None,
    ) -> torch.Tensor | IntermediateTensors: ...
