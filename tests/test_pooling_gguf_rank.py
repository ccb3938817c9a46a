"""Decoder rerankers as llama.cpp converts them (pooling_type RANK, the LM head's rows in
`cls.output`, a `tokenizer.chat_template.rerank` prompt): a *ForSequenceClassification
whose score head comes from `cls.output` (qwen3's "yes"/"no" pair: w[yes] - w[no], the
2-way softmax), pairs rendered through the file's rerank prompt; scores equal
transformers' hidden states on the same weights times that head (fp32, 1e-5)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from benchmarks.random_gguf import SHAPES, write_random_gguf
from paged.runner.loader.gguf_rank import read_gguf_rank_head
from paged.runner.model_config import ModelConfig
from tests.test_pooling_gguf import _tokenizer

ATOL = 1e-5
QWEN2 = replace(SHAPES["tiny-qwen2"], vocab=128)
QWEN3 = replace(QWEN2, arch="qwen3", qkv_bias=False)
PROMPT = 'Judge "yes" or {no}: <Query>: {query}\n<Document>: {document}\n'


def _rank_gguf(path: Path, shape: Any, rows: int, *, tiny_vocab: bool = True) -> tuple[Path, Any]:
    """A random `shape` GGUF with llama.cpp's reranker metadata and a `rows`-row cls.output
    (tiny_vocab: a 128-token tokenizer, quick to parse; else SmolLM2's)."""
    head = np.random.default_rng(3).normal(0.0, 0.2, (rows, shape.hidden)).astype(np.float32)
    write_random_gguf(
        path,
        shape,
        "F32",
        tokenizer=_tokenizer(path.with_suffix(".tok"), 128) if tiny_vocab else None,
        pooling_type=gguf.PoolingType.RANK,
        extra_tensors={"cls.output.weight": head},
        extra_strings={"tokenizer.chat_template.rerank": PROMPT},
    )
    return path, head


def test_decoder_rank_gguf_is_a_classifier_with_the_file_s_head(tmp_path: Path) -> None:
    path, head = _rank_gguf(tmp_path / "q2.gguf", QWEN2, rows=1)
    mc = ModelConfig.from_pretrained(str(path))
    assert (mc.architecture, mc.runner_type, mc.supported_tasks) == (
        "Qwen2ForSequenceClassification",
        "pooling",
        ("classify", "token_classify"),
    )
    assert mc.hf_config.num_labels == 1 and mc.hf_config.use_sep_token is False
    assert not mc.needs_lm_head
    assert torch.equal(read_gguf_rank_head(path)["score.weight"], torch.from_numpy(head))
    # qwen3's ["yes", "no"] rows: one label, w[yes] - w[no] (sigmoid = llama.cpp's softmax).
    path3, head3 = _rank_gguf(tmp_path / "q3.gguf", QWEN3, rows=2)
    mc3 = ModelConfig.from_pretrained(str(path3))
    assert (mc3.architecture, mc3.hf_config.num_labels) == ("Qwen3ForSequenceClassification", 1)
    w = read_gguf_rank_head(path3)["score.weight"]
    assert torch.allclose(w, torch.from_numpy(head3[[0]] - head3[[1]]))
    h = torch.randn(QWEN3.hidden)
    softmax_yes = torch.softmax(torch.from_numpy(head3) @ h, dim=0)[0]
    assert torch.allclose(torch.sigmoid(w @ h)[0], softmax_yes, atol=1e-6)


@pytest.mark.slow
def test_llm_score_on_a_decoder_rank_gguf_matches_transformers(tmp_path: Path) -> None:
    """Text in: the pair is rendered through the file's rerank prompt, tokenized with the
    file's tokenizer, the last token's state goes through cls.output, then sigmoid."""
    from transformers import AutoModel

    from paged.server.llm import LLM
    from paged.server.tokenizer import load_tokenizer

    shape = replace(QWEN2, vocab=None)  # SmolLM2's real BPE tokenizer: text tokenizes
    path, head = _rank_gguf(tmp_path / "rank.gguf", shape, rows=1, tiny_vocab=False)
    # The same seed and shape without the reranker's extras: the same weights, which
    # transformers loads (it does not know cls.output).
    (tmp_path / "plain").mkdir()
    plain = write_random_gguf(tmp_path / "plain" / "p.gguf", shape, "F32")
    auto: Any = AutoModel
    body: Any = auto.from_pretrained(str(plain.parent), gguf_file=plain.name, dtype=torch.float32)
    tok = load_tokenizer(path)
    query, docs = "capital of France?", ["Paris is the capital.", "Gravity pulls."]
    want = []
    for doc in docs:
        text = PROMPT.replace("{query}", query).replace("{document}", doc)
        ids = tok.encode(text, add_special_tokens=True)
        with torch.no_grad():
            last = body.eval()(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
        want.append(float(torch.sigmoid(torch.from_numpy(head[0]) @ last)))
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=1 << 22, max_model_len=256)
    try:
        got = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert got == pytest.approx(want, abs=ATOL)
