"""`--reasoning-parser NAME`: the parsers paged has, by vLLM 0.33's names.

    deepseek_r1  vllm/reasoning/deepseek_r1_reasoning_parser.py: `<think>`...`</think>`;
                 the output is thinking from its first token (the start tag is
                 optional: R1's template puts it in the prompt); no end tag: all
                 thinking.
    qwen3        vllm/parser/qwen3.py (Qwen3Parser, via qwen3_engine_reasoning_parser):
                 as deepseek_r1, plus `<tool_call>` ends the thinking implicitly
                 (and stays in the answer), trailing whitespace of the thinking is
                 dropped, and chat_template_kwargs `enable_thinking: false` makes
                 the whole output the answer.
    think        paged's generic parser (vLLM 0.33 has no generic one): the answer
                 until a `<think>` tag, thinking until `</think>`, then the answer;
                 an output with no `<think>` is all answer (for models that think
                 only sometimes).

`none` (any case) means no parser, as vLLM's `parse_reasoning_parser`
(engine/arg_utils.py:188-190).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from paged.server.reasoning.parser import ReasoningParser, ReasoningSpec

REASONING_SPECS: dict[str, ReasoningSpec] = {
    "deepseek_r1": ReasoningSpec(name="deepseek_r1"),
    "qwen3": ReasoningSpec(
        name="qwen3", implicit_ends=("<tool_call>",), strip_reasoning_trailing_ws=True
    ),
    "think": ReasoningSpec(name="think", starts_in_reasoning=False, open_in_content=True),
}


def check_reasoning_parser(name: str | None) -> str | None:
    """The parser name to use (None: off); ValueError naming the flag for an unknown one."""
    if name is None or name == "" or name.lower() == "none":
        return None
    if name not in REASONING_SPECS:
        raise ValueError(
            f"--reasoning-parser: unknown reasoning parser {name!r} "
            f"(choose from {', '.join(sorted(REASONING_SPECS))})"
        )
    return name


def make_reasoning_parser(name: str | None) -> ReasoningParser | None:
    checked = check_reasoning_parser(name)
    return None if checked is None else ReasoningParser(REASONING_SPECS[checked])


def thinking_enabled(spec: ReasoningSpec, chat_template_kwargs: Mapping[str, Any] | None) -> bool:
    """Whether the request thinks: only qwen3 reads `enable_thinking` (default true), as 0.33."""
    if spec.name != "qwen3" or not chat_template_kwargs:
        return True
    return bool(chat_template_kwargs.get("enable_thinking", True))


# OpenAI's `reasoning.effort` values (openai.types.shared.ReasoningEffort).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def effort_template_kwargs(
    effort: str | None, chat_template_kwargs: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    """The chat template's kwargs with a requested reasoning effort, as vLLM 0.33's
    build_chat_params (responses/protocol.py:482-524): `reasoning_effort` goes to the
    template, and `enable_thinking` follows it (false for "none") unless the request's
    kwargs set it; the parser then reads the same kwargs (`thinking_enabled`)."""
    if effort is None:
        return None if chat_template_kwargs is None else dict(chat_template_kwargs)
    kwargs = dict(chat_template_kwargs or {})
    kwargs.setdefault("enable_thinking", effort != "none")
    kwargs["reasoning_effort"] = effort  # vLLM's merge: its own value wins
    return kwargs
