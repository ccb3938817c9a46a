"""End to end: `paged serve --reasoning-parser deepseek_r1` on the default model.

SmolLM2-135M never writes `</think>`, so under deepseek_r1 (thinking from the
first token) its whole output is thinking: the engine process must leave it
unconstrained by the request's grammar, which starts only after the end tag.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import openai
import pytest

if TYPE_CHECKING:
    from tests.conftest import LiveServer

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
CHOICE = {"structured_outputs": {"choice": ["yes", "no"]}}
QUESTION = [{"role": "user", "content": "Is the sky blue? Explain."}]


@pytest.fixture(scope="module")
def client(launch_server: Callable[..., LiveServer]) -> Iterator[openai.OpenAI]:
    server = launch_server(
        "--max-model-len", "512", "--kv-cache-memory", "128MiB",
        "--reasoning-parser", "deepseek_r1",
    )  # fmt: skip
    with openai.OpenAI(api_key="x", base_url=f"{server.base_url}/v1", max_retries=0) as c:
        yield c


def _message(client: openai.OpenAI, messages: Any, **extra: Any) -> dict[str, Any]:
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, extra_body={**CHOICE, **extra}
    )
    message: dict[str, Any] = out.choices[0].message.model_dump()
    return message


def test_grammar_waits_for_the_end_of_thinking(client: openai.OpenAI) -> None:
    thinking = _message(client, QUESTION)
    # Unconstrained: free text, not one of the grammar's two answers.
    assert thinking["content"] is None
    assert thinking["reasoning"] and thinking["reasoning"] not in ("yes", "no")
    # include_reasoning false: the grammar holds from the first token (vLLM's reasoning_ended).
    hidden = _message(client, QUESTION, include_reasoning=False)
    assert hidden.get("reasoning") is None and hidden["content"] in ("yes", "no")


def test_prompt_that_ended_the_thinking_is_constrained_at_once(client: openai.OpenAI) -> None:
    """The engine reads the end tag in the prompt (as text: this tokenizer has no think token)."""
    messages = [*QUESTION, {"role": "assistant", "content": "<think>Easy.</think>"}]
    out = _message(client, messages, add_generation_prompt=False, continue_final_message=True)
    # The API's split reads the same tag (vLLM's parse_delta does too): all answer.
    assert out["content"] in ("yes", "no") and out.get("reasoning") is None
