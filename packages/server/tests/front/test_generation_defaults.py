"""--generation-config (vLLM 0.33): the model's generation_config.json sets the defaults
of the sampling fields a request leaves out, never of those it sets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from paged.scheduler import SamplingParams
from paged.server.async_llm import AsyncLLM
from paged.server.generation_defaults import GenerationDefaults, load_generation_defaults
from paged.server.openai.api_server import build_app

MODEL = "tiny"
GENERATION = {
    "temperature": 0.6,
    "top_p": 0.9,
    "top_k": 20,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "max_new_tokens": 7,
    "do_sample": True,
    "eos_token_id": [2, 3],
}
DEFAULTS = {
    "temperature": 0.6,
    "top_p": 0.9,
    "top_k": 20,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "max_tokens": 7,
}


def _write(directory: Path, config: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "generation_config.json").write_text(json.dumps(config))
    return directory


def test_auto_reads_the_models_sampling_fields(tmp_path: Path) -> None:
    defaults = load_generation_defaults(str(_write(tmp_path / "m", GENERATION)), "auto")
    assert defaults.sampling == DEFAULTS  # eos ids, do_sample: not sampling defaults
    assert defaults.default_max_tokens == 7
    assert defaults.max_tokens_cap is None  # auto: a default, not a limit


def test_vllm_ignores_it(tmp_path: Path) -> None:
    model = _write(tmp_path / "m", GENERATION)
    assert load_generation_defaults(str(model), "vllm") == GenerationDefaults()


def test_a_directory_replaces_the_models_and_caps_max_tokens(tmp_path: Path) -> None:
    model = _write(tmp_path / "m", GENERATION)
    other = _write(tmp_path / "other", {"temperature": 0.3, "max_new_tokens": 5})
    defaults = load_generation_defaults(str(model), str(other))
    assert defaults.sampling == {"temperature": 0.3, "max_tokens": 5}
    assert defaults.max_tokens_cap == 5
    assert defaults.eos_token_ids == ()  # none there: the model's stay
    assert defaults.eos_token_ids_for([2, 9]) == [2, 9]


def test_a_directorys_eos_ids_replace_the_models_extra_ones(tmp_path: Path) -> None:
    # vLLM's update_from_generation_config: the primary EOS stays, the directory's
    # others become stop token ids (the model's extra 9 is not read).
    other = _write(tmp_path / "other", {"eos_token_id": [5, 2, 7]})
    defaults = load_generation_defaults(str(tmp_path / "m"), str(other))
    assert defaults.eos_token_ids == (5, 2, 7)
    assert defaults.eos_token_ids_for([2, 9]) == [2, 5, 7]
    auto = load_generation_defaults(str(_write(tmp_path / "m", GENERATION)), "auto")
    assert auto.eos_token_ids == ()  # auto: the model's, read by the runner's ModelConfig


def test_gguf_reads_the_file_beside_it_if_any(tmp_path: Path) -> None:
    gguf = tmp_path / "m" / "model.Q4_1.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    assert load_generation_defaults(str(gguf), "auto") == GenerationDefaults()
    _write(gguf.parent, {"temperature": 0.2})
    assert load_generation_defaults(str(gguf), "auto").sampling == {"temperature": 0.2}
    assert load_generation_defaults(None, "auto") == GenerationDefaults()  # default model


def test_no_generation_config_falls_back_to_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 2}))
    assert load_generation_defaults(str(tmp_path), "auto") == GenerationDefaults()


@pytest.fixture
def with_defaults(tokenizer: Any, fake_engine: Any) -> AsyncLLM:
    defaults = GenerationDefaults(
        {**DEFAULTS, "presence_penalty": 0.5, "skip_special_tokens": False}
    )
    return AsyncLLM(fake_engine, tokenizer, max_model_len=128, generation_defaults=defaults)


async def _sent(llm: AsyncLLM, path: str, body: dict[str, Any]) -> SamplingParams:
    engine: Any = llm.engine_client
    transport = httpx.ASGITransport(app=build_app(llm, model_name=MODEL))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        resp = await http.post(path, json=body)
    assert resp.status_code == 200, resp.text
    params: SamplingParams = engine.added[-1].sampling_params
    return params


CHAT = {"messages": [{"role": "user", "content": "hello"}]}


async def test_requests_that_omit_fields_get_the_defaults(with_defaults: AsyncLLM) -> None:
    p = await _sent(with_defaults, "/v1/chat/completions", CHAT)
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.6, 0.9, 20, 0.05)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.1, 0.5, 0.0)
    assert p.max_tokens == 7 and p.skip_special_tokens is False
    with_defaults.shutdown()


async def test_requests_that_set_fields_keep_them(with_defaults: AsyncLLM) -> None:
    body = {
        **CHAT, "temperature": 0.2, "top_p": 0.5, "top_k": 3, "min_p": 0.0,
        "repetition_penalty": 1.0, "presence_penalty": 0.0, "max_tokens": 3,
        "skip_special_tokens": True,
    }  # fmt: skip
    p = await _sent(with_defaults, "/v1/chat/completions", body)
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.2, 0.5, 3, 0.0)
    assert (p.repetition_penalty, p.presence_penalty) == (1.0, 0.0)
    assert p.max_tokens == 3 and p.skip_special_tokens is True
    with_defaults.shutdown()


async def test_completions_get_the_defaults_but_keep_their_max_tokens(
    with_defaults: AsyncLLM,
) -> None:
    # /v1/completions' max_tokens defaults to 16 in the protocol (OpenAI's, as vLLM's).
    p = await _sent(with_defaults, "/v1/completions", {"prompt": "hello"})
    assert (p.temperature, p.top_k, p.max_tokens) == (0.6, 20, 16)
    p = await _sent(with_defaults, "/v1/completions", {"prompt": "hello", "max_tokens": None})
    assert p.max_tokens == 7
    with_defaults.shutdown()


async def test_default_max_tokens_never_exceeds_the_context(
    tokenizer: Any, fake_engine: Any
) -> None:
    llm = AsyncLLM(
        fake_engine, tokenizer, max_model_len=24, generation_defaults=GenerationDefaults(
            {"max_tokens": 1000}
        )
    )  # fmt: skip
    p = await _sent(llm, "/v1/chat/completions", CHAT)
    prompt_len = len(fake_engine.added[-1].prompt_token_ids)
    assert p.max_tokens == 24 - prompt_len  # vLLM's get_max_tokens: the smallest
    llm.shutdown()


async def test_a_directorys_max_new_tokens_caps_every_request(
    tokenizer: Any, fake_engine: Any
) -> None:
    capped = GenerationDefaults({"max_tokens": 5}, max_tokens_cap=5)
    llm = AsyncLLM(fake_engine, tokenizer, max_model_len=128, generation_defaults=capped)
    p = await _sent(llm, "/v1/chat/completions", {**CHAT, "max_tokens": 50})
    assert p.max_tokens == 5
    llm.shutdown()


async def test_without_defaults_openai_defaults_apply(tokenizer: Any, fake_engine: Any) -> None:
    llm = AsyncLLM(fake_engine, tokenizer, max_model_len=128)
    p = await _sent(llm, "/v1/chat/completions", CHAT)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (
        1.0, 1.0, 0, 0.0, 1.0
    )  # fmt: skip
    assert p.skip_special_tokens is True
    llm.shutdown()


def test_offline_llm_uses_the_defaults_only_without_sampling_params(
    tokenizer: Any, fake_engine: Any
) -> None:
    """vLLM's LLM.get_default_sampling_params: for generate()/stream() given no params."""
    from paged.server.llm import LLM

    defaults = GenerationDefaults({"temperature": 0.6, "top_k": 20, "max_tokens": 3})
    llm = LLM.from_engine_client(
        fake_engine, tokenizer, max_model_len=64, generation_defaults=defaults
    )
    out = llm.generate("hello", use_tqdm=False)[0]
    p = fake_engine.added[-1].sampling_params
    assert (p.temperature, p.top_k, p.max_tokens) == (0.6, 20, 3)
    assert len(out.outputs[0].token_ids) == 3
    llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    p = fake_engine.added[-1].sampling_params
    assert (p.temperature, p.top_k, p.max_tokens) == (0.0, 0, 2)
    assert llm.get_default_sampling_params() == SamplingParams(
        temperature=0.6, top_k=20, max_tokens=3
    )
    llm.shutdown()
