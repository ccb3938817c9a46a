"""--runner / --convert resolution from the architecture and files (vLLM 0.33's rules)."""

from __future__ import annotations

from pathlib import Path

import pytest

from paged.runner.runner_type import (
    check_runner_supported,
    resolve_convert_type,
    resolve_runner_type,
    supported_tasks,
)


def _resolve(
    arch: str, model_dir: Path | None, runner: str = "auto", convert: str = "auto"
) -> tuple[str, str]:
    runner_type = resolve_runner_type(arch, model_dir, runner, convert)
    return runner_type, resolve_convert_type(arch, runner_type, convert)


def test_auto_detection(tmp_path: Path) -> None:
    assert _resolve("Qwen3ForCausalLM", tmp_path) == ("generate", "none")
    (tmp_path / "modules.json").write_text("[]")  # a sentence-transformers directory
    assert _resolve("Qwen3ForCausalLM", tmp_path) == ("pooling", "embed")
    assert _resolve("BertModel", None) == ("pooling", "none")
    assert _resolve("XLMRobertaForSequenceClassification", None) == ("pooling", "none")
    assert _resolve("LlamaForCausalLM", None, convert="classify") == ("pooling", "classify")
    assert _resolve("LlamaForCausalLM", None, runner="pooling") == ("pooling", "embed")


def test_supported_tasks_follow_the_pooler_kind() -> None:
    assert supported_tasks("LlamaForCausalLM", "generate", "none") == ("generate",)
    assert supported_tasks("BertModel", "pooling", "none") == ("embed", "token_embed")
    assert supported_tasks("BertForSequenceClassification", "pooling", "none") == (
        "classify",
        "token_classify",
    )
    assert supported_tasks("LlamaForCausalLM", "pooling", "classify") == (
        "classify",
        "token_classify",
    )


def test_bad_flags_are_named() -> None:
    with pytest.raises(ValueError, match="runner: 'bogus' is not one of"):
        resolve_runner_type("LlamaForCausalLM", None, "bogus", "auto")
    with pytest.raises(ValueError, match="convert: 'reward' is not one of"):
        resolve_runner_type("LlamaForCausalLM", None, "auto", "reward")
    with pytest.raises(ValueError, match="runner: 'draft'"):
        resolve_runner_type("LlamaForCausalLM", None, "draft", "auto")
    with pytest.raises(ValueError, match="cannot generate text"):
        check_runner_supported("BertModel", "generate", "none")
    with pytest.raises(ValueError, match="needs --runner pooling"):
        check_runner_supported("LlamaForCausalLM", "generate", "embed")
    with pytest.raises(ValueError, match="not supported by paged as a pooling model"):
        check_runner_supported("GemmaForSequenceClassification", "pooling", "none")
    # Decoder classifiers run on their causal-LM body (before: refused at load).
    check_runner_supported("Qwen3ForSequenceClassification", "pooling", "classify")
    check_runner_supported("LlamaForSequenceClassification", "pooling", "classify")
