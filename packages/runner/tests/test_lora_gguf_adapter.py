"""GGUF LoRA adapters: written here in convert_lora_to_gguf.py's layout, read back as PEFT weights.

The writer below mirrors llama.cpp's converter (convert_lora_to_gguf.py): metadata
general.type/adapter.type/adapter.lora.alpha, tensors "<base>.weight.lora_a|b" in
PEFT orientation, and for "llama" files lora_b of Q/K permuted like the base
converter's LlamaModel.permute. The real converter is exercised in
tests/test_lora_gguf_converter.py when llama.cpp's sources are present.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from paged.runner.lora.gguf_adapter import is_gguf_file, load_gguf_lora
from paged.runner.lora.weights import LoRAAdapterWeights

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER = 4, 2, 8, 32, 48
_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}  # fmt: skip
_SHAPES = {  # (in, out)
    "self_attn.q_proj": (HIDDEN, HEADS * HEAD_DIM),
    "self_attn.k_proj": (HIDDEN, KV_HEADS * HEAD_DIM),
    "self_attn.v_proj": (HIDDEN, KV_HEADS * HEAD_DIM),
    "self_attn.o_proj": (HEADS * HEAD_DIM, HIDDEN),
    "mlp.gate_proj": (HIDDEN, INTER),
    "mlp.up_proj": (HIDDEN, INTER),
    "mlp.down_proj": (INTER, HIDDEN),
}

Pairs = dict[str, tuple[torch.Tensor, torch.Tensor]]


def _llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # llama.cpp's LlamaModel.permute, applied by the LoRA converter to B's rows.
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _random_adapter(rank: int, layers: int = 2, seed: int = 0) -> Pairs:
    gen = torch.Generator().manual_seed(seed)
    pairs: Pairs = {}
    for layer in range(layers):
        for module, (n_in, n_out) in _SHAPES.items():
            a = torch.randn(rank, n_in, generator=gen)
            b = torch.randn(n_out, rank, generator=gen)
            pairs[f"model.layers.{layer}.{module}"] = (a, b)
    return pairs


def _write(
    path: Path,
    pairs: Pairs,
    *,
    arch: str = "llama",
    alpha: float | None = 16.0,
    general_type: str = "adapter",
    adapter_type: str = "lora",
    extra: dict[str, np.ndarray] | None = None,
    dtype: type = np.float32,
) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type(general_type)
    writer.add_string(gguf.Keys.Adapter.TYPE, adapter_type)
    if alpha is not None:
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for hf, (a, b) in pairs.items():
        layer, module = hf.split(".")[2], ".".join(hf.split(".")[3:])
        if arch == "llama" and module == "self_attn.q_proj":
            b = _llama_cpp_permute(b, HEADS)
        elif arch == "llama" and module == "self_attn.k_proj":
            b = _llama_cpp_permute(b, KV_HEADS)
        base = f"blk.{layer}.{_GGUF_NAMES[module]}.weight"
        writer.add_tensor(base + ".lora_a", a.numpy().astype(dtype))
        writer.add_tensor(base + ".lora_b", b.contiguous().numpy().astype(dtype))
    for name, array in (extra or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _load(path: Path, model_type: str | None = "llama") -> LoRAAdapterWeights:
    return load_gguf_lora(str(path), num_heads=HEADS, num_kv_heads=KV_HEADS, model_type=model_type)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_round_trip_equals_peft_weights(tmp_path: Path, arch: str) -> None:
    pairs = _random_adapter(rank=4)
    path = _write(tmp_path / "a.gguf", pairs, arch=arch, alpha=8.0)
    assert is_gguf_file(str(path)) and not is_gguf_file(str(tmp_path))
    adapter = load_gguf_lora(str(path), num_heads=HEADS, num_kv_heads=KV_HEADS)
    assert adapter.rank == 4 and adapter.scaling == 2.0  # alpha / r, as llama.cpp and PEFT
    assert set(adapter.modules) == set(pairs)
    for name, (a, b) in pairs.items():
        got = adapter.modules[name]
        assert got.lora_a.dtype == torch.float32 and got.lora_b.dtype == torch.float32
        assert torch.equal(got.lora_a, a), name
        assert torch.equal(got.lora_b, b), name  # Q/K permutation undone for llama


def test_float16_tensors_and_missing_alpha(tmp_path: Path) -> None:
    pairs = _random_adapter(rank=2, layers=1)
    path = _write(tmp_path / "f16.gguf", pairs, alpha=None, dtype=np.float16)
    adapter = _load(path)
    assert adapter.scaling == 1.0  # llama.cpp: no alpha -> scale 1
    a, b = pairs["model.layers.0.self_attn.k_proj"]
    got = adapter.modules["model.layers.0.self_attn.k_proj"]
    assert torch.equal(got.lora_a, a.half().float())
    assert torch.equal(got.lora_b, b.half().float())


def test_mixed_ranks_fold_their_own_scale_into_b(tmp_path: Path) -> None:
    pairs = _random_adapter(rank=8, layers=1)
    small = _random_adapter(rank=2, layers=1, seed=1)
    pairs["model.layers.0.mlp.up_proj"] = small["model.layers.0.mlp.up_proj"]
    adapter = load_gguf_lora(
        str(_write(tmp_path / "m.gguf", pairs, alpha=16.0)), num_heads=HEADS, num_kv_heads=KV_HEADS
    )
    assert adapter.rank == 8 and adapter.scaling == 2.0
    a, b = pairs["model.layers.0.mlp.up_proj"]
    got = adapter.modules["model.layers.0.mlp.up_proj"]
    # llama.cpp scales this pair by alpha / 2 = 8: the effective delta must be the same.
    torch.testing.assert_close(adapter.scaling * got.lora_b @ got.lora_a, 8.0 * b @ a)


def test_bad_files_raise_value_errors_naming_the_cause(tmp_path: Path) -> None:
    pairs = _random_adapter(rank=2, layers=1)
    with pytest.raises(ValueError, match="does not exist"):
        _load(tmp_path / "none.gguf")
    good = _write(tmp_path / "good.gguf", pairs).read_bytes()
    (tmp_path / "cut.gguf").write_bytes(good[: len(good) // 2])
    with pytest.raises(ValueError, match=r"cut\.gguf.*(truncated|corrupt)"):
        _load(tmp_path / "cut.gguf")
    with pytest.raises(ValueError, match=r"general\.type is 'model'"):
        _load(_write(tmp_path / "m.gguf", pairs, general_type="model"))
    with pytest.raises(ValueError, match=r"adapter\.type 'cvec'"):
        _load(_write(tmp_path / "c.gguf", pairs, adapter_type="cvec"))
    with pytest.raises(
        ValueError, match="converted for a 'gemma3' model, the base model is 'llama'"
    ):
        _load(_write(tmp_path / "g.gguf", pairs, arch="gemma3"))
    with pytest.raises(ValueError, match="architecture 'falcon'"):
        _load(_write(tmp_path / "f.gguf", pairs, arch="falcon"))
    embd = {"token_embd.weight.lora_a": np.zeros((2, 8), np.float32),
            "token_embd.weight.lora_b": np.zeros((16, 2), np.float32)}  # fmt: skip
    with pytest.raises(
        ValueError, match=r"adapts 'token_embd\.weight', which is not a LoRA target"
    ):
        _load(_write(tmp_path / "e.gguf", pairs, extra=embd))
    half = {"blk.0.attn_q.weight.lora_a": np.zeros((2, HIDDEN), np.float32)}
    with pytest.raises(ValueError, match=r"lacks blk\.0\.attn_q\.weight\.lora_b"):
        _load(_write(tmp_path / "h.gguf", {}, extra=half))
    with pytest.raises(ValueError, match=r"holds tensor 'blk\.0\.attn_q\.bias', neither"):
        _load(
            _write(tmp_path / "b.gguf", pairs, extra={"blk.0.attn_q.bias": np.zeros(4, np.float32)})
        )
    with pytest.raises(ValueError, match="holds no LoRA tensors"):
        _load(_write(tmp_path / "empty.gguf", {}))
    with pytest.raises(
        ValueError, match=r"attn_k\.weight\.lora_b \(16, 2\) does not fit the base model's 3 heads"
    ):
        load_gguf_lora(str(tmp_path / "good.gguf"), num_heads=4, num_kv_heads=3)


def test_norm_tensors_are_skipped_as_llama_cpp_does(tmp_path: Path) -> None:
    pairs = _random_adapter(rank=2, layers=1)
    norm = {"blk.0.attn_norm.weight": np.ones(HIDDEN, np.float32)}
    adapter = _load(_write(tmp_path / "n.gguf", pairs, extra=norm))
    assert set(adapter.modules) == set(pairs)


def test_activated_lora_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "alora.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_type("adapter")
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_array(gguf.Keys.Adapter.ALORA_INVOCATION_TOKENS, [1, 2])
    writer.add_tensor("blk.0.attn_q.weight.lora_a", np.zeros((2, HIDDEN), np.float32))
    writer.add_tensor("blk.0.attn_q.weight.lora_b", np.zeros((HIDDEN, 2), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="activated LoRA"):
        _load(path)
