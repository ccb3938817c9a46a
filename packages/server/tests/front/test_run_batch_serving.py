"""run-batch's dispatch table over the real OpenAIServing and a scripted fake engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from paged.server.async_llm import AsyncLLM
from paged.server.batch.endpoints import openai_endpoints, pooling_endpoints
from paged.server.batch.files import BatchOutput, check_batch_files, read_batch_input
from paged.server.batch.runner import run_batch_lines
from paged.server.openai.pooling_tasks import ModelTasks
from paged.server.openai.serving import OpenAIServing
from paged.server.openai.serving_pooling import PoolingServing

from .pooling_fakes import FakePoolingEngine


async def test_chat_and_completions_lines_get_the_api_bodies(llm: AsyncLLM) -> None:
    serving = OpenAIServing(llm, "tiny")
    lines = [
        json.dumps(
            {
                "custom_id": "chat",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": "tiny", "messages": [{"role": "user", "content": "hello"}]},
            }
        ),
        json.dumps(
            {
                "custom_id": "cmpl",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": "tiny", "prompt": "hello world", "max_tokens": 2},
            }
        ),
        json.dumps(
            {
                "custom_id": "other-model",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": "gpt-4", "prompt": "x"},
            }
        ),
        json.dumps(
            {
                "custom_id": "too-long",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"prompt": "hello " * 200},
            }
        ),
    ]
    out: list[str] = []
    await run_batch_lines(lines, openai_endpoints(serving), out.append, max_inflight=4)
    chat, cmpl, other, long = (json.loads(x) for x in out)
    assert chat["response"]["body"]["object"] == "chat.completion"
    assert chat["response"]["body"]["choices"][0]["message"]["role"] == "assistant"
    assert cmpl["response"]["body"]["object"] == "text_completion"
    assert cmpl["response"]["body"]["usage"]["completion_tokens"] == 2
    assert other["response"]["status_code"] == 404
    assert other["error"]["error"]["code"] == "model_not_found"
    assert long["response"]["status_code"] == 400 and long["response"]["body"] is None


def test_files_are_checked_before_the_model_loads(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"a": 1}\n\n{"b": 2}\n')
    with pytest.raises(ValueError, match=r"--input-file .*no such file"):
        check_batch_files(str(tmp_path / "missing.jsonl"), str(tmp_path / "out.jsonl"))
    with pytest.raises(ValueError, match="same file"):
        check_batch_files(str(src), str(src))
    with pytest.raises(ValueError, match="is a directory"):
        check_batch_files(str(src), str(tmp_path))
    with pytest.raises(ValueError, match="does not exist"):
        check_batch_files(str(src), str(tmp_path / "nodir" / "out.jsonl"))
    check_batch_files(str(src), str(tmp_path / "out.jsonl"))
    assert read_batch_input(str(src)) == ['{"a": 1}', "", '{"b": 2}']


def test_output_to_a_url_is_put_at_the_end() -> None:
    import httpx

    sent: dict[str, Any] = {}

    def put(url: str, **kwargs: Any) -> httpx.Response:
        sent["url"], sent["content"] = url, kwargs["content"]
        return httpx.Response(200)

    output = BatchOutput("https://example.invalid/results.jsonl")
    output.write('{"x": 1}')
    output.write('{"x": 2}')
    assert not sent
    output.close(upload=put)
    assert sent == {
        "url": "https://example.invalid/results.jsonl",
        "content": b'{"x": 1}\n{"x": 2}\n',
    }


async def test_embedding_and_rerank_lines_and_a_chat_line_on_an_embedding_model(
    tokenizer: Any, llm: AsyncLLM
) -> None:
    # vLLM 0.33's run-batch table has /v1/embeddings, /score and /rerank
    # (run_batch.py:807-841); a chat line on an embedding model is the API's 400.
    engine = FakePoolingEngine(tokenizer)
    tasks = ModelTasks(("embed",))
    pooling = PoolingServing(engine, "tiny", tasks)
    table = {**openai_endpoints(OpenAIServing(llm, "tiny"), tasks), **pooling_endpoints(pooling)}

    def line(custom_id: str, url: str, body: dict[str, Any]) -> str:
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})

    lines = [
        line("emb", "/v1/embeddings", {"model": "tiny", "input": ["hello", "world"]}),
        line("rr", "/v2/rerank", {"query": "hello", "documents": ["hello", "world"]}),
        line("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        line("empty", "/v1/embeddings", {"input": []}),
    ]
    out: list[str] = []
    await run_batch_lines(lines, table, out.append, max_inflight=4)
    emb, rr, chat, empty = (json.loads(x) for x in out)
    body = emb["response"]["body"]
    assert emb["custom_id"] == "emb" and emb["error"] is None
    assert [d["index"] for d in body["data"]] == [0, 1] and len(body["data"][0]["embedding"]) == 8
    results = rr["response"]["body"]["results"]
    assert sorted(r["index"] for r in results) == [0, 1]
    assert results[0]["relevance_score"] >= results[1]["relevance_score"]  # best first
    assert chat["response"]["status_code"] == 400 and "embed" in chat["error"]["error"]["message"]
    assert empty["response"]["status_code"] == 400
