"""Embeddings from a GGUF decoder: llama.cpp's `{arch}.pooling_type` key makes the file a
pooling model with that pooling (as a sentence-transformers directory does), the user's
--pooler-config wins, a llama.cpp reranker (RANK) without its head is refused before
loading; the pooled vector equals transformers' on the same GGUF (fp32, 1e-5)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from benchmarks.random_gguf import SHAPES, write_random_gguf
from paged.runner.model_config import ModelConfig
from paged.runner.pooling import PoolerConfig

_SHAPE = replace(SHAPES["tiny-llama"], vocab=128)


def _tokenizer(path: Path, size: int = 128) -> Path:
    """A GGUF holding only a small BPE tokenizer (quick to parse)."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    # BPE needs every merge's parts and result in the vocabulary.
    w.add_token_list(["t", "1", "t1"] + [f"w{i}" for i in range(size - 3)])
    w.add_token_types([1] * size)
    w.add_token_merges(["t 1"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _gguf(tmp_path: Path, pooling: gguf.PoolingType | None, name: str = "m.gguf") -> Path:
    source = _tokenizer(tmp_path / f"tok-{name}")
    out = tmp_path / name.removesuffix(".gguf")
    out.mkdir()
    return write_random_gguf(out / name, _SHAPE, "F32", tokenizer=source, pooling_type=pooling)


def test_gguf_pooling_type_picks_the_runner_and_the_pooling(tmp_path: Path) -> None:
    mean = _gguf(tmp_path, gguf.PoolingType.MEAN, "mean.gguf")
    mc = ModelConfig.from_pretrained(str(mean), dtype="float32")
    assert (mc.runner_type, mc.convert_type) == ("pooling", "embed")
    assert mc.pooler_config is not None and mc.pooler_config.seq_pooling_type == "MEAN"
    assert mc.supported_tasks == ("embed", "token_embed")
    # --pooler-config wins over the file; --runner generate still generates.
    last = ModelConfig.from_pretrained(
        str(mean), dtype="float32", pooler_config=PoolerConfig(pooling_type="LAST")
    )
    assert last.pooler_config is not None and last.pooler_config.seq_pooling_type == "LAST"
    assert ModelConfig.from_pretrained(str(mean), runner="generate").runner_type == "generate"
    # No pooling_type (an LM's GGUF), or NONE: generative unless asked.
    plain = _gguf(tmp_path, None, "plain.gguf")
    assert ModelConfig.from_pretrained(str(plain)).runner_type == "generate"
    pooled = ModelConfig.from_pretrained(str(plain), runner="pooling", dtype="float32")
    assert pooled.pooler_config is not None and pooled.pooler_config.seq_pooling_type == "LAST"
    none = _gguf(tmp_path, gguf.PoolingType.NONE, "none.gguf")
    assert ModelConfig.from_pretrained(str(none)).runner_type == "generate"


def test_gguf_reranker_is_refused_before_loading(tmp_path: Path) -> None:
    rank = _gguf(tmp_path, gguf.PoolingType.RANK, "rank.gguf")
    # RANK without the cls.output head llama.cpp's converter writes (a file with it is a
    # reranker: tests/test_pooling_gguf_rank.py).
    with pytest.raises(ValueError, match=r"RANK\) without its classifier: it has no cls\.output"):
        ModelConfig.from_pretrained(str(rank), runner="pooling")


@pytest.mark.slow
def test_gguf_mean_embedding_matches_transformers(tmp_path: Path) -> None:
    from transformers import AutoModel

    from paged.server.input_processor import TokensPrompt
    from paged.server.llm import LLM

    path = _gguf(tmp_path, gguf.PoolingType.MEAN, "mean.gguf")
    prompts = [[1, 5, 9, 33, 70, 2], [1, 64, 3, 3, 17, 90, 101, 45, 8, 2, 11]]
    auto: Any = AutoModel
    model: Any = auto.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        want = [
            torch.nn.functional.normalize(
                model(input_ids=torch.tensor([ids])).last_hidden_state[0].mean(0), dim=-1
            )
            for ids in prompts
        ]
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=1 << 22, max_model_len=64)
    try:
        outs = llm.embed([TokensPrompt(prompt_token_ids=ids) for ids in prompts], use_tqdm=False)
    finally:
        llm.shutdown()
    for out, ref in zip(outs, want, strict=True):
        got = torch.tensor(out.outputs.embedding)
        assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()
