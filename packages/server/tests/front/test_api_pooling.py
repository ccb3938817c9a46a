"""The pooling endpoints over a fake pooling engine: vLLM 0.33's shapes, base64 as
the openai client decodes it, and a 400 for every bad input (the server keeps serving)."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from prometheus_client import generate_latest

from paged.server.async_llm import AsyncLLM
from paged.server.metrics import PrometheusStatLogger
from paged.server.openai.api_server import build_app
from paged.server.openai.pooling_tasks import ModelTasks

from .asgi_clients import asgi_client, openai_client
from .pooling_fakes import FakePoolingEngine, fake_embedding

MODEL = "tiny-pool"
EMBED = ModelTasks(("embed",))
CLASSIFY = ModelTasks(("classify",), id2label={0: "neg", 1: "neutral", 2: "pos"}, num_labels=3)


def _http(app: Any) -> httpx.AsyncClient:
    return asgi_client(app)


@pytest.fixture
async def gen_llm(tokenizer: Any, fake_engine: Any) -> AsyncIterator[AsyncLLM]:
    llm = AsyncLLM(fake_engine, tokenizer, max_model_len=128)
    yield llm
    llm.shutdown()


def _app(llm: AsyncLLM, engine: FakePoolingEngine, tasks: ModelTasks, **kw: Any) -> Any:
    return build_app(llm, model_name=MODEL, pooling_tasks=tasks, pooling_engine=engine, **kw)


def _expected(engine: FakePoolingEngine, ids: list[int]) -> list[float]:
    vec = torch.nn.functional.normalize(fake_embedding(ids, engine.hidden), dim=-1)
    return [float(x) for x in vec.tolist()]


async def test_embeddings_every_input_form(tokenizer: Any, gen_llm: AsyncLLM) -> None:
    engine = FakePoolingEngine(tokenizer)
    hello = tokenizer.encode("hello world")
    async with _http(_app(gen_llm, engine, EMBED)) as http:
        one = await http.post("/v1/embeddings", json={"input": "hello world", "request_id": "r1"})
        texts = await http.post("/v1/embeddings", json={"input": ["hello world", "hi"]})
        ids = await http.post("/v1/embeddings", json={"input": [5, 6, 7]})
        id_lists = await http.post("/v1/embeddings", json={"input": [[5, 6], [7]]})
    body = one.json()
    assert one.status_code == 200, body
    assert body["id"] == "embd-r1" and body["object"] == "list" and body["model"] == MODEL
    assert body["data"][0]["object"] == "embedding" and body["data"][0]["index"] == 0
    assert body["data"][0]["embedding"] == pytest.approx(_expected(engine, hello))
    assert body["usage"] == {
        "prompt_tokens": len(hello),
        "completion_tokens": 0,
        "total_tokens": len(hello),
        "prompt_tokens_details": None,
    }
    assert engine.calls[0][2] == "embd-r1-0"  # "{response id}-{i}", as vLLM
    assert [d["index"] for d in texts.json()["data"]] == [0, 1]
    assert ids.json()["data"][0]["embedding"] == pytest.approx(_expected(engine, [5, 6, 7]))
    assert ids.json()["usage"]["prompt_tokens"] == 3
    got = [d["embedding"] for d in id_lists.json()["data"]]
    assert got == [pytest.approx(_expected(engine, [5, 6])), pytest.approx(_expected(engine, [7]))]


async def test_base64_is_the_float32_bytes(tokenizer: Any, gen_llm: AsyncLLM) -> None:
    engine = FakePoolingEngine(tokenizer)
    async with _http(_app(gen_llm, engine, EMBED)) as http:
        floats = await http.post("/v1/embeddings", json={"input": "hello"})
        b64 = await http.post(
            "/v1/embeddings", json={"input": "hello", "encoding_format": "base64"}
        )
        half_big = await http.post(
            "/v1/embeddings",
            json={
                "input": "hello",
                "encoding_format": "base64",
                "embed_dtype": "float16",
                "endianness": "big",
            },
        )
    want = floats.json()["data"][0]["embedding"]
    raw = base64.b64decode(b64.json()["data"][0]["embedding"])
    assert np.frombuffer(raw, dtype="<f4").tolist() == pytest.approx(want, abs=0)
    raw16 = base64.b64decode(half_big.json()["data"][0]["embedding"])
    assert np.frombuffer(raw16, dtype=">f2").astype(np.float32).tolist() == pytest.approx(
        want, abs=1e-3
    )


async def test_openai_client_embeddings_create(tokenizer: Any, gen_llm: AsyncLLM) -> None:
    """The openai client asks for base64 by default and decodes it itself."""
    engine = FakePoolingEngine(tokenizer)
    app = _app(gen_llm, engine, EMBED)
    client = openai_client(_http(app))
    default = await client.embeddings.create(model=MODEL, input=["hello", "world"])
    floats = await client.embeddings.create(model=MODEL, input="hello", encoding_format="float")
    await client.close()
    assert default.data[0].embedding == pytest.approx(_expected(engine, tokenizer.encode("hello")))
    assert floats.data[0].embedding == pytest.approx(default.data[0].embedding)
    assert default.usage.prompt_tokens == len(tokenizer.encode("hello")) + len(
        tokenizer.encode("world")
    )


async def test_chat_messages_go_through_the_template(tokenizer: Any, gen_llm: AsyncLLM) -> None:
    engine = FakePoolingEngine(tokenizer, max_model_len=64)
    msgs = [{"role": "user", "content": "hi"}]
    async with _http(_app(gen_llm, engine, EMBED)) as http:
        as_messages = await http.post("/v1/embeddings", json={"messages": msgs})
        in_input = await http.post("/v1/embeddings", json={"input": msgs})
        batch = await http.post("/v1/embeddings", json={"messages": [msgs, msgs]})
    templated = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    ids = tokenizer.encode(templated, add_special_tokens=False)
    assert as_messages.status_code == 200, as_messages.json()
    assert engine.calls[0][0] == ids and engine.calls[1][0] == ids
    assert in_input.json()["data"][0]["embedding"] == as_messages.json()["data"][0]["embedding"]
    assert len(batch.json()["data"]) == 2


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"input": []}, "input", "You must pass at least one prompt"),
        ({"input": ["a", 1]}, "input", "Invalid value for 'input'"),
        ({"input": [1.5, 2]}, "input", "Invalid value for 'input'"),
        ({"input": [["a", 2]]}, "input", "Invalid value for 'input'"),
        ({"input": [[]]}, "input", "must not be empty"),
        ({"input": ""}, "input", "must not be empty"),
        ({"input": [999999]}, "input", "out of range"),
        ({"input": "hi", "dimensions": 4}, "dimensions", "does not support Matryoshka"),
        ({"input": "hi", "normalize": True}, "normalize", "use `use_activation` instead"),
        ({"input": "hi", "encoding_format": "bytes"}, "encoding_format", "Invalid value"),
        ({"input": "hi", "truncate_prompt_tokens": 99}, "truncate_prompt_tokens", "cannot be"),
        ({"input": "hi", "messages": [{"role": "user", "content": "x"}]}, "input", "exactly one"),
        ({"input": "hi " * 40}, "input", "maximum context length is 32 tokens"),
        ({"input": "hi", "model": "other"}, "model", "does not exist"),
    ],
)
async def test_bad_embedding_input_is_a_400(
    tokenizer: Any, gen_llm: AsyncLLM, body: dict[str, Any], param: str, message: str
) -> None:
    engine = FakePoolingEngine(tokenizer)
    async with _http(_app(gen_llm, engine, EMBED)) as http:
        bad = await http.post("/v1/embeddings", json=body)
        good = await http.post("/v1/embeddings", json={"input": "hello"})
    err = bad.json()["error"]
    expected = 404 if param == "model" else 400
    assert bad.status_code == expected, err
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert message in err["message"]
    assert good.status_code == 200  # the server keeps serving


async def test_truncate_prompt_tokens_keeps_the_first_tokens(
    tokenizer: Any, gen_llm: AsyncLLM
) -> None:
    engine = FakePoolingEngine(tokenizer, max_model_len=32)
    long_ids = tokenizer.encode("hi " * 40)
    async with _http(_app(gen_llm, engine, EMBED)) as http:
        cut = await http.post(
            "/v1/embeddings", json={"input": "hi " * 40, "truncate_prompt_tokens": 5}
        )
        left = await http.post(
            "/v1/embeddings",
            json={"input": long_ids, "truncate_prompt_tokens": -1, "truncation_side": "left"},
        )
    assert cut.json()["usage"]["prompt_tokens"] == 5
    assert left.json()["usage"]["prompt_tokens"] == 32
    assert engine.calls[0][0] == long_ids[:5]
    assert engine.calls[1][0] == long_ids[-32:]  # -1: max_model_len, from the left


async def test_matryoshka_dimensions(tokenizer: Any, gen_llm: AsyncLLM) -> None:
    engine = FakePoolingEngine(tokenizer, matryoshka=True)
    async with _http(_app(gen_llm, engine, EMBED)) as http:
        ok = await http.post("/v1/embeddings", json={"input": "hello", "dimensions": 4})
        too_big = await http.post("/v1/embeddings", json={"input": "hello", "dimensions": 99})
    assert len(ok.json()["data"][0]["embedding"]) == 4
    assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "dimensions"


async def test_wrong_task_is_a_400_naming_the_task(tokenizer: Any, gen_llm: AsyncLLM) -> None:
    engine = FakePoolingEngine(tokenizer)
    generative = build_app(gen_llm, model_name=MODEL)
    async with _http(_app(gen_llm, engine, EMBED)) as http:
        chat = await http.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
        )
        completion = await http.post("/v1/completions", json={"prompt": "x"})
        classify = await http.post("/classify", json={"input": "x"})
    async with _http(generative) as http:
        embed = await http.post("/v1/embeddings", json={"input": "x"})
        rerank = await http.post("/rerank", json={"query": "q", "documents": ["d"]})
        still_generates = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert (
        chat.status_code == 400 and "pooling model (task: embed)" in chat.json()["error"]["message"]
    )
    assert "--runner generate" in completion.json()["error"]["message"]
    assert classify.status_code == 400
    assert (
        "Classification API is not supported by this model" in classify.json()["error"]["message"]
    )
    assert embed.status_code == 400 and "--runner pooling" in embed.json()["error"]["message"]
    assert "generative model (task: generate)" in embed.json()["error"]["message"]
    assert rerank.status_code == 400
    assert still_generates.status_code == 200
    assert engine.calls == []


async def test_classify(tokenizer: Any, gen_llm: AsyncLLM) -> None:
    engine = FakePoolingEngine(tokenizer, num_labels=3)
    async with _http(_app(gen_llm, engine, CLASSIFY)) as http:
        res = await http.post("/classify", json={"input": ["good", "bad"], "request_id": "c"})
        raw = await http.post("/classify", json={"input": "good", "use_activation": False})
    body = res.json()
    assert body["id"] == "classify-c" and len(body["data"]) == 2
    first = body["data"][0]
    assert first["num_classes"] == 3 and sum(first["probs"]) == pytest.approx(1.0)
    best = max(range(3), key=lambda k: first["probs"][k])
    assert first["label"] == CLASSIFY.id2label[best]
    assert sum(raw.json()["data"][0]["probs"]) != pytest.approx(1.0)  # logits, not softmax


async def test_pooling_endpoint(tokenizer: Any, gen_llm: AsyncLLM) -> None:
    engine = FakePoolingEngine(tokenizer)
    async with _http(_app(gen_llm, engine, EMBED)) as http:
        res = await http.post("/pooling", json={"input": [5, 6]})
        dims = await http.post("/pooling", json={"input": "x", "dimensions": 2})
        other = await http.post("/pooling", json={"input": "x", "task": "classify"})
        removed = await http.post("/pooling", json={"input": "x", "task": "score"})
    body = res.json()
    assert body["id"].startswith("pooling-") and body["data"][0]["object"] == "pooling"
    assert body["data"][0]["data"] == pytest.approx(_expected(engine, [5, 6]))
    assert dims.status_code == 400
    assert dims.json()["error"]["message"] == "dimensions is currently not supported"
    assert other.status_code == 400
    assert removed.json()["error"]["message"] == "`score` task was removed; use `classify` instead."


async def test_score_bi_encoder_shapes(tokenizer: Any, gen_llm: AsyncLLM) -> None:
    engine = FakePoolingEngine(tokenizer)

    def cos(a: str, b: str) -> float:
        va = fake_embedding(tokenizer.encode(a), engine.hidden)
        vb = fake_embedding(tokenizer.encode(b), engine.hidden)
        return float(torch.nn.functional.cosine_similarity(va, vb, dim=0))

    async with _http(_app(gen_llm, engine, EMBED)) as http:
        one_n = await http.post("/score", json={"queries": "hi", "documents": ["hi", "world"]})
        n_n = await http.post("/v1/score", json={"text_1": ["a", "b"], "text_2": ["b", "a"]})
        one = await http.post("/score", json={"data_1": "hi", "data_2": "hello"})
        bad = await http.post("/score", json={"text_1": ["a", "b"], "text_2": ["a", "b", "c"]})
        empty = await http.post("/score", json={"text_1": "a", "text_2": []})
    assert [d["score"] for d in one_n.json()["data"]] == pytest.approx(
        [cos("hi", "hi"), cos("hi", "world")]
    )
    assert one_n.json()["data"][0]["object"] == "score"
    assert [d["score"] for d in n_n.json()["data"]] == pytest.approx([cos("a", "b"), cos("b", "a")])
    assert len(one.json()["data"]) == 1
    assert bad.json()["error"]["message"] == "Input lengths must be either 1:1, 1:N or N:N"
    assert empty.json()["error"]["message"] == "At least one text_pair element must be given"


def _bert_tokenizer(tmp_path: Any) -> Any:
    import transformers

    bert_tokenizer: Any = transformers.BertTokenizerFast  # type: ignore[attr-defined]
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "what", "is", "a", "cat", "dog", "pet"]
    (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n")
    return bert_tokenizer(vocab_file=str(tmp_path / "vocab.txt"))


async def test_rerank_cross_encoder(tmp_path: Any, gen_llm: AsyncLLM) -> None:
    tok = _bert_tokenizer(tmp_path)
    engine = FakePoolingEngine(tok, num_labels=1)
    tasks = ModelTasks(("classify",), num_labels=1)
    docs = ["a cat", "dog", "a pet is a dog"]
    async with _http(_app(gen_llm, engine, tasks)) as http:
        res = await http.post("/rerank", json={"query": "what is a cat", "documents": docs})
        top = await http.post(
            "/v2/rerank",
            json={
                "query": "what is a cat",
                "documents": docs,
                "top_n": 2,
                "return_documents": False,
            },
        )
        v1 = await http.post("/v1/rerank", json={"query": "what is a cat", "documents": docs})
    body = res.json()
    assert body["id"].startswith("score-") and body["model"] == MODEL
    scores = [r["relevance_score"] for r in body["results"]]
    assert scores == sorted(scores, reverse=True)
    assert {r["index"] for r in body["results"]} == {0, 1, 2}
    assert all(
        r["document"] == {"text": docs[r["index"]], "multi_modal": None} for r in body["results"]
    )
    # Each pair is the tokenizer's pair encoding, the document's tokens typed 1 (vLLM's range).
    pair = tok(text="what is a cat", text_pair="a cat")
    ids, params, _ = engine.calls[0]
    assert ids == pair["input_ids"]
    start = pair["token_type_ids"].index(1)
    assert params.task == "classify"
    assert params.extra_kwargs == {"compressed_token_type_ids": (start, len(ids))}
    assert body["usage"]["prompt_tokens"] == sum(len(c[0]) for c in engine.calls[:3])
    assert [r["index"] for r in top.json()["results"]] == [r["index"] for r in body["results"]][:2]
    assert all(r["document"] is None for r in top.json()["results"])
    assert v1.json()["results"] == body["results"]


async def test_score_needs_one_label(tmp_path: Any, gen_llm: AsyncLLM) -> None:
    engine = FakePoolingEngine(_bert_tokenizer(tmp_path))
    async with _http(_app(gen_llm, engine, CLASSIFY)) as http:
        res = await http.post("/score", json={"queries": "a", "documents": "b"})
    assert res.status_code == 400
    assert "Scoring API is only enabled for num_labels == 1" in res.json()["error"]["message"]


async def test_max_tokens_per_doc(tmp_path: Any, gen_llm: AsyncLLM) -> None:
    tok = _bert_tokenizer(tmp_path)
    engine = FakePoolingEngine(tok)
    one_label = ModelTasks(("classify",), num_labels=1)
    async with _http(_app(gen_llm, engine, one_label)) as http:
        too_big = await http.post(
            "/rerank", json={"query": "cat", "documents": ["dog"], "max_tokens_per_doc": 32}
        )
        cut = await http.post(
            "/rerank", json={"query": "cat", "documents": ["a pet dog"], "max_tokens_per_doc": 2}
        )
    assert too_big.status_code == 400
    assert too_big.json()["error"]["message"] == (
        "max_tokens_per_doc (32) must be less than max_model_len (32)."
    )
    assert cut.status_code == 200
    assert engine.calls[0][0] == tok(text="cat", text_pair="a pet")["input_ids"]


async def test_pooling_requests_are_counted_apart(tokenizer: Any, gen_llm: AsyncLLM) -> None:
    engine = FakePoolingEngine(tokenizer)
    stats = PrometheusStatLogger(MODEL)
    async with _http(_app(gen_llm, engine, EMBED, stat_logger=stats)) as http:
        await http.post("/v1/embeddings", json={"input": [[5, 6], [7]]})
        await http.post("/v1/embeddings", json={"input": []})  # refused: not counted
    text = generate_latest(stats.registry).decode()
    assert f'paged:pooling_requests_total{{model_name="{MODEL}",task="embed"}} 2.0' in text
    assert f'paged:pooling_prompt_tokens_total{{model_name="{MODEL}",task="embed"}} 3.0' in text
    assert f'paged:pooling_requests_total{{model_name="{MODEL}",task="classify"}} 0.0' in text


async def test_no_pooling_metrics_under_vllm_names(tokenizer: Any, gen_llm: AsyncLLM) -> None:
    from paged.server.metrics_names import metrics_naming

    stats = PrometheusStatLogger(MODEL, naming=metrics_naming("vllm"))
    engine = FakePoolingEngine(tokenizer)
    async with _http(_app(gen_llm, engine, EMBED, stat_logger=stats)) as http:
        res = await http.post("/v1/embeddings", json={"input": "hello"})
    assert res.status_code == 200
    assert "pooling" not in generate_latest(stats.registry).decode()
