"""LLM rerankers over HTTP (score template, `instruction`, concatenated pairs) and the
token tasks on /pooling, over a fake pooling engine; each bad input is a 400."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import pytest

from paged.server.async_llm import AsyncLLM
from paged.server.openai.api_server import build_app
from paged.server.openai.pooling_tasks import ModelTasks
from paged.server.st_score_template import SavedScoreTemplate

from .pooling_fakes import FakePoolingEngine, fake_embedding

MODEL = "tiny-pool"
# Qwen3-Reranker's template shape (vLLM's examples/pooling/score/template/qwen3_reranker.jinja).
TEMPLATE = (
    "what is {{ instruction | default('a', true) }} : "
    '{{ messages | selectattr("role", "eq", "query") | map(attribute="content") | first }} '
    '[SEP] {{ messages | selectattr("role", "eq", "document") | map(attribute="content") '
    "| first }}"
)
RERANKER = ModelTasks(
    ("classify", "token_classify"), num_labels=1, use_sep_token=False, score_template=TEMPLATE
)


def _http(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


@pytest.fixture
async def gen_llm(tokenizer: Any, fake_engine: Any) -> AsyncIterator[AsyncLLM]:
    llm = AsyncLLM(fake_engine, tokenizer, max_model_len=128)
    yield llm
    llm.shutdown()


def _app(llm: AsyncLLM, engine: FakePoolingEngine, tasks: ModelTasks) -> Any:
    return build_app(llm, model_name=MODEL, pooling_tasks=tasks, pooling_engine=engine)


def _bert_tokenizer(tmp_path: Any) -> Any:
    import transformers

    bert_tokenizer: Any = transformers.BertTokenizerFast  # type: ignore[attr-defined]
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "what", "is", "a", "cat", "dog", "pet"]
    words += ["find", "pets", ":"]
    (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n")
    return bert_tokenizer(vocab_file=str(tmp_path / "vocab.txt"))


def _rendered(tok: Any, query: str, doc: str, instruction: str | None = None) -> list[int]:
    messages = [{"role": "query", "content": query}, {"role": "document", "content": doc}]
    kw = {} if instruction is None else {"instruction": instruction}
    text = tok.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False, **kw)
    return list(tok.encode(text, add_special_tokens=True))


async def test_rerank_renders_pairs_through_the_score_template(
    tmp_path: Any, gen_llm: AsyncLLM
) -> None:
    tok = _bert_tokenizer(tmp_path)
    engine = FakePoolingEngine(tok, num_labels=1)
    docs = ["a cat", "dog"]
    async with _http(_app(gen_llm, engine, RERANKER)) as http:
        plain = await http.post("/rerank", json={"query": "cat", "documents": docs})
        told = await http.post(
            "/rerank", json={"query": "cat", "documents": docs, "instruction": "find pets"}
        )
        kwargs_win = await http.post(
            "/score",
            json={
                "queries": "cat",
                "documents": "dog",
                "instruction": "find pets",
                "chat_template_kwargs": {"instruction": "pet"},
            },
        )
    assert plain.status_code == told.status_code == kwargs_win.status_code == 200
    sent = [ids for ids, _, _ in engine.calls]
    assert sent[0] == _rendered(tok, "cat", "a cat")
    assert sent[1] == _rendered(tok, "cat", "dog")
    assert sent[2] == _rendered(tok, "cat", "a cat", "find pets")
    assert sent[4] == _rendered(tok, "cat", "dog", "pet")  # chat_template_kwargs wins
    # No token types for a rendered prompt: nothing but the task goes to the engine.
    assert all(params.extra_kwargs is None for _, params, _ in engine.calls)
    assert told.json()["usage"]["prompt_tokens"] == len(sent[2]) + len(sent[3])


async def test_cross_encoder_saved_template_is_used_and_overridden(
    tmp_path: Any, gen_llm: AsyncLLM
) -> None:
    """A CrossEncoder's saved template (with its saved kwargs) renders pairs when no
    --chat-template is given; the request's kwargs win over the saved ones; an explicit
    template wins over the saved one and its kwargs (vLLM io_processor.py:720-724)."""
    tok = _bert_tokenizer(tmp_path)
    saved = SavedScoreTemplate(TEMPLATE, {"instruction": "find pets"})
    with_saved = ModelTasks(("classify",), num_labels=1, saved_score_template=saved)
    explicit = ModelTasks(
        ("classify",), num_labels=1, score_template=TEMPLATE, saved_score_template=saved
    )
    engine = FakePoolingEngine(tok, num_labels=1)
    async with _http(_app(gen_llm, engine, with_saved)) as http:
        a = await http.post("/score", json={"queries": "cat", "documents": "dog"})
        b = await http.post(
            "/score", json={"queries": "cat", "documents": "dog", "instruction": "pet"}
        )
    async with _http(_app(gen_llm, engine, explicit)) as http:
        c = await http.post("/score", json={"queries": "cat", "documents": "dog"})
    assert a.status_code == b.status_code == c.status_code == 200
    sent = [ids for ids, _, _ in engine.calls]
    assert sent == [
        _rendered(tok, "cat", "dog", "find pets"),
        _rendered(tok, "cat", "dog", "pet"),
        _rendered(tok, "cat", "dog"),
    ]


async def test_llm_reranker_without_template_concatenates(tmp_path: Any, gen_llm: AsyncLLM) -> None:
    tok = _bert_tokenizer(tmp_path)
    engine = FakePoolingEngine(tok, num_labels=1)
    tasks = ModelTasks(("classify", "token_classify"), num_labels=1, use_sep_token=False)
    async with _http(_app(gen_llm, engine, tasks)) as http:
        res = await http.post("/score", json={"queries": "what is ", "documents": "a cat"})
    assert res.status_code == 200
    # vLLM's `use_sep_token: false`: query + document tokenized as one text.
    assert engine.calls[0][0] == tok.encode("what is a cat", add_special_tokens=True)


async def test_bad_score_template_input_is_a_400(tmp_path: Any, gen_llm: AsyncLLM) -> None:
    tok = _bert_tokenizer(tmp_path)
    engine = FakePoolingEngine(tok, num_labels=1)
    broken = ModelTasks(
        ("classify",), num_labels=1, score_template="{{ raise_exception('no pairs here') }}"
    )
    body = {"query": "cat", "documents": ["dog"]}
    async with _http(_app(gen_llm, engine, RERANKER)) as http:
        reserved = await http.post(
            "/rerank", json={**body, "chat_template_kwargs": {"tokenize": 1}}
        )
        not_text = await http.post("/rerank", json={**body, "instruction": 3})
        not_dict = await http.post("/rerank", json={**body, "chat_template_kwargs": "x"})
        still = await http.post("/rerank", json=body)
    async with _http(_app(gen_llm, engine, broken)) as http:
        failing = await http.post("/rerank", json=body)
    assert reserved.status_code == 400
    assert reserved.json()["error"]["param"] == "chat_template_kwargs"
    assert "reserved keys" in reserved.json()["error"]["message"]
    assert not_text.status_code == 400 and not_dict.status_code == 400
    assert failing.status_code == 400 and "no pairs here" in failing.json()["error"]["message"]
    assert failing.json()["error"]["param"] == "chat_template"
    assert still.status_code == 200
    assert len(engine.calls) == 1  # only the good request reached the engine


@pytest.mark.parametrize(
    ("tasks", "task", "width"),
    [
        (ModelTasks(("embed", "token_embed"), pooler_task="token_embed"), "token_embed", 8),
        (
            ModelTasks(("classify", "token_classify"), pooler_task="token_classify", num_labels=3),
            "token_classify",
            3,
        ),
    ],
)
async def test_pooling_token_tasks(
    tokenizer: Any, gen_llm: AsyncLLM, tasks: ModelTasks, task: str, width: int
) -> None:
    engine = FakePoolingEngine(tokenizer, num_labels=3)
    ids = tokenizer.encode("hello world")
    async with _http(_app(gen_llm, engine, tasks)) as http:
        default = await http.post("/pooling", json={"input": "hello world"})
        named = await http.post(
            "/pooling", json={"input": "hello world", "task": task, "encoding_format": "base64"}
        )
    assert default.status_code == named.status_code == 200
    rows = default.json()["data"][0]["data"]
    assert len(rows) == len(ids) and all(len(r) == width for r in rows)
    assert rows[0] == pytest.approx(fake_embedding([ids[0]], width).tolist())
    raw = np.frombuffer(base64.b64decode(named.json()["data"][0]["data"]), dtype=np.float32)
    np.testing.assert_allclose(raw.reshape(len(ids), width), np.array(rows), rtol=1e-6)
    assert [p.task for _, p, _ in engine.calls] == [task, task]
    assert default.json()["usage"]["prompt_tokens"] == len(ids)


async def test_pooling_task_mismatch_is_a_400(tokenizer: Any, gen_llm: AsyncLLM) -> None:
    engine = FakePoolingEngine(tokenizer)
    token_embed = ModelTasks(("embed", "token_embed"), pooler_task="token_embed")
    async with _http(_app(gen_llm, engine, token_embed)) as http:
        other = await http.post("/pooling", json={"input": "x", "task": "embed"})
        unsupported = await http.post("/pooling", json={"input": "x", "task": "token_classify"})
        unknown = await http.post("/pooling", json={"input": "x", "task": "plugin"})
        empty = await http.post("/pooling", json={"input": [], "task": "token_embed"})
    # vLLM 0.33's messages (pooling/pooling/serving.py:73-88).
    assert other.status_code == 400 and other.json()["error"]["param"] == "task"
    assert other.json()["error"]["message"] == (
        "Try switching the model's pooling_task via --pooler-config.task embed."
    )
    assert unsupported.status_code == 400 and unsupported.json()["error"]["param"] == "task"
    assert unsupported.json()["error"]["message"] == (
        "Unsupported task: 'token_classify' Supported tasks: ('embed', 'token_embed')"
    )
    assert unknown.status_code == 400
    assert empty.status_code == 400
    assert empty.json()["error"]["message"] == "You must pass at least one prompt"
    assert engine.calls == []
