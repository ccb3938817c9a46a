"""The incremental detokenizer on the default model's real tokenizer (SmolLM2, from its GGUF)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged.server.detokenizer import IncrementalDetokenizer
from paged.server.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow


@functools.cache
def _tokenizer() -> Any:
    return load_tokenizer()  # the default GGUF; cached on disk after the first parse


def _stream(tok: Any, prompt: str, ids: list[int]) -> list[str]:
    d = IncrementalDetokenizer(tok, tok.encode(prompt))
    out = []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        d.update([t], finished=last)
        out.append(d.get_next_output_text(finished=last, delta=True))
    return out


def test_multibyte_text_streams_whole_characters() -> None:
    tok = _tokenizer()
    text = " Größe: 日本語のテキスト 😀🎉 — café, naïve"
    ids = tok.encode(text, add_special_tokens=False)
    deltas = _stream(tok, "Hello", ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab Zé日本語😀\n,.'")), min_size=1, max_size=30))
def test_streamed_text_equals_one_shot_decode(text: str) -> None:
    tok = _tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    assert "".join(_stream(tok, "User:", ids)) == tok.decode(ids)
