"""`kv_transfer_params` sent to an engine without a KV connector: served, with a warning.

vLLM 0.33.0 (vllm/v1/engine/core.py:541-547) logs "Got kv_transfer_params,
but no KVConnector found. Disabling KVTransfer for this request." and serves
the request. The OpenAI app here runs over the real `EngineCore` (real
scheduler and KV cache; only the executor is the deterministic fake), driven
in the test's event loop, so the request reaches `EngineCore.add_request`
exactly as in a server.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import pytest

from paged.scheduler.boundary import EngineCoreOutputs, EngineCoreRequest
from paged.scheduler.testing import next_token
from paged.server.async_llm import AsyncLLM
from paged.server.engine.core import EngineCore
from paged.server.engine.errors import EngineDeadError
from paged.server.openai.api_server import build_app

PROMPT = [5, 6, 7, 8, 9]


class _CoreInLoop:
    """An `AsyncEngineClient` that steps a real `EngineCore` in the caller's event loop."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core

    @property
    def dead_error(self) -> EngineDeadError | None:
        return None

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

    async def abort_requests_async(self, request_ids: Sequence[str]) -> None:
        self.core.abort_requests(request_ids)

    async def get_output_async(self) -> EngineCoreOutputs:
        while True:
            if self.core.has_work():
                outputs = [o for batch in self.core.run_step().values() for o in batch.outputs]
                if outputs:
                    return EngineCoreOutputs(outputs=outputs)
            await asyncio.sleep(0.001)

    def shutdown(self) -> None:
        self.core.shutdown()


@pytest.fixture
async def http(
    tokenizer: Any, engine_config_factory: Any, fake_executor_cls: Any
) -> AsyncIterator[httpx.AsyncClient]:
    core = EngineCore(engine_config_factory(), fake_executor_cls)
    assert core.kv_connector is None
    llm = AsyncLLM(_CoreInLoop(core), tokenizer, max_model_len=64, vocab_size=128)
    transport = httpx.ASGITransport(app=build_app(llm, model_name="tiny"))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client
    llm.shutdown()


def _expected(n: int) -> list[int]:
    tokens = list(PROMPT)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(PROMPT) :]


@pytest.mark.timeout(60)
async def test_kv_transfer_params_without_a_connector_are_served_with_a_warning(
    http: httpx.AsyncClient, tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    params = {"do_remote_decode": True, "do_remote_prefill": False}
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0.0}
    with caplog.at_level("WARNING", logger="paged.server.engine.core"):
        resp = await http.post("/v1/completions", json={**body, "kv_transfer_params": params})
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    assert answer["choices"][0]["finish_reason"] == "length"
    # The real scheduler ran it: the fake model's deterministic tokens, detokenized.
    assert answer["choices"][0]["text"] == tokenizer.decode(_expected(4))
    assert answer["usage"]["completion_tokens"] == 4
    assert answer["kv_transfer_params"] is None  # no transfer took place
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert any("Got kv_transfer_params, but no KVConnector found" in r.message for r in warnings)
