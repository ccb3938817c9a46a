"""End to end: `paged serve` on the default model, driven by the official `openai` client.

One server per module (started like the README does, plus a port, an API key
and a small context so prompt-too-long is cheap to hit). Generations are kept
short: on CPU every token costs a full model step.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

if TYPE_CHECKING:
    from tests.conftest import LiveServer

pytestmark = pytest.mark.slow

API_KEY = "e2e-key"
MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 512
QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the capital of France?"}
]
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(launch_server: Callable[..., LiveServer]) -> LiveServer:
    return launch_server(
        # float32: the greedy text is compared with transformers' fp32 forward
        # (the quantized default path has its own tests, test_quantized_engine.py).
        "--dtype", "float32",
        "--api-key", API_KEY, "--max-model-len", str(MAX_MODEL_LEN),
        "--kv-cache-memory", "256MiB", "--max-num-seqs", "32",
        # vLLM's metric names and CORS flags, as a vLLM deployment would pass them.
        "--metrics-prefix", "vllm", "--allowed-origins", '["*"]',
    )  # fmt: skip


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(api_key=API_KEY, base_url=f"{server.base_url}/v1", max_retries=0) as c:
        yield c


@pytest.fixture
async def aclient(server: LiveServer) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        api_key=API_KEY, base_url=f"{server.base_url}/v1", max_retries=0
    ) as c:
        yield c


@pytest.fixture(scope="module")
def greedy_chat(client: openai.OpenAI) -> Any:
    return client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=16,
        temperature=0,
    )


def test_startup_logs_and_metadata(server: LiveServer) -> None:
    log = server.log()
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in log  # what was loaded
    assert "KV blocks of 16 tokens" in log
    assert f"http://127.0.0.1:{server.port}" in log  # where it listens
    with httpx.Client(base_url=server.base_url, headers=AUTH) as h:
        assert h.get("/health").status_code == 200
        models = h.get("/v1/models").json()
        assert models["data"][0]["id"] == MODEL
        assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
        assert h.get("/version").json()["version"]
        assert "/v1/chat/completions" in h.get("/openapi.json").json()["paths"]


def test_chat_completion_is_coherent(greedy_chat: Any) -> None:
    choice = greedy_chat.choices[0]
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"
    usage = greedy_chat.usage
    assert usage.prompt_tokens > 10 and 0 < usage.completion_tokens <= 16
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0


def test_streaming_chat_matches_and_reports_usage(client: openai.OpenAI, greedy_chat: Any) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=16, temperature=0,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == greedy_chat.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == greedy_chat.usage.completion_tokens
    # The second identical prompt hits the prefix cache.
    details = chunks[-1].usage.prompt_tokens_details
    assert details is not None and (details.cached_tokens or 0) > 0


def test_completions_seed_n_logprobs_and_stop(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6}
    a = client.completions.create(**kw, n=2, seed=42, temperature=1.0, logprobs=2)
    b = client.completions.create(**kw, n=2, seed=42, temperature=1.0, logprobs=2)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert [c.index for c in a.choices] == [0, 1]
    for c in a.choices:
        assert c.logprobs is not None and len(c.logprobs.token_logprobs or []) == 6
        assert "".join(c.logprobs.tokens or []) == c.text
    assert a.usage is not None and a.usage.completion_tokens == 12
    greedy = client.completions.create(**kw, temperature=0)
    text = greedy.choices[0].text
    stop = text[2:5]
    stopped = client.completions.create(**kw, temperature=0, stop=[stop])
    assert stopped.choices[0].text == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    kept = client.completions.create(
        **kw, temperature=0, stop=[stop], extra_body={"include_stop_str_in_output": True}
    )
    assert kept.choices[0].text == text[: text.index(stop) + len(stop)]


BAD: list[tuple[str, dict[str, Any], int, str | None]] = [
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": QUESTION, "temperature": "x"}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": QUESTION, "top_p": 2}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": QUESTION, "model": "gpt-9"}, 404, "model"),
    ("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 10_000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hello " * 600}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": [1, 10**7]}, 400, "prompt"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD)
def test_bad_requests(
    server: LiveServer, path: str, body: dict[str, Any], status: int, param: str | None
) -> None:
    resp = httpx.post(f"{server.base_url}{path}", json=body, headers=AUTH, timeout=60)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and err["message"] and err["type"] == "invalid_request_error"


def test_vllm_client_extras_bearer_metrics_and_cors(server: LiveServer) -> None:
    # llama.cpp's `cache_prompt` is ignored with vLLM's warning; the scheme's case is free.
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "cache_prompt": True}
    headers = {"Authorization": f"bearer {API_KEY}"}
    resp = httpx.post(f"{server.base_url}/v1/completions", json=body, headers=headers, timeout=60)
    assert resp.status_code == 200, resp.text
    assert "present in the request but ignored: {'cache_prompt'}" in server.log()
    metrics = httpx.get(f"{server.base_url}/metrics").text
    labels = f'{{engine="0",model_name="{MODEL}"}}'
    assert f"vllm:num_requests_waiting{labels} " in metrics
    assert f"vllm:generation_tokens_total{labels} " in metrics
    assert "paged:num_requests_waiting" not in metrics
    preflight = httpx.options(
        f"{server.base_url}/v1/completions",
        headers={"Origin": "https://app.example", "Access-Control-Request-Method": "POST"},
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "*"


def test_malformed_json_and_api_key(server: LiveServer) -> None:
    url = f"{server.base_url}/v1/completions"
    bad = httpx.post(url, content=b"{", headers={**AUTH, "content-type": "application/json"})
    assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]
    assert httpx.post(url, json={"prompt": "hi"}).status_code == 401
    wrong = httpx.post(url, json={"prompt": "hi"}, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    with (
        openai.OpenAI(api_key="nope", base_url=f"{server.base_url}/v1", max_retries=0) as c,
        pytest.raises(openai.AuthenticationError),
    ):
        c.models.list()


async def test_concurrent_streams_complete_correctly(
    aclient: openai.AsyncOpenAI, greedy_chat: Any
) -> None:
    async def one() -> str:
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=16, temperature=0, stream=True,
        )  # fmt: skip
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    texts = await asyncio.wait_for(asyncio.gather(*(one() for _ in range(8))), timeout=600)
    assert texts == [greedy_chat.choices[0].message.content] * 8


def _abort_count(server: LiveServer) -> float:
    text = httpx.get(f"{server.base_url}/metrics").text
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no abort counter in /metrics")


def test_no_kv_residency_histograms_without_the_flag(server: LiveServer) -> None:
    text = httpx.get(f"{server.base_url}/metrics").text
    # The real page (this server runs with --metrics-prefix vllm).
    assert "vllm:num_requests_running" in text
    assert "kv_block_" not in text  # --kv-cache-metrics is off


def test_client_disconnect_aborts_the_request(server: LiveServer) -> None:
    before = _abort_count(server)
    body = {"model": MODEL, "prompt": "Write a long story.", "max_tokens": 400, "stream": True}
    with (
        httpx.Client(headers=AUTH, timeout=120) as h,
        h.stream("POST", f"{server.base_url}/v1/completions", json=body) as resp,
    ):
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                assert json.loads(line[6:])["choices"]
                break  # one token arrived: now hang up
    deadline = time.monotonic() + 60
    while _abort_count(server) < before + 1:
        assert time.monotonic() < deadline, "the disconnected request was never aborted"
        time.sleep(0.5)
    # The engine keeps serving others.
    resp = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"prompt": "Hello", "max_tokens": 2}, headers=AUTH, timeout=120,
    )  # fmt: skip
    assert resp.status_code == 200


def test_greedy_equals_offline_llm_and_transformers(
    greedy_chat: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from paged.scheduler import SamplingParams
    from paged.server.llm import LLM
    from paged.server.tokenizer import default_model_path

    llm = LLM(
        max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=64 << 20, device="cpu", dtype="float32"
    )
    try:
        (out,) = llm.chat(QUESTION, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    finally:
        llm.shutdown()
    assert out.outputs[0].text == greedy_chat.choices[0].message.content
    # Hugging Face on the same GGUF, dequantized to fp32 (built by hand:
    # from_pretrained(gguf_file=...) would need `accelerate`).
    path = default_model_path()
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    ckpt = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=hf)  # type: ignore[no-untyped-call]
    tensors = ckpt["tensors"]
    result = hf.load_state_dict(tensors, strict=False)
    assert set(result.missing_keys) <= {"lm_head.weight"} and not result.unexpected_keys
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()  # tied
    hf.eval()
    prompt = torch.tensor([out.prompt_token_ids])
    with torch.no_grad():
        gen = hf.generate(prompt, max_new_tokens=16, do_sample=False, eos_token_id=2)
    hf_ids = gen[0, len(out.prompt_token_ids) :].tolist()
    assert out.outputs[0].token_ids == hf_ids
