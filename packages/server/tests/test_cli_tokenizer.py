"""`paged tokenizer MODEL` prints a Hugging Face tokenizer directory load tools can read."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from paged.server.cli import main
from paged.server.serve import _log_tokenizer_directory
from paged.server.tokenizer import default_model_path, load_tokenizer, tokenizer_directory


def test_prints_the_saved_tokenizer_of_the_default_gguf(capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoTokenizer

    assert main(["--log-level", "warning", "tokenizer"]) == 0
    out = capsys.readouterr().out.strip()
    directory = Path(out)
    assert (directory / "tokenizer_config.json").is_file(), out
    text = "The capital of France is Paris."
    assert AutoTokenizer.from_pretrained(out).encode(text) == load_tokenizer().encode(text)


def test_a_hugging_face_directory_is_printed_as_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["tokenizer", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path)


def test_a_bad_model_is_an_error_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.gguf"
    assert main(["tokenizer", str(missing)]) == 2
    err = capsys.readouterr().err
    assert "paged tokenizer: error: model:" in err and str(missing) in err


def test_serve_logs_the_directory_not_the_gguf(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="paged.server.serve"):
        _log_tokenizer_directory(str(default_model_path()), 49152)
    assert caplog.messages == [f"tokenizer: {tokenizer_directory()} (49152 tokens)"]
