"""BERT-family GGUFs (llama.cpp's `bert` architecture): embedders and rerankers.

Tiny random BertModel / XLM-RoBERTa checkpoints are saved with transformers and
converted by benchmarks/bert_gguf.py (llama.cpp's converter layout, F32 and F16
tensors; 2-D weights are rounded to float16 first, so both files hold the
checkpoint exactly). paged's encoder, pooler and GGUF tokenizer must equal
transformers on the saved directory (fp32, 1e-5).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
import transformers

from benchmarks.bert_gguf import write_bert_gguf
from paged.runner.loader.gguf_config import open_gguf
from paged.runner.model_config import ModelConfig
from paged.runner.models.bert import load_bert_model
from paged.runner.pooling import PoolingInput
from paged.runner.pooling_setup import build_model_pooler
from paged.server.gguf_bert_tokenizer import build_bert_gguf_tokenizer
from tests.conftest import LiveServer

ATOL = 1e-5
WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "runs", "fast", "red", "big", "house"]
SENTENCES = ["The cat sat on a mat.", "dog", "big red house, fast dog!", "a cats running"]
PAIRS = [("where is the cat", "the cat sat on a mat"), ("dog", "a big red house")]
TINY: dict[str, Any] = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 48,
}


def _round_to_f16(model: Any) -> None:
    """2-D weights exactly representable in float16, so an F16 GGUF is the same model."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(p.half().float())


def _save(root: Path, model_cls: str, cfg: Any, tok: Any) -> Any:
    root.mkdir()
    tok.save_pretrained(root)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg).eval()
    _round_to_f16(model)
    model.save_pretrained(root)
    return model


def bert_dir(root: Path, model_cls: str = "BertModel") -> tuple[Path, Any, Any]:
    """A random BERT over a WordPiece vocabulary (continuation pieces included)."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, "##s", "##ing", ".", ",", "!"]
    tok = transformers.BertTokenizer(vocab={w: i for i, w in enumerate(vocab)})
    config_cls: Any = transformers.BertConfig  # num_labels is a PretrainedConfig kwarg
    cfg = config_cls(vocab_size=len(vocab), pad_token_id=0, num_labels=1, **TINY)
    return root, _save(root, model_cls, cfg, tok), tok


def xlmr_dir(root: Path, model_cls: str = "XLMRobertaModel") -> tuple[Path, Any, Any]:
    """A random XLM-RoBERTa over a Unigram vocabulary (positions start at pad + 1 = 2)."""
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [".", ",", "!"]
    pieces = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [("\u2581" + w, -1.0 - 0.1 * i) for i, w in enumerate(WORDS)]
    pieces += [("\u2581", -4.0)] + [(c, -5.0) for c in letters] + [("<mask>", 0.0)]
    tok = transformers.XLMRobertaTokenizer(vocab=pieces)
    config_cls: Any = transformers.XLMRobertaConfig
    cfg = config_cls(
        vocab_size=len(pieces), pad_token_id=1, type_vocab_size=1, num_labels=1, **TINY
    )
    return root, _save(root, model_cls, cfg, tok), tok


def _body(model: Any) -> Any:
    return getattr(model, "bert", None) or getattr(model, "roberta", None) or model


def _hidden(model: Any, ids: list[int], types: list[int] | None = None) -> torch.Tensor:
    with torch.no_grad():
        kwargs = {} if types is None else {"token_type_ids": torch.tensor([types])}
        out: torch.Tensor = _body(model)(input_ids=torch.tensor([ids]), **kwargs)[0][0]
    return out


@pytest.mark.parametrize("dtype", ["F32", "F16"])
@pytest.mark.parametrize("make", [bert_dir, xlmr_dir])
def test_gguf_encoder_and_tokenizer_match_transformers(
    tmp_path: Path, make: Any, dtype: str
) -> None:
    root, model, tok = make(tmp_path / "hf")
    path = write_bert_gguf(root, tmp_path / f"m-{dtype}.gguf", dtype=dtype)
    gguf_tok = build_bert_gguf_tokenizer(open_gguf(path))
    for text in SENTENCES:
        assert gguf_tok.encode(text) == tok.encode(text), text
    for q, d in PAIRS:
        ours, ref = gguf_tok(text=q, text_pair=d), tok(text=q, text_pair=d)
        assert ours["input_ids"] == ref["input_ids"]
        assert ours.get("token_type_ids", [0] * len(ref["input_ids"])) == ref.get(
            "token_type_ids", [0] * len(ref["input_ids"])
        )
    encoder = load_bert_model(path)
    prompts = [tok.encode(t) for t in SENTENCES]
    lens = [len(p) for p in prompts]
    with torch.no_grad():
        packed = torch.tensor([t for p in prompts for t in p])
        got = encoder(packed, None, lens).split(lens)
    for ids, ours_h in zip(prompts, got, strict=True):
        assert torch.allclose(ours_h, _hidden(model, ids), atol=ATOL)


def test_gguf_pooling_type_and_rank_head_resolve_from_the_file(tmp_path: Path) -> None:
    root, _, _ = bert_dir(tmp_path / "hf")
    mean = write_bert_gguf(root, tmp_path / "mean.gguf", pooling_type=gguf.PoolingType.MEAN)
    mc = ModelConfig.from_pretrained(str(mean))
    assert (mc.architecture, mc.runner_type, mc.supported_tasks) == (
        "BertModel",
        "pooling",
        ("embed", "token_embed"),
    )
    assert mc.is_encoder_only and mc.pooler_config is not None
    assert mc.pooler_config.seq_pooling_type == "MEAN"
    plain = ModelConfig.from_pretrained(str(write_bert_gguf(root, tmp_path / "plain.gguf")))
    assert plain.pooler_config is not None and plain.pooler_config.seq_pooling_type == "CLS"
    xroot, _, _ = xlmr_dir(tmp_path / "hf-rank", "XLMRobertaForSequenceClassification")
    rank = ModelConfig.from_pretrained(str(write_bert_gguf(xroot, tmp_path / "rank.gguf")))
    assert (rank.architecture, rank.supported_tasks) == (
        "BertForSequenceClassification",
        ("classify", "token_classify"),
    )
    assert (
        rank.hf_config.num_labels == 1 and rank.max_model_len == TINY["max_position_embeddings"] - 2
    )


def test_encoder_gets_its_virtual_kv_cache_not_the_cpu_default_budget(tmp_path: Path) -> None:
    """Before: the CPU default KV budget (a quarter of memory) became ~45M virtual blocks
    for a BERT server (a minute of start-up); the encoder's runner sizes its own."""
    from paged.server.engine_args import EngineArgs

    root, _, _ = bert_dir(tmp_path / "hf")
    path = str(write_bert_gguf(root, tmp_path / "e.gguf"))
    assert EngineArgs(model=path).create_engine_config().cache_config.kv_cache_memory_bytes is None
    asked = EngineArgs(model=path, kv_cache_memory_bytes=1 << 20).create_engine_config()
    assert asked.cache_config.kv_cache_memory_bytes == 1 << 20


@pytest.mark.parametrize("keep_pooler", [False, True])
def test_gguf_bert_rank_head_is_llama_cpp_s(tmp_path: Path, keep_pooler: bool) -> None:
    """llama.cpp's converter drops BERT's pooler.dense: the score is sigmoid(cls.output(CLS));
    with the pooler kept as `cls`, tanh(cls(.)) first, which is transformers' BERT head."""
    root, model, tok = bert_dir(tmp_path / "hf", "BertForSequenceClassification")
    path = write_bert_gguf(root, tmp_path / "r.gguf", keep_bert_pooler=keep_pooler)
    mc = ModelConfig.from_pretrained(str(path))
    encoder, pooler = load_bert_model(mc.model), build_model_pooler(mc)
    for q, d in PAIRS:
        enc = tok(text=q, text_pair=d)
        ids, types = enc["input_ids"], enc["token_type_ids"]
        with torch.no_grad():
            hidden = encoder(torch.tensor(ids), None, [len(ids)], torch.tensor(types))
        got = pooler([PoolingInput(hidden, ids, "classify")])[0]
        cls_state = _hidden(model, ids, types)[0]
        with torch.no_grad():
            if keep_pooler:
                logits = model(input_ids=torch.tensor([ids]), token_type_ids=torch.tensor([types]))
                want = torch.sigmoid(logits.logits[0])
            else:
                want = torch.sigmoid(model.classifier(cls_state))
        assert torch.allclose(got, want, atol=ATOL), (got, want)


def _mean_embedding(model: Any, ids: list[int]) -> list[float]:
    vec = torch.nn.functional.normalize(_hidden(model, ids).mean(0), dim=-1)
    return [float(x) for x in vec]


@pytest.mark.slow
def test_llm_embed_and_score_on_bert_ggufs(tmp_path: Path) -> None:
    """LLM.embed on an F16 MEAN embedder, LLM.score on an XLM-R reranker (bge-reranker-v2-m3's
    layout) and on a BERT cross-encoder with its pooler kept (token types through the engine):
    text in, the GGUF's own tokenizer, equal to transformers on the directory."""
    from paged.server.llm import LLM

    root, model, tok = bert_dir(tmp_path / "hf")
    path = write_bert_gguf(
        root, tmp_path / "e.gguf", dtype="F16", pooling_type=gguf.PoolingType.MEAN
    )
    llm = LLM(str(path), kv_cache_memory_bytes=1 << 22)
    try:
        outs = llm.embed(SENTENCES, use_tqdm=False)
    finally:
        llm.shutdown()
    for out, text in zip(outs, SENTENCES, strict=True):
        assert out.outputs.embedding == pytest.approx(
            _mean_embedding(model, tok.encode(text)), abs=ATOL
        )

    query, docs = "where is the cat", ["the cat sat on a mat", "a big red house", "dog runs"]
    for make, name, keep in (
        (xlmr_dir, "XLMRobertaForSequenceClassification", False),
        (bert_dir, "BertForSequenceClassification", True),
    ):
        root, model, tok = make(tmp_path / name, name)
        path = write_bert_gguf(root, tmp_path / f"{name}.gguf", dtype="F16", keep_bert_pooler=keep)
        with torch.no_grad():
            want = [
                float(torch.sigmoid(model(**tok(query, d, return_tensors="pt")).logits[0, 0]))
                for d in docs
            ]
        llm = LLM(str(path), kv_cache_memory_bytes=1 << 22)
        try:
            got = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
        finally:
            llm.shutdown()
        assert got == pytest.approx(want, abs=ATOL), name


@pytest.mark.slow
def test_serve_bert_gguf_openai_embeddings(
    tmp_path: Path, launch_server: Callable[..., LiveServer]
) -> None:
    import openai

    root, model, tok = bert_dir(tmp_path / "hf")
    path = write_bert_gguf(root, tmp_path / "e.gguf", pooling_type=gguf.PoolingType.MEAN)
    server = launch_server(str(path), "--served-model-name", "bert-gguf")
    client = openai.OpenAI(api_key="x", base_url=f"{server.base_url}/v1", max_retries=0)
    res = client.embeddings.create(model="bert-gguf", input=SENTENCES, encoding_format="float")
    for row, text in zip(res.data, SENTENCES, strict=True):
        assert row.embedding == pytest.approx(_mean_embedding(model, tok.encode(text)), abs=ATOL)
    assert res.usage.prompt_tokens == sum(len(tok.encode(t)) for t in SENTENCES)
