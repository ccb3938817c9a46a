"""LoRA through the OpenAI API: `model` picks an adapter, /v1/models, load/unload routes.

The fake engine (conftest) gains the engine core's real `EngineLoRAs` over a
fake executor that "loads" any existing directory (one whose name holds
"rank64" is refused as too wide), so add/remove/list behave as the engine's.
vLLM 0.33: vllm/entrypoints/openai/models/serving.py (models, load, unload),
vllm/entrypoints/serve/engine/serving.py:49-84 (unknown model: 404),
vllm/entrypoints/serve/lora/api_router.py (routes behind the env variable).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from paged.runner.lora.config import LoRAAdapterSpec, LoRAConfig
from paged.scheduler import EngineCoreOutputs
from paged.server.async_llm import AsyncLLM
from paged.server.engine.lora import EngineLoRAs
from paged.server.lora import LoRAModulePath, runtime_lora_updating_allowed
from paged.server.openai.api_server import build_app

MODEL = "tiny"


class FakeLoRAExecutor:
    def __init__(self) -> None:
        self.loaded: dict[str, LoRAAdapterSpec] = {}
        self.removed: list[str] = []

    def add_lora(self, spec: LoRAAdapterSpec) -> None:
        if not Path(spec.path).is_dir():
            raise ValueError(f"{spec.path}: no adapter_config.json")
        if "rank64" in spec.path:
            raise ValueError("adapter rank 64 is above --max-lora-rank 16")
        self.loaded[spec.name] = spec

    def remove_lora(self, name: str) -> bool:
        self.removed.append(name)
        return self.loaded.pop(name, None) is not None

    def list_loras(self) -> list[str]:
        return list(self.loaded)


@pytest.fixture
def lora_engine(engine_cls: type[Any]) -> Any:
    class LoRAEngine(engine_cls):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(step_delay=0.01)
            self.executor = FakeLoRAExecutor()
            self.loras = EngineLoRAs(LoRAConfig(max_loras=2), self.executor, self.in_use)

        def in_use(self) -> set[str]:
            return {n for r in self.running.values() if (n := r.request.lora_request)}

        def step(self) -> EngineCoreOutputs:
            outputs: EngineCoreOutputs = super().step()
            self.loras.after_step()
            return outputs

        def call_utility(self, method: str, *args: Any) -> Any:
            calls: dict[str, Callable[..., Any]] = {
                "add_lora": self.loras.add_lora,
                "remove_lora": self.loras.remove_lora,
                "list_loras": self.loras.list_loras,
            }
            return calls[method](*args)

        async def call_utility_async(self, method: str, *args: Any) -> Any:
            await asyncio.sleep(0.01)  # a round trip to the engine: other requests run
            return self.call_utility(method, *args)

    return LoRAEngine()


@pytest.fixture
async def lora_llm(tokenizer: Any, lora_engine: Any) -> AsyncIterator[AsyncLLM]:
    llm = AsyncLLM(lora_engine, tokenizer, max_model_len=128)
    yield llm
    llm.shutdown()


def adapter_dir(tmp_path: Path, name: str) -> str:
    path = tmp_path / name
    path.mkdir(exist_ok=True)
    return str(path)


@pytest.fixture
async def http(lora_llm: AsyncLLM, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    """A server with adapter "sql" loaded at start-up (parent given) and "chat" (none)."""
    modules = [
        LoRAModulePath("sql", adapter_dir(tmp_path, "sql"), base_model_name=MODEL),
        LoRAModulePath("chat", adapter_dir(tmp_path, "chat")),
    ]
    app = build_app(
        lora_llm, model_name=MODEL, lora_modules=modules, allow_runtime_lora_updating=True
    )
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as h,
    ):
        yield h


@pytest.fixture
def client(http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url="http://t/v1",
        api_key="x",
        http_client=http,  # type: ignore[arg-type]
    )


async def test_model_picks_the_adapter_for_every_generation_endpoint(
    client: openai.AsyncOpenAI, lora_engine: Any, tmp_path: Path
) -> None:
    completion = await client.completions.create(model="sql", prompt="hello", max_tokens=2)
    assert completion.model == "sql"
    sent = lora_engine.added[-1]
    assert (sent.lora_request, sent.lora_path) == ("sql", str(tmp_path / "sql"))
    chat = await client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert chat.model == "chat" and lora_engine.added[-1].lora_request == "chat"
    stream = await client.chat.completions.create(
        model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True
    )
    assert {chunk.model async for chunk in stream} == {"sql"}
    streamed = await client.completions.create(
        model="chat", prompt="hello", max_tokens=2, stream=True
    )
    assert {chunk.model async for chunk in streamed} == {"chat"}
    response = await client.responses.create(model="sql", input="hi", max_output_tokens=2)
    assert response.model == "sql" and lora_engine.added[-1].lora_request == "sql"
    # The base model, by name or by leaving `model` out: no adapter.
    base = await client.completions.create(model=MODEL, prompt="hello", max_tokens=2)
    assert base.model == MODEL and lora_engine.added[-1].lora_request is None
    assert lora_engine.added[-1].lora_path is None


async def test_unknown_model_is_a_404_on_every_endpoint(http: httpx.AsyncClient) -> None:
    message = "The model `nope` does not exist. Valid aliases: tiny."
    for path, body in [
        ("/v1/completions", {"model": "nope", "prompt": "hi"}),
        ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
        ("/v1/responses", {"model": "nope", "input": "hi"}),
        ("/tokenize", {"model": "nope", "prompt": "hi"}),
    ]:
        r = await http.post(path, json=body)
        assert r.status_code == 404, path
        assert r.json()["error"]["message"] == message and r.json()["error"]["param"] == "model"


async def test_pooling_refuses_an_adapter_by_name(http: httpx.AsyncClient) -> None:
    r = await http.post("/v1/embeddings", json={"model": "sql", "input": "hi"})
    assert r.status_code == 400 and "is a LoRA adapter" in r.json()["error"]["message"]


async def test_models_lists_adapters_with_parent_and_root(
    http: httpx.AsyncClient, tmp_path: Path
) -> None:
    cards = (await http.get("/v1/models")).json()["data"]
    assert [c["id"] for c in cards] == [MODEL, "sql", "chat"]
    assert cards[0]["parent"] is None
    assert cards[1]["parent"] == MODEL and cards[1]["root"] == str(tmp_path / "sql")
    # No base_model_name: the served model is the parent (vLLM's rule).
    assert cards[2]["parent"] == MODEL and cards[2]["root"] == str(tmp_path / "chat")


async def test_load_then_use_then_unload(
    http: httpx.AsyncClient, client: openai.AsyncOpenAI, lora_engine: Any, tmp_path: Path
) -> None:
    path = adapter_dir(tmp_path, "new")
    r = await http.post("/v1/load_lora_adapter", json={"lora_name": "new", "lora_path": path})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'new' added successfully."
    assert "new" in [c["id"] for c in (await http.get("/v1/models")).json()["data"]]
    out = await client.completions.create(model="new", prompt="hello", max_tokens=2)
    assert out.model == "new" and lora_engine.executor.loaded["new"].path == path
    r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "new"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'new' removed successfully."
    assert lora_engine.executor.removed == ["new"]
    gone = await http.post("/v1/completions", json={"model": "new", "prompt": "hi"})
    assert gone.status_code == 404


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"lora_name": "sql", "lora_path": "/x"}, 400, "The lora adapter 'sql' has already"),
        ({"lora_name": MODEL, "lora_path": "/x"}, 400, "conflicts with a served base model"),
        ({"lora_name": "", "lora_path": "/x"}, 400, "Both 'lora_name' and 'lora_path'"),
        ({"lora_name": "m", "lora_path": "/no/such/dir"}, 400, "no adapter_config.json"),
        ({"lora_name": "m"}, 400, "lora_path"),
        ({"lora_name": "m", "lora_path": "/x", "load_inplace": True}, 400, "load_inplace"),
        ({"lora_name": "m", "lora_path": "/x", "bogus": 1}, 400, "bogus"),
    ],
)
async def test_load_errors_are_400s_naming_the_cause(
    http: httpx.AsyncClient, body: dict[str, Any], status: int, message: str
) -> None:
    r = await http.post("/v1/load_lora_adapter", json=body)
    assert r.status_code == status
    assert message in r.json()["error"]["message"] + str(r.json()["error"]["param"])


async def test_concurrent_loads_of_one_name_load_it_once(
    http: httpx.AsyncClient, lora_engine: Any, tmp_path: Path
) -> None:
    body = {"lora_name": "twice", "lora_path": adapter_dir(tmp_path, "twice")}
    first, second = await asyncio.gather(
        http.post("/v1/load_lora_adapter", json=body),
        http.post("/v1/load_lora_adapter", json=body),
    )
    assert sorted([first.status_code, second.status_code]) == [200, 400]
    loser = first if first.status_code == 400 else second
    assert loser.json()["error"]["message"] == "The lora adapter 'twice' has already been loaded."
    assert lora_engine.executor.list_loras().count("twice") == 1


async def test_an_adapter_the_runner_refuses_is_a_400_and_the_server_serves_on(
    http: httpx.AsyncClient, client: openai.AsyncOpenAI, tmp_path: Path
) -> None:
    body = {"lora_name": "wide", "lora_path": adapter_dir(tmp_path, "rank64")}
    r = await http.post("/v1/load_lora_adapter", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "adapter rank 64 is above --max-lora-rank 16"
    assert "wide" not in [c["id"] for c in (await http.get("/v1/models")).json()["data"]]
    out = await client.completions.create(model="sql", prompt="hello", max_tokens=2)
    assert out.model == "sql"


async def test_unload_unknown_is_404(http: httpx.AsyncClient) -> None:
    r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "nope"})
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "The lora adapter 'nope' cannot be found."
    empty = await http.post("/v1/unload_lora_adapter", json={"lora_name": ""})
    assert empty.status_code == 400


async def test_unload_with_a_request_in_flight_lets_it_finish(
    http: httpx.AsyncClient, lora_llm: AsyncLLM, lora_engine: Any
) -> None:
    from paged.scheduler import SamplingParams

    # Driven through AsyncLLM: httpx's ASGI transport returns a stream only once it ended.
    lora = lora_llm.loras.get("sql")
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    stream = lora_llm.generate("hello world", params, lora_request=lora)
    first = await anext(stream)
    r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
    assert r.status_code == 200 and not first.finished
    assert lora_engine.executor.removed == []  # still in use: the weights stay
    assert (
        await http.post("/v1/completions", json={"model": "sql", "prompt": "x"})
    ).status_code == 404
    outs = [first, *[o async for o in stream]]
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 30  # in full
    for _ in range(50):  # the engine unloads at its next step
        if lora_engine.executor.removed:
            break
        await asyncio.sleep(0.01)
    assert lora_engine.executor.removed == ["sql"]


async def test_routes_absent_without_the_env_variable(lora_llm: AsyncLLM) -> None:
    app = build_app(lora_llm, model_name=MODEL, allow_runtime_lora_updating=False)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as h:
        body = {"lora_name": "a", "lora_path": "/x"}
        assert (await h.post("/v1/load_lora_adapter", json=body)).status_code == 404
        assert (await h.post("/v1/unload_lora_adapter", json=body)).status_code == 404


def test_env_variable_parsing_as_vllm() -> None:
    assert runtime_lora_updating_allowed({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": " True "})
    assert runtime_lora_updating_allowed({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    assert not runtime_lora_updating_allowed({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "yes"})
    assert not runtime_lora_updating_allowed({})


async def test_a_static_adapter_that_fails_stops_start_up(
    lora_llm: AsyncLLM, tmp_path: Path
) -> None:
    bad = [LoRAModulePath("bad", str(tmp_path / "missing"))]
    app = build_app(lora_llm, model_name=MODEL, lora_modules=bad)
    with pytest.raises(ValueError, match=r"--lora-modules bad=.*no adapter_config\.json"):
        async with app.router.lifespan_context(app):
            pass


async def test_generate_with_a_lora_request_loads_it_once(
    lora_llm: AsyncLLM, lora_engine: Any, tmp_path: Path
) -> None:
    from paged.scheduler import SamplingParams
    from paged.server import LoRARequest

    lora = LoRARequest("ad", 1, adapter_dir(tmp_path, "ad"))
    params = SamplingParams(max_tokens=2)
    outs = [o async for o in lora_llm.generate("hello", params, lora_request=lora)]
    assert outs[-1].finished
    again = [o async for o in lora_llm.generate("hello", params, lora_request=lora)]
    assert again[-1].finished and lora_engine.executor.list_loras() == ["ad"]
    assert [r.lora_request for r in lora_engine.added] == ["ad", "ad"]
    # A known name from another path is refused, not silently served.
    other = LoRARequest("ad", 2, adapter_dir(tmp_path, "other"))
    with pytest.raises(ValueError, match="already loaded from"):
        [o async for o in lora_llm.generate("hello", params, lora_request=other)]
    missing = LoRARequest("m", 3, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"no adapter_config\.json"):
        [o async for o in lora_llm.generate("hello", params, lora_request=missing)]
