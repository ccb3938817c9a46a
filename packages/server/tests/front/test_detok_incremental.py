"""Incremental detokenization: streamed text equals a one-shot decode."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from paged.server.detokenizer import IncrementalDetokenizer, check_stop_strings

TEXTS = [
    "café naïve 日本語のテキスト 😀🎉",
    "hello world, the quick brown fox",
    "résumé 😀 jumps 日本",
]


def _stream(tok: Any, prompt: list[int], ids: list[int], chunk: int = 1, **kw: Any) -> list[str]:
    d = IncrementalDetokenizer(tok, prompt, **kw)
    deltas: list[str] = []
    for i in range(0, len(ids), chunk):
        part = ids[i : i + chunk]
        d.update(part, finished=i + chunk >= len(ids))
        deltas.append(d.get_next_output_text(finished=i + chunk >= len(ids), delta=True))
    return deltas


def test_multibyte_characters_never_stream_half_decoded(tokenizer: Any) -> None:
    text = "日本語 😀 café"
    ids = tokenizer.encode(text)
    # Several tokens carry only part of a character.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    deltas = _stream(tokenizer, tokenizer.encode("hello"), ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_cumulative_equals_delta_concatenation(tokenizer: Any) -> None:
    ids = tokenizer.encode(TEXTS[0])
    d = IncrementalDetokenizer(tokenizer, [])
    for i, t in enumerate(ids):
        d.update([t], finished=i == len(ids) - 1)
    assert d.get_next_output_text(finished=True, delta=False) == TEXTS[0]


def test_leading_space_of_first_token_kept_with_prompt_context(tokenizer: Any) -> None:
    prompt = tokenizer.encode("hello")
    ids = tokenizer.encode(" world")
    assert "".join(_stream(tokenizer, prompt, ids)) == " world"


def test_special_tokens_skipped_or_kept(tokenizer: Any) -> None:
    ids = [*tokenizer.encode("hello"), tokenizer.eos_token_id]
    assert "".join(_stream(tokenizer, [], ids)) == "hello"
    kept = "".join(_stream(tokenizer, [], ids, skip_special_tokens=False))
    assert kept == "hello<|im_end|>"


def test_unfinished_character_flushed_at_finish(tokenizer: Any) -> None:
    ids = tokenizer.encode("a😀")
    partial = ids[:-1]  # the emoji's last byte never arrives
    streamed = "".join(_stream(tokenizer, [], partial))
    assert streamed == tokenizer.decode(partial)
    assert streamed.endswith("\ufffd")


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(alphabet=st.sampled_from(list("abc xyz,.é日本😀\n")), min_size=1, max_size=24),
    chunk=st.integers(min_value=1, max_value=4),
    prompt=st.sampled_from(["", "hello", "日本"]),
)
def test_streaming_matches_one_shot_decode(
    tokenizer: Any, text: str, chunk: int, prompt: str
) -> None:
    ids = tokenizer.encode(text)
    deltas = _stream(tokenizer, tokenizer.encode(prompt), ids, chunk=chunk)
    assert "".join(deltas) == tokenizer.decode(ids) == text


def test_check_stop_strings_only_in_new_text() -> None:
    assert check_stop_strings("abcSTOP", 4, ["STOP"], False) is not None
    # The stop string lies entirely in old text: already checked, not again.
    assert check_stop_strings("STOPabc", 3, ["STOP"], False) is None
    # A stop string straddling old and new text is found.
    m = check_stop_strings("abcSTOP", 2, ["STOP"], False)
    assert m is not None and m.truncate_to == 3
    m = check_stop_strings("abcSTOPdef", 5, ["STOP"], True)
    assert m is not None and m.truncate_to == 7 and m.stop_str == "STOP"


def test_check_stop_strings_earliest_match_wins() -> None:
    m = check_stop_strings("xx ab cd", 6, ["cd", "ab"], False)
    assert m is not None and m.stop_str == "ab" and m.truncate_to == 3


def test_stop_string_truncates_and_holds_back_partial_stop(tokenizer: Any) -> None:
    ids = tokenizer.encode("The capital of France is Paris. STOP here.")
    d = IncrementalDetokenizer(tokenizer, [], stop=["STOP"])
    streamed = ""
    hit = None
    for t in ids:
        hit = d.update([t], finished=False)
        streamed += d.get_next_output_text(finished=hit is not None, delta=True)
        # While unfinished, no prefix of the stop string is ever streamed.
        if hit is None:
            assert not streamed.endswith(("S", "ST", "STO"))
        if hit is not None:
            break
    assert hit == "STOP"
    assert streamed == "The capital of France is Paris. "
    assert d.output_text == streamed


def test_include_stop_str_in_output(tokenizer: Any) -> None:
    ids = tokenizer.encode("Paris. STOP here")
    d = IncrementalDetokenizer(tokenizer, [], stop=["STOP"], include_stop_str_in_output=True)
    for t in ids:
        if d.update([t], finished=False) is not None:
            break
    assert d.get_next_output_text(finished=True, delta=False) == "Paris. STOP"


def test_stop_inside_a_multi_token_update_drops_later_tokens(tokenizer: Any) -> None:
    ids = tokenizer.encode("Paris. STOP here. more words")
    d = IncrementalDetokenizer(tokenizer, [], stop=[". S"])
    assert d.update(ids, finished=False) == ". S"
    assert d.output_text == "Paris"
    assert tokenizer.decode(d.output_token_ids).startswith("Paris. S")
    assert len(d.output_token_ids) < len(ids)
