"""End to end: `paged serve` on a tiny random sentence-transformers BERT (built here,
no download) answers the openai client's `embeddings.create` (float and its default
base64) and /rerank with sentence-transformers' own numbers, and refuses bad input
with 400s while it keeps serving."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

if TYPE_CHECKING:
    from tests.conftest import LiveServer

pytestmark = pytest.mark.slow

WORDS = ["what", "is", "a", "cat", "dog", "pet", "the", "sea"]
WORDS += ["fish", "swims", "likes", "to", "eat"]
HIDDEN = 32
MAX_LEN = 64


def _build_st_bert(out: Path) -> Any:
    """A 2-layer random BertModel + mean pooling + Normalize, saved by sentence-transformers."""
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    raw = out.parent / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    (raw / "vocab.txt").write_text(
        "\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS])
    )
    tok_cls: Any = transformers.BertTokenizerFast  # type: ignore[attr-defined]
    tok = tok_cls(vocab_file=str(raw / "vocab.txt"))
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=5 + len(WORDS),
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=MAX_LEN,
    )
    model_cls: Any = transformers.BertModel
    model_cls(config).save_pretrained(str(raw))
    tok.save_pretrained(str(raw))
    st = SentenceTransformer(
        modules=[
            Transformer(str(raw), max_seq_length=MAX_LEN),
            Pooling(HIDDEN, "mean"),
            Normalize(),
        ],
        device="cpu",
    )
    st.save(str(out))
    return st


@pytest.fixture(scope="module")
def st_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    out = tmp_path_factory.mktemp("st-bert") / "model"
    return out, _build_st_bert(out)


@pytest.fixture(scope="module")
def server(launch_server: Callable[..., LiveServer], st_model: tuple[Path, Any]) -> LiveServer:
    return launch_server(str(st_model[0]), "--served-model-name", "st-bert")


def _reference(st: Any, texts: list[str]) -> list[list[float]]:
    return [[float(x) for x in row] for row in st.encode(texts, convert_to_numpy=True)]


def test_openai_embeddings_match_sentence_transformers(
    server: LiveServer, st_model: tuple[Path, Any]
) -> None:
    import openai

    texts = ["what is a cat", "the fish swims", "a dog likes to eat the fish"]
    want = _reference(st_model[1], texts)
    client = openai.OpenAI(api_key="x", base_url=f"{server.base_url}/v1", max_retries=0)
    default = client.embeddings.create(model="st-bert", input=texts)  # base64 on the wire
    floats = client.embeddings.create(model="st-bert", input=texts, encoding_format="float")
    for got in (default, floats):
        assert [d.index for d in got.data] == [0, 1, 2]
        for row, ref in zip(got.data, want, strict=True):
            assert row.embedding == pytest.approx(ref, abs=1e-5)
    assert default.usage.prompt_tokens == sum(
        len(st_model[1].tokenize([t])["input_ids"][0]) for t in texts
    )
    # Bad input: 400s with OpenAI's error body; the server keeps serving.
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        bad = [
            http.post("/v1/embeddings", json={"input": []}),
            http.post("/v1/embeddings", json={"input": "hi", "dimensions": 8}),
            http.post("/v1/embeddings", json={"input": "cat " * (2 * MAX_LEN)}),
            http.post("/v1/embeddings", json={"input": [1, "a"]}),
            http.post("/v1/completions", json={"prompt": "what is a cat"}),
        ]
        cut = http.post(
            "/v1/embeddings", json={"input": "cat " * (2 * MAX_LEN), "truncate_prompt_tokens": 8}
        )
    for res in bad:
        assert res.status_code == 400, res.text
        assert res.json()["error"]["type"] == "invalid_request_error"
    assert "(task: embed)" in bad[-1].json()["error"]["message"]
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 8


def test_rerank_scores_are_cosines(server: LiveServer, st_model: tuple[Path, Any]) -> None:
    query = "what is a cat"
    docs = ["a cat is a pet", "the sea", "fish swims", "a dog likes to eat"]
    q, *d = _reference(st_model[1], [query, *docs])
    # Both vectors are unit-length (Normalize), so the cosine is the dot product.
    want = [sum(a * b for a, b in zip(q, v, strict=True)) for v in d]
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        res = http.post("/rerank", json={"query": query, "documents": docs, "top_n": 3})
    body = res.json()
    assert res.status_code == 200, body
    order = sorted(range(len(docs)), key=lambda i: want[i], reverse=True)[:3]
    assert [r["index"] for r in body["results"]] == order
    for r in body["results"]:
        assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=1e-5)
        assert r["document"] == {"text": docs[r["index"]], "multi_modal": None}
    assert not any(math.isnan(r["relevance_score"]) for r in body["results"])
