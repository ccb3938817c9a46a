"""Tokenizer loading: HF directories, GGUF path resolution and its errors, the GGUF cache key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from paged.server.chat_utils import FALLBACK_CHAT_TEMPLATE, apply_chat_template
from paged.server.tokenizer import (
    _gguf_cache_dir,
    load_tokenizer,
    resolve_tokenizer_source,
)


def test_load_from_hf_directory(tokenizer: Any, tmp_path: Path) -> None:
    tokenizer.save_pretrained(str(tmp_path))
    loaded = load_tokenizer(tmp_path)
    text = "café 日本 😀 hello"
    assert loaded.encode(text) == tokenizer.encode(text)
    assert loaded.eos_token_id == tokenizer.eos_token_id
    assert loaded.chat_template == tokenizer.chat_template


def test_resolve_sources(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_tokenizer_source(gguf) == (tmp_path, "m.gguf")
    assert resolve_tokenizer_source(tmp_path) == (tmp_path, None)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ValueError, match=r"^model: .*not a \.gguf"):
        resolve_tokenizer_source(other)
    with pytest.raises(ValueError, match=r"^model: .*neither"):
        resolve_tokenizer_source(tmp_path / "missing")


def test_gguf_cache_key_follows_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGED_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF-one")
    first = _gguf_cache_dir(gguf)
    assert first.parent == tmp_path / "cache" / "tokenizers"
    assert _gguf_cache_dir(gguf) == first
    gguf.write_bytes(b"GGUF-two, longer")  # a changed file never reuses a stale cache
    assert _gguf_cache_dir(gguf) != first


def test_fallback_chat_template(tokenizer: Any) -> None:
    text = apply_chat_template(
        tokenizer, [{"role": "user", "content": "hi"}], chat_template=FALLBACK_CHAT_TEMPLATE
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
