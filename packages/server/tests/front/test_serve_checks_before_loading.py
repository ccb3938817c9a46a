"""`paged serve` checks every option before the engine starts (the model loads).

`build_engine_client` (called by `async_llm_builder.start_engine_client`) is
where the engine process starts and loads the weights; here it is replaced
by one that records the call and stops, so a check that ran too late shows
as "the engine was started".
"""

from __future__ import annotations

import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from paged.server import async_llm_builder, serve
from paged.server.compat_cli import FrontendOptions
from paged.server.engine_args import EngineArgs
from paged.server.openai.tools import ToolCallingConfig

NO_TOOL_FORMAT = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
# Shows the tools, in no format a parser knows: `auto` cannot pick one.
UNKNOWN_TOOL_FORMAT = NO_TOOL_FORMAT + "{% if tools %}{{ tools | tojson }}{% endif %}"
HERMES = "{% for m in messages %}<tool_call>{{ m['content'] }}</tool_call>{% endfor %}"


class EngineStarted(Exception):
    """Raised by the stand-in for the engine start: the checks had all passed."""


class FakeClient:
    """An engine client that started nothing: what serve logs of it, and shutdown."""

    info = SimpleNamespace(num_gpu_blocks=4, block_size=16, kv_cache_memory_bytes=1024)

    def shutdown(self) -> None:
        pass


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    path = tmp_path_factory.mktemp("tiny-serve")
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)  # its template writes no tool-call format
    return path


@pytest.fixture
def engine_starts(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    started: list[Any] = []

    def fake_build_engine_client(*args: Any, **kwargs: Any) -> Any:
        started.append(args)
        raise EngineStarted

    monkeypatch.setattr(async_llm_builder, "build_engine_client", fake_build_engine_client)
    return started


def _run(model: Path, tools: ToolCallingConfig, frontend: FrontendOptions | None = None) -> None:
    args = EngineArgs(model=str(model), device="cpu", kv_cache_memory_bytes=1 << 20)
    serve.run_server(
        args, host="127.0.0.1", port=0, api_key=None, tool_config=tools, frontend=frontend
    )


def test_tool_call_parser_auto_without_a_format_fails_before_the_engine_starts(
    tiny_model: Path, engine_starts: list[Any]
) -> None:
    with pytest.raises(ValueError, match="--tool-call-parser auto: the chat template shows none"):
        _run(
            tiny_model,
            ToolCallingConfig(True, "auto"),
            FrontendOptions(chat_template=UNKNOWN_TOOL_FORMAT),
        )
    assert engine_starts == []


def test_chat_template_flag_is_what_auto_reads(tiny_model: Path, engine_starts: list[Any]) -> None:
    # --chat-template replaces the model's template before the check: hermes is found.
    with pytest.raises(EngineStarted):
        _run(tiny_model, ToolCallingConfig(True, "auto"), FrontendOptions(chat_template=HERMES))
    assert len(engine_starts) == 1
    with pytest.raises(ValueError, match="--tool-call-parser auto"):
        _run(
            tiny_model,
            ToolCallingConfig(True, "auto"),
            FrontendOptions(chat_template=UNKNOWN_TOOL_FORMAT),
        )
    assert len(engine_starts) == 1
    # A template that ignores tools gets paged's generic format: the engine starts.
    with pytest.raises(EngineStarted):
        _run(
            tiny_model,
            ToolCallingConfig(True, "auto"),
            FrontendOptions(chat_template=NO_TOOL_FORMAT),
        )
    assert len(engine_starts) == 2


def test_unreadable_generation_config_fails_before_the_engine_starts(
    tiny_model: Path, engine_starts: list[Any], tmp_path: Path
) -> None:
    (tmp_path / "generation_config.json").write_text("{not json")
    args = EngineArgs(
        model=str(tiny_model), device="cpu", kv_cache_memory_bytes=1 << 20,
        generation_config=str(tmp_path),
    )  # fmt: skip
    with pytest.raises(ValueError, match="generation_config: cannot read"):
        serve.run_server(args, host="127.0.0.1", port=0, api_key=None)
    assert engine_starts == []


def test_bad_responses_store_variable_fails_before_the_engine_starts(
    tiny_model: Path, engine_starts: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_ENABLE_RESPONSES_API_STORE", "yes")
    with pytest.raises(ValueError, match="VLLM_ENABLE_RESPONSES_API_STORE must be an integer"):
        _run(tiny_model, ToolCallingConfig())
    assert engine_starts == []


def test_a_port_in_use_fails_before_the_engine_starts(
    tiny_model: Path, engine_starts: list[Any]
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = EngineArgs(model=str(tiny_model), device="cpu", kv_cache_memory_bytes=1 << 20)
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}"):
            serve.run_server(args, host="127.0.0.1", port=port, api_key=None)
    assert engine_starts == []


def test_frontend_options_reach_the_server(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With every check passed: what the vLLM flags change in the running server."""
    import uvicorn

    from paged.server.openai import api_server

    built: dict[str, Any] = {}
    real_build_app = api_server.build_app

    def build_app(llm: Any, **kw: Any) -> Any:
        built["llm"] = llm
        return real_build_app(llm, **kw)

    monkeypatch.setattr(async_llm_builder, "build_engine_client", lambda *a, **kw: FakeClient())
    monkeypatch.setattr(api_server, "build_app", build_app)
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: built.update(uvicorn=kw))
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.25}')
    args = EngineArgs(
        model=str(tiny_model), device="cpu", kv_cache_memory_bytes=1 << 20,
        generation_config=str(tmp_path), disable_log_stats=True,
    )  # fmt: skip
    front = FrontendOptions(HERMES, enable_log_requests=True, uvicorn_log_level="trace")
    serve.run_server(args, host="127.0.0.1", port=0, api_key=None, frontend=front)
    llm = built["llm"]
    assert built["uvicorn"]["log_level"] == "trace"
    assert llm.tokenizer.chat_template == HERMES
    assert llm.log_requests is True
    assert llm.generation_defaults.sampling == {"temperature": 0.25}
    assert llm.stat_loggers == []  # --disable-log-stats
    llm.shutdown()


def test_run_batch_starts_the_engine_and_llm_that_serve_does(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`paged serve` and `run-batch` build through `async_llm_builder`: for the same
    options, the same engine-core recipe and an AsyncLLM with the same limits."""
    import uvicorn

    from paged.server.batch.engine import batch_serving
    from paged.server.openai import api_server

    starts: list[tuple[Any, Any, dict[str, Any]]] = []

    def build_engine_client(factory: Any, options: Any, **kw: Any) -> FakeClient:
        starts.append((factory, options, kw))
        return FakeClient()

    served: list[tuple[Any, Any]] = []
    real_build_app = api_server.build_app

    def build_app(llm: Any, **kw: Any) -> Any:
        served.append((llm, kw["pooling_tasks"]))
        return real_build_app(llm, **kw)

    monkeypatch.setattr(async_llm_builder, "build_engine_client", build_engine_client)
    monkeypatch.setattr(api_server, "build_app", build_app)
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: None)
    args = EngineArgs(
        model=str(tiny_model), device="cpu", kv_cache_memory_bytes=1 << 20, disable_log_stats=True
    )
    serve.run_server(args, host="127.0.0.1", port=0, api_key=None)
    with batch_serving(args) as batch:
        batch_llm, batch_tasks = batch.openai.llm, batch.tasks
    ((serve_llm, serve_tasks),) = served
    serve_llm.shutdown()
    (serve_factory, *serve_where), (batch_factory, *batch_where) = starts
    assert serve_where == batch_where  # one engine (no DP), the same device and world size
    assert serve_factory.func is batch_factory.func
    assert serve_factory.keywords.keys() == batch_factory.keywords.keys()
    limits = [
        (p.max_model_len, p.vocab_size, p.extra_eos_token_ids, p.max_logprobs)
        for p in (serve_llm.input_processor, batch_llm.input_processor)
    ]
    assert limits[0] == limits[1]
    assert serve_tasks == batch_tasks
    assert serve_llm.stat_loggers == batch_llm.stat_loggers == []  # --disable-log-stats
