"""`--structured-outputs-config` (vLLM's flag): parsed, refused by key, reaching the compilers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from paged.server.cli import build_parser, engine_args_from
from paged.server.structured_output.json_options import JsonGrammarOptions
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


def test_vllm_json_keys_and_the_whitespace_bound() -> None:
    got = parse_structured_outputs_config(
        '{"disable_any_whitespace": true, "disable_additional_properties": true}'
    )
    assert got.json_options == JsonGrammarOptions(
        disable_any_whitespace=True, disable_additional_properties=True
    )
    # vLLM's defaults for the reasoning keys mean "off": accepted.
    off = '{"reasoning_parser": "", "reasoning_parser_plugin": "", "enable_in_reasoning": false}'
    assert parse_structured_outputs_config(off) == StructuredOutputOptions()
    assert StructuredOutputOptions().json_options.max_json_whitespace == 8
    reasoning = parse_structured_outputs_config(
        '{"reasoning_parser": "qwen3", "enable_in_reasoning": true}'
    )
    assert (reasoning.reasoning_parser, reasoning.enable_in_reasoning) == ("qwen3", True)
    unbounded = parse_structured_outputs_config('{"max_json_whitespace": null}')
    assert unbounded.json_options.max_json_whitespace is None


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('{"backend": "xgrammar"}', "'xgrammar' is not available"),
        ('{"reasoning_parser_plugin": "x.py"}', "not supported by paged"),
        ('{"reasoning_parser": "r2"}', "unknown reasoning parser 'r2'"),
        ('{"enable_in_reasoning": 1}', "enable_in_reasoning must be true or false"),
        ('{"disable_any_whitespace": 1}', "disable_any_whitespace must be true or false"),
        ('{"max_json_whitespace": -1}', "max_json_whitespace must be >= 0"),
        ('{"max_json_whitespace": "4"}', "max_json_whitespace must be an integer"),
        ('{"whitespace_pattern": " "}', "unknown keys"),
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
        structured_outputs_config={
            "compile_timeout_s": 0.5,
            "cache_size": 3,
            "disable_any_whitespace": True,
        },
    )
    try:
        assert llm.grammar_compiler.compile_timeout_s == 0.5
        assert llm.grammar_compiler.cache_size == 3
        assert llm.grammar_compiler.json_options.disable_any_whitespace is True
    finally:
        llm.shutdown()


def test_engine_process_recipe_carries_the_json_options(
    tiny_model_dir: Path, tokenizer: Any
) -> None:
    # `paged serve` sends this record to the engine process (pickled), which builds its compiler.
    import pickle

    from paged.server.structured_output import StructuredOutputConfig

    options = parse_structured_outputs_config('{"disable_any_whitespace": true}').json_options
    config = StructuredOutputConfig(
        str(tiny_model_dir), len(tokenizer), (tokenizer.eos_token_id,), json_options=options
    )
    copy = pickle.loads(pickle.dumps(config))
    assert copy == config
    assert copy.build_compiler().json_options == options
    # --reasoning-parser crosses too: the engine's backend then gates its grammars.
    gated = StructuredOutputConfig(
        str(tiny_model_dir), len(tokenizer), (tokenizer.eos_token_id,), reasoning_parser="qwen3"
    )
    backend = pickle.loads(pickle.dumps(gated)).build()
    assert backend.reasoning is not None and backend.reasoning.spec.name == "qwen3"
    inside = StructuredOutputConfig(
        str(tiny_model_dir),
        len(tokenizer),
        (tokenizer.eos_token_id,),
        reasoning_parser="qwen3",
        enable_in_reasoning=True,
    )
    assert inside.build().reasoning is None
