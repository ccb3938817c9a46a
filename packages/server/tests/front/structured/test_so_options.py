"""`--structured-outputs-config` (vLLM's flag): parsed, refused by key, reaching the compilers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from paged.server.cli import build_parser, engine_args_from
from paged.server.structured_output.options import (
    StructuredOutputOptions,
    parse_structured_outputs_config,
)


def test_vllm_keys_and_paged_keys() -> None:
    assert parse_structured_outputs_config('{"backend": "auto"}') == StructuredOutputOptions()
    got = parse_structured_outputs_config(
        {"backend": "guidance", "disable_fallback": True, "compile_timeout_s": 2, "cache_size": 8}
    )
    assert got == StructuredOutputOptions(compile_timeout_s=2.0, cache_size=8)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('{"backend": "xgrammar"}', "'xgrammar' is not available"),
        ('{"disable_any_whitespace": true}', "not supported by paged"),
        ('{"reasoning_parser": "deepseek_r1"}', "not supported by paged"),
        ('{"compile_timeout": 3}', "unknown keys"),
        ('{"compile_timeout_s": 0}', "compile_timeout_s must be > 0"),
        ('{"compile_timeout_s": "3"}', "number of seconds"),
        ('{"cache_size": 0}', "cache_size must be >= 1"),
        ("[1]", "JSON object"),
    ],
)
def test_bad_options_name_the_key(text: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        parse_structured_outputs_config(text)


def test_cli_flag(capsys: pytest.CaptureFixture[str]) -> None:
    ns = build_parser().parse_args(
        ["serve", "--structured-outputs-config", '{"compile_timeout_s": 1.5}']
    )
    args = engine_args_from(ns)
    assert args.structured_output_options().compile_timeout_s == 1.5
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--structured-outputs-config", '{"backend": "x"}'])
    assert e.value.code == 2 and "not available" in capsys.readouterr().err


def test_llm_compiler_gets_the_options(tiny_model_dir: Path) -> None:
    from paged.server import LLM

    llm: Any = LLM(
        str(tiny_model_dir),
        max_model_len=256,
        kv_cache_memory_bytes=1 << 22,
        structured_outputs_config={"compile_timeout_s": 0.5, "cache_size": 3},
    )
    try:
        assert llm.grammar_compiler.compile_timeout_s == 0.5
        assert llm.grammar_compiler.cache_size == 3
    finally:
        llm.shutdown()
