"""GGUF loading: name mapping, Q/K un-permutation, bad files, and the default SmolLM2 model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from paged.runner.config import ModelConfig, default_model_path
from paged.runner.loader import load_model
from paged.runner.loader.gguf_weights import gguf_to_hf_name, unpermute_qk


def test_gguf_names_map_to_hf() -> None:
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("output_norm.weight") == "model.norm.weight"
    assert gguf_to_hf_name("blk.7.attn_q.bias") == "model.layers.7.self_attn.q_proj.bias"
    assert gguf_to_hf_name("blk.0.attn_k_norm.weight") == "model.layers.0.self_attn.k_norm.weight"
    assert gguf_to_hf_name("blk.12.ffn_down.weight") == "model.layers.12.mlp.down_proj.weight"
    assert gguf_to_hf_name("blk.3.ffn_norm.weight") == (
        "model.layers.3.post_attention_layernorm.weight"
    )
    with pytest.raises(ValueError, match="rope_freqs"):
        gguf_to_hf_name("rope_freqs.weight")
    with pytest.raises(ValueError, match="no known Hugging Face equivalent"):
        gguf_to_hf_name("blk.0.ssm_conv1d.weight")


def _llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # What llama.cpp's convert_hf_to_gguf.py does to Q/K rows.
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@pytest.mark.parametrize("n_head", [1, 3, 4])
def test_unpermute_inverts_llama_cpp_permutation(n_head: int) -> None:
    w = torch.randn(n_head * 8, 5)
    permuted = _llama_cpp_permute(w, n_head)
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_qk(permuted, n_head), w)
    with pytest.raises(ValueError, match="cannot hold"):
        unpermute_qk(torch.randn(6, 2), 4)


def test_truncated_gguf_fails_cleanly(tmp_path: Path) -> None:
    data = default_model_path().read_bytes()
    bad = tmp_path / "half.gguf"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"half\.gguf"):
        load_model(ModelConfig.from_pretrained(str(bad)), "cpu")


# Token ids of SmolLM2's chat template around "What is the capital of France?",
# from the GGUF's own tokenizer.
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018,
          411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2,
          198, 1, 520, 9531, 198]  # fmt: skip


def _hf_from_gguf(model_config: ModelConfig) -> Any:
    """transformers' own GGUF path: its config parser, tensor mapping and dequantisation.

    AutoModelForCausalLM.from_pretrained(gguf_file=...) additionally requires
    `accelerate` (not a dependency here), so the same steps are called directly.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, modeling_gguf_pytorch_utils

    gguf_utils: Any = modeling_gguf_pytorch_utils  # untyped module

    config = AutoConfig.from_pretrained(model_config.tokenizer, gguf_file=model_config.gguf_file)
    auto: Any = AutoModelForCausalLM
    hf = auto.from_config(config, dtype=torch.float32)
    state = gguf_utils.load_gguf_checkpoint(
        str(model_config.weights_path), return_tensors=True, model_to_load=hf
    )
    result = hf.load_state_dict(state["tensors"], strict=False)
    assert result.missing_keys == ["lm_head.weight"]  # tied to the embedding
    hf.tie_weights()
    return hf.eval()


@pytest.mark.slow
def test_default_smollm2_matches_transformers_gguf(
    make_driver: Callable[..., Any], hf_logits: Callable[[Any, list[int]], torch.Tensor]
) -> None:
    # float32: the dequantised reference path, compared with transformers' fp32 forward.
    model_config = ModelConfig.from_pretrained(None, dtype="float32")
    model = load_model(model_config, "cpu")
    hf = _hf_from_gguf(model_config)
    driver = make_driver(model, num_blocks=16, block_size=16, seed=5)
    driver.add("q", PROMPT)
    ours: list[int] = []
    logits = driver.step([("q", len(PROMPT))])
    tokens = list(PROMPT)
    for _ in range(4):
        ref = hf_logits(hf, tokens)
        np.testing.assert_allclose(logits[0].numpy(), ref.numpy(), atol=2e-3, rtol=0)
        token = int(logits[0].argmax())
        assert token == int(ref.argmax())
        ours.append(token)
        tokens.append(token)
        driver.tokens["q"].append(token)
        logits = driver.step([("q", 1)])
    assert ours[0] == 504  # "The", as in "The capital of France is Paris."
