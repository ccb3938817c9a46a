"""The --reasoning-parser splits, whole and streamed (any cut of the text gives the same split)."""

from __future__ import annotations

import pytest

from paged.server.reasoning import (
    REASONING_SPECS,
    ReasoningParser,
    check_reasoning_parser,
    make_reasoning_parser,
    thinking_enabled,
)


def _parser(name: str) -> ReasoningParser:
    parser = make_reasoning_parser(name)
    assert parser is not None
    return parser


def _streamed(
    parser: ReasoningParser, pieces: list[str], thinking: bool = True
) -> tuple[str, str, list[tuple[str, str]]]:
    stream = parser.stream(thinking)
    deltas = []
    for i, piece in enumerate(pieces):
        part = stream.feed(piece, final=i == len(pieces) - 1)
        deltas.append((part.reasoning, part.content))
    return "".join(r for r, _ in deltas), "".join(c for _, c in deltas), deltas


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        # vLLM 0.33 basic_parsers.py:153-176: the start tag is optional, content after the end.
        ("deepseek_r1", "<think>plan it</think>The answer.", ("plan it", "The answer.")),
        ("deepseek_r1", "plan it</think>The answer.", ("plan it", "The answer.")),
        # No end tag: all thinking (a cut-off output), content null.
        ("deepseek_r1", "<think>still thinking", ("still thinking", None)),
        ("deepseek_r1", "plan</think>", ("plan", None)),
        # qwen3 drops the thinking's trailing whitespace; <tool_call> ends it implicitly.
        ("qwen3", "<think>\nplan\n\n</think>\n\nAnswer", ("\nplan", "\n\nAnswer")),
        ("qwen3", "plan <tool_call>{}</tool_call>", ("plan", "<tool_call>{}</tool_call>")),
        ("qwen3", "plan  ", ("plan", None)),
        # The generic parser: no <think>, no thinking; text before it is answer.
        ("think", "Just the answer.", (None, "Just the answer.")),
        ("think", "<think>hmm</think>Yes", ("hmm", "Yes")),
        ("think", "A <think>hmm</think> B <think>x</think>", ("hmm", "A  B <think>x</think>")),
        ("think", "<think>never closed", ("never closed", None)),
    ],
)
def test_whole_output_split(name: str, text: str, expected: tuple[str | None, ...]) -> None:
    assert _parser(name).extract(text) == expected


@pytest.mark.parametrize("name", sorted(REASONING_SPECS))
@pytest.mark.parametrize(
    "text",
    [
        "<think>a < b and </thin is not a tag</think>The <answer> is 42.",
        "reasoning only, never ends <",
        "<thi",
        "</think>",
        "pre <think>x</think> post <tool_call>{}</tool_call>",
    ],
)
def test_every_cut_streams_the_whole_split(name: str, text: str) -> None:
    """Tags split anywhere across deltas: streamed pieces add up to the whole split."""
    parser = _parser(name)
    reasoning, content = parser.extract(text)
    for cut in range(len(text) + 1):
        for cut2 in range(cut, len(text) + 1, 3):
            r, c, _ = _streamed(parser, [text[:cut], text[cut:cut2], text[cut2:]])
            assert (r or None, c or None) == (reasoning, content), (cut, cut2)
    # One character at a time: no delta ever carries a piece of a tag.
    _, _, deltas = _streamed(parser, [*text, ""])
    for r, c in deltas:
        for tag in ("<think>", "</think>"):
            assert tag not in r and (tag not in c or name == "think")


def test_end_tag_split_across_deltas_is_held_back() -> None:
    _, _, deltas = _streamed(_parser("deepseek_r1"), ["<think>ab</th", "ink>cd", ""])
    assert deltas == [("ab", ""), ("", "cd"), ("", "")]


def test_qwen3_enable_thinking_false_is_all_answer() -> None:
    parser = _parser("qwen3")
    assert not thinking_enabled(parser.spec, {"enable_thinking": False})
    assert thinking_enabled(parser.spec, None)
    assert parser.extract("no thoughts</think>x", thinking=False) == (None, "no thoughts</think>x")
    # deepseek_r1 ignores the kwarg, as vLLM 0.33's DeepSeekR1ReasoningParser does.
    assert thinking_enabled(_parser("deepseek_r1").spec, {"enable_thinking": False})


@pytest.mark.parametrize(
    ("name", "open_", "text", "expected"),
    [
        # The prompt opened the thinking: even the generic parser starts in it.
        ("think", True, "hmm</think>Yes", ("hmm", "Yes")),
        ("deepseek_r1", True, "hmm</think>Yes", ("hmm", "Yes")),
        # The prompt closed it (or the grammar starts at once): all answer.
        ("deepseek_r1", False, "yes", (None, "yes")),
        ("qwen3", False, "<think>x</think>y", (None, "<think>x</think>y")),
        ("think", False, "<think>x</think>y", (None, "<think>x</think>y")),
    ],
)
def test_the_prompt_decides_where_the_output_starts(
    name: str, open_: bool, text: str, expected: tuple[str | None, ...]
) -> None:
    parser = _parser(name)
    assert parser.extract(text, open_=open_) == expected
    stream = parser.stream(open_=open_)
    parts = [stream.feed(ch) for ch in text] + [stream.feed("", final=True)]
    joined = ("".join(p.reasoning for p in parts), "".join(p.content for p in parts))
    assert (joined[0] or None, joined[1] or None) == expected


def test_unknown_parser_names_the_flag() -> None:
    with pytest.raises(ValueError, match=r"--reasoning-parser.*'nope'.*deepseek_r1, qwen3, think"):
        check_reasoning_parser("nope")
    assert check_reasoning_parser("None") is None and make_reasoning_parser(None) is None
