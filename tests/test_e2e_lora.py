"""End to end: `paged serve --enable-lora --lora-modules ...` driven by the openai client.

A tiny random Llama (the shared `tiny_word_llama`, fp32) and random PEFT adapters
(init_lora_weights=False, so B != 0): two served from start-up, a third loaded at
runtime (VLLM_ALLOW_RUNTIME_LORA_UPDATING=true) and unloaded again. Greedy tokens
of each adapter, requested concurrently with the base model, equal transformers
+ peft's for that adapter.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest

if TYPE_CHECKING:
    from tests.conftest import LiveServer

# peft reads transformers' deprecated is_gradient_checkpointing (an error under filterwarnings).
pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning"),
]

PROMPT = [1, 5, 9, 17, 33, 65, 100, 7]
MAX_TOKENS = 8
ADAPTERS: dict[str, dict[str, Any]] = {
    "qv4": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    "all8": {
        "r": 8,
        "lora_alpha": 16,
        "target_modules": [
            *["q_proj", "k_proj", "v_proj", "o_proj"],
            *["gate_proj", "up_proj", "down_proj"],
        ],
    },
    "rs8": {"r": 8, "lora_alpha": 4, "use_rslora": True, "target_modules": ["o_proj", "up_proj"]},
}


def _build_adapter(base: Path, out: Path, seed: int, **config: Any) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    auto: Any = AutoModelForCausalLM
    model = auto.from_pretrained(str(base), dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **config))
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:  # large enough to change greedy tokens
            param.data.normal_(0.0, 0.5)
    peft_model.save_pretrained(str(out))
    return out


def _peft_greedy(base: Path, adapter: Path | None) -> list[int]:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    auto: Any = AutoModelForCausalLM
    model = auto.from_pretrained(str(base), dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return [int(t) for t in out[0, len(PROMPT) :]]


@pytest.fixture(scope="module")
def adapters(tiny_word_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    return {
        name: _build_adapter(tiny_word_llama, root / name, seed, **config)
        for seed, (name, config) in enumerate(ADAPTERS.items())
    }


@pytest.fixture(scope="module")
def expected(tiny_word_llama: Path, adapters: dict[str, Path]) -> dict[str | None, list[int]]:
    runs: dict[str | None, list[int]] = {None: _peft_greedy(tiny_word_llama, None)}
    for name, path in adapters.items():
        runs[name] = _peft_greedy(tiny_word_llama, path)
    assert len({tuple(v) for v in runs.values()}) == len(runs), "adapters must change tokens"
    return runs


@pytest.fixture(scope="module")
def server(
    launch_server: Callable[..., LiveServer], tiny_word_llama: Path, adapters: dict[str, Path]
) -> Iterator[LiveServer]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
        live = launch_server(
            str(tiny_word_llama), "--dtype", "float32", "--kv-cache-memory", "64MiB",
            "--max-num-batched-tokens", "16", "--max-num-seqs", "8",  # chunked prefill
            "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
            "--lora-modules", f"qv4={adapters['qv4']}",
            f'{{"name": "all8", "path": "{adapters["all8"]}", "base_model_name": "base"}}',
            "--served-model-name", "base",
        )  # fmt: skip
    yield live


def _tokens(choice: Any) -> list[int]:
    return [int(t.strip().removeprefix("w")) for t in choice.logprobs.tokens]


async def _complete(client: openai.AsyncOpenAI, model: str) -> list[int]:
    out = await client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=1,
        extra_body={"ignore_eos": True},  # transformers generated past EOS too
    )
    assert out.model == model
    return _tokens(out.choices[0])


async def test_adapters_base_and_runtime_loading(
    server: LiveServer, adapters: dict[str, Path], expected: dict[str | None, list[int]]
) -> None:
    async with (
        openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0) as client,
        httpx.AsyncClient(base_url=server.base_url) as http,
    ):
        cards = {m.id: m for m in (await client.models.list()).data}
        assert set(cards) == {"base", "qv4", "all8"}
        assert getattr(cards["qv4"], "parent", None) == "base"
        # Base and both adapters in flight together (one step holds all of them).
        got = await asyncio.gather(*(_complete(client, m) for m in ("base", "qv4", "all8")))
        assert got == [expected[None], expected["qv4"], expected["all8"]]

        # A third adapter at runtime (max_loras 2: it waits for a slot when needed).
        body = {"lora_name": "rs8", "lora_path": str(adapters["rs8"])}
        r = await http.post("/v1/load_lora_adapter", json=body)
        assert r.status_code == 200, r.text
        assert (await http.post("/v1/load_lora_adapter", json=body)).status_code == 400
        got = await asyncio.gather(*(_complete(client, m) for m in ("rs8", "qv4", "all8")))
        assert got == [expected["rs8"], expected["qv4"], expected["all8"]]

        # Bad loads are 400s naming the cause; the server keeps serving.
        missing = {"lora_name": "x", "lora_path": "/no/such/adapter"}
        assert (await http.post("/v1/load_lora_adapter", json=missing)).status_code == 400

        r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "rs8"})
        assert r.status_code == 200, r.text
        with pytest.raises(openai.NotFoundError):
            await _complete(client, "rs8")
        assert await _complete(client, "base") == expected[None]
