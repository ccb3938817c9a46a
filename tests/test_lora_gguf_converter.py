"""llama.cpp's own convert_lora_to_gguf.py output reads back as the PEFT adapter it came from.

Needs llama.cpp's sources (benchmarks/build_llamacpp.sh puts them in
/work/llamacpp-build/src/vendor/llama.cpp; LLAMA_CPP_DIR overrides): the
converter imports its own `conversion` package and gguf-py from there. Without
them the test is skipped; packages/runner/tests/test_lora_gguf_adapter.py checks
the same layout with a writer of its own either way.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import cast

import pytest
import torch
from safetensors.torch import load_file

from paged.runner.lora.gguf_adapter import is_gguf_file, load_gguf_lora

_LLAMA_CPP = Path(os.environ.get("LLAMA_CPP_DIR", "/work/llamacpp-build/src/vendor/llama.cpp"))
_CONVERTER = _LLAMA_CPP / "convert_lora_to_gguf.py"
_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft_adapter(tmp: Path) -> tuple[Path, Path, float]:
    """A tiny random Llama and a random PEFT adapter on it (B != 0); returns dirs and scaling."""
    import peft
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp / "base")
    lora = peft.LoraConfig(r=8, lora_alpha=32, target_modules=_TARGETS, init_lora_weights=False)
    peft_model = peft.get_peft_model(model, lora)
    peft_model.save_pretrained(str(tmp / "adapter"))
    q_proj = dict(peft_model.named_modules())["base_model.model.model.layers.0.self_attn.q_proj"]
    scaling = cast(dict[str, float], q_proj.scaling)["default"]  # PEFT's own alpha / r
    return tmp / "base", tmp / "adapter", float(scaling)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::FutureWarning")  # peft calls a deprecated transformers API
@pytest.mark.skipif(not _CONVERTER.is_file(), reason=f"llama.cpp sources not at {_LLAMA_CPP}")
def test_converter_output_round_trips_to_peft_weights(tmp_path: Path) -> None:
    base, adapter, scaling = _peft_adapter(tmp_path)
    out = tmp_path / "adapter.gguf"
    subprocess.run(
        [sys.executable, str(_CONVERTER), "--base", str(base), "--outtype", "f32",
         "--outfile", str(out), str(adapter)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    assert is_gguf_file(str(out))
    loaded = load_gguf_lora(str(out), num_heads=4, num_kv_heads=2, model_type="llama")
    assert loaded.rank == 8 and loaded.scaling == scaling == 4.0
    state = load_file(str(adapter / "adapter_model.safetensors"))
    expected = {
        key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        for key in state
        if key.endswith(".lora_A.weight")
    }
    assert set(loaded.modules) == expected and len(expected) == 2 * len(_TARGETS)
    for module, weights in loaded.modules.items():
        prefix = f"base_model.model.{module}"
        assert torch.equal(weights.lora_a, state[f"{prefix}.lora_A.weight"]), module
        # Q/K: the converter permuted B's rows; the loader must have undone it.
        assert torch.equal(weights.lora_b, state[f"{prefix}.lora_B.weight"]), module
