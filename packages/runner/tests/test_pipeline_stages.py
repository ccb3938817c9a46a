"""Pipeline stages in one process: chaining the stages' forwards equals the whole model.

No torch.distributed here: the stages are built side by side and the
`IntermediateTensors` handed over by hand, which isolates the partition of
the model (layers, embedding, final norm, tied and untied heads, weight
loading per stage) from the transport, tested with processes elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from paged.runner.attention.metadata import ForwardContext
from paged.runner.config import ModelConfig
from paged.runner.loader import load_model
from paged.runner.models.llama import LlamaForCausalLM
from paged.runner.pipeline.stage import PipelineStage, StageSetup
from paged.runner.pipeline.tensors import IntermediateTensors, PPMissingLayer


def _stage(mc: ModelConfig, pp_rank: int, pp_size: int, partition: str | None) -> LlamaForCausalLM:
    setup = StageSetup(PipelineStage(pp_rank, pp_size), pp_layer_partition=partition)
    model = load_model(mc, "cpu", stage_setup=setup)
    assert isinstance(model, LlamaForCausalLM)
    return model


@pytest.mark.parametrize(
    ("family", "pp", "partition"),
    [("llama", 2, None), ("llama_tied_scaled", 2, None), ("qwen3", 3, None), ("llama", 2, "4,1")],
)
def test_chained_stages_equal_the_whole_model(
    tiny_checkpoint: Callable[..., Path], family: str, pp: int, partition: str | None
) -> None:
    path = tiny_checkpoint(family, num_hidden_layers=5)
    mc = ModelConfig.from_pretrained(str(path), max_model_len=64, dtype="float32")
    whole = load_model(mc, "cpu")
    stages = [_stage(mc, r, pp, partition) for r in range(pp)]
    ids = torch.tensor([5, 9, 17, 3, 100, 7], dtype=torch.int64)
    positions = torch.arange(len(ids), dtype=torch.int64)
    ctx = ForwardContext(attn_metadata=None)  # dense causal attention, no cache
    want = whole.compute_logits(whole.forward(ids, positions, ctx))
    carried: IntermediateTensors | None = None
    for stage in stages[:-1]:
        out = stage.forward_stage(ids, positions, ctx, carried)
        assert isinstance(out, IntermediateTensors)
        carried = out
    last = stages[-1]
    hidden = last.forward_stage(ids, positions, ctx, carried)
    assert isinstance(hidden, torch.Tensor)
    torch.testing.assert_close(last.compute_logits(hidden), want, rtol=0, atol=1e-5)
    # Each stage holds only its layers; the head and norm only on the last.
    held = [sum(not isinstance(m, PPMissingLayer) for m in s.model.layers) for s in stages]
    assert sum(held) == 5
    assert isinstance(stages[0].lm_head, PPMissingLayer)
    assert isinstance(stages[0].model.norm, PPMissingLayer)
    assert len(stages[0].kv_cache_specs(4)) == held[0]
    names = [n for s in stages for n in s.kv_cache_specs(4)]
    assert names == list(whole.kv_cache_specs(4))
    with pytest.raises(RuntimeError, match="only the last pipeline stage"):
        stages[0].compute_logits(hidden)
    with pytest.raises(ValueError, match="needs the previous stage's output"):
        last.forward_stage(ids, positions, ctx, None)


def test_untied_first_stage_has_no_embedding_copy_elsewhere(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    path = tiny_checkpoint("llama", num_hidden_layers=3)  # untied head
    mc = ModelConfig.from_pretrained(str(path), max_model_len=64, dtype="float32")
    last = _stage(mc, 1, 2, None)
    assert isinstance(last.model.embed_tokens, PPMissingLayer)
    tied = ModelConfig.from_pretrained(
        str(tiny_checkpoint("llama_tied_scaled", num_hidden_layers=3)),
        max_model_len=64,
        dtype="float32",
    )
    assert not isinstance(_stage(tied, 1, 2, None).model.embed_tokens, PPMissingLayer)
