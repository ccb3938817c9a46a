"""The grammar starts after the thinking (vLLM 0.33's reasoning gate), by text or by token id."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from paged.scheduler import SamplingParams, StructuredOutputsParams
from paged.scheduler.boundary import SchedulerOutput
from paged.scheduler.request import Request
from paged.server.reasoning import REASONING_SPECS, ReasoningEndDetector
from paged.server.structured_output import (
    GrammarCompiler,
    StructuredOutputBackend,
    load_ll_tokenizer,
)

ANSWER = StructuredOutputsParams(choice=["yes"])


def _compiler(tokenizer: Any) -> GrammarCompiler:
    eos = [tokenizer.eos_token_id]
    return GrammarCompiler(load_ll_tokenizer(tokenizer, len(tokenizer), eos), eos_token_ids=eos)


def _backend(tokenizer: Any, parser: str = "deepseek_r1") -> StructuredOutputBackend:
    detector = ReasoningEndDetector(REASONING_SPECS[parser], tokenizer)
    return StructuredOutputBackend(_compiler(tokenizer), reasoning=detector)


def _request(tokenizer: Any, prompt: str, so: StructuredOutputsParams = ANSWER) -> Request:
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    req = Request("r", ids, SamplingParams(structured_outputs=so), 2, max_model_len=256)
    req.num_computed_tokens = req.num_tokens
    return req


def _mask(backend: StructuredOutputBackend, req: Request) -> Any:
    return backend.grammar_bitmask([req], SchedulerOutput(num_scheduled_tokens={"r": 1}))


def _think_then_answer(backend: StructuredOutputBackend, req: Request, tok: Any) -> None:
    """Free text while thinking (no mask, any token accepted); the grammar after the tag."""
    thought = tok.encode("<think>hello world, not yes", add_special_tokens=False)
    assert _mask(backend, req) is None
    assert backend.accept_tokens("r", thought)
    assert _mask(backend, req) is None
    assert backend.validate_draft_tokens("r", thought) == len(thought)  # drafts are free too
    assert backend.accept_tokens("r", tok.encode("</think>", add_special_tokens=False))
    out = _mask(backend, req)
    assert out is not None and out.structured_output_request_ids == ["r"]
    assert not backend.accept_tokens("r", tok.encode("hello", add_special_tokens=False))


def test_no_mask_while_thinking_by_text(tokenizer: Any) -> None:
    """The tiny tokenizer has no think token: the end tag is found in decoded text,
    even split over several tokens; then the grammar holds (it would reject the
    thought's tokens: without the gate this test fails at the first mask)."""
    backend = _backend(tokenizer)
    assert backend.reasoning is not None and not backend.reasoning.by_token_id
    assert len(tokenizer.encode("</think>", add_special_tokens=False)) > 1
    _think_then_answer(backend, _request(tokenizer, "<|im_start|>assistant\n"), tokenizer)


def test_answer_accepted_after_the_tag(tokenizer: Any) -> None:
    backend = _backend(tokenizer)
    req = _request(tokenizer, "q")
    _mask(backend, req)
    text = "plan</think>"
    assert backend.accept_tokens("r", tokenizer.encode(text, add_special_tokens=False))
    assert backend.accept_tokens("r", tokenizer.encode("yes", add_special_tokens=False))


def test_no_mask_while_thinking_by_token_id(tokenizer: Any) -> None:
    tok = copy.deepcopy(tokenizer)
    tok.add_tokens(["<think>", "</think>"], special_tokens=False)
    backend = _backend(tok)
    assert backend.reasoning is not None and backend.reasoning.by_token_id
    _think_then_answer(backend, _request(tok, "q"), tok)


@pytest.mark.parametrize(
    ("parser", "prompt", "reasoning_ended", "masked"),
    [
        ("deepseek_r1", "q <think>\n", None, False),  # the prompt opened the thinking
        ("deepseek_r1", "q <think>\n\n</think>\n\n", None, True),  # thinking off in the template
        ("think", "q", None, True),  # the generic parser: no tag, no thinking
        ("deepseek_r1", "q", True, True),  # include_reasoning false: from the first token
    ],
)
def test_prompt_and_request_decide_where_the_grammar_starts(
    tokenizer: Any, parser: str, prompt: str, reasoning_ended: bool | None, masked: bool
) -> None:
    so = StructuredOutputsParams(choice=["yes"], reasoning_ended=reasoning_ended)
    backend = _backend(tokenizer, parser)
    assert (_mask(backend, _request(tokenizer, prompt, so)) is not None) is masked


def test_enable_in_reasoning_means_no_gate(tokenizer: Any) -> None:
    """No detector (`enable_in_reasoning: true`): the grammar holds from the first token."""
    backend = StructuredOutputBackend(_compiler(tokenizer))
    req = _request(tokenizer, "q <think>")
    assert _mask(backend, req) is not None
    assert not backend.accept_tokens("r", tokenizer.encode("<think>", add_special_tokens=False))
