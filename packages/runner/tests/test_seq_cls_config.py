"""--hf-overrides and decoder classifiers resolved from config files alone (no weights read):
vLLM 0.33's original-Qwen3-Reranker conversion, and each bad input as a ValueError naming
the key before any model loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from paged.runner.hf_overrides import apply_hf_overrides, parse_hf_overrides
from paged.runner.model_config import ModelConfig

_RERANKER = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True,
}


def _model_dir(path: Path, architecture: str = "Qwen3ForCausalLM", **extra: Any) -> Path:
    """config.json + a tokenizer + a placeholder safetensors file (never loaded here)."""
    from transformers import AutoConfig, BertTokenizer

    path.mkdir()
    config = AutoConfig.for_model(
        "qwen3",
        vocab_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        architectures=[architecture],
        **extra,
    )
    config.save_pretrained(str(path))
    vocab = path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "no", "yes", "maybe"]))
    bert_tokenizer: Any = BertTokenizer  # untyped in transformers
    bert_tokenizer(str(vocab)).save_pretrained(str(path))
    save_file({"placeholder": torch.zeros(1)}, str(path / "model.safetensors"))
    return path


def test_parse_hf_overrides_rejects_bad_values() -> None:
    assert parse_hf_overrides(None) is None
    assert parse_hf_overrides('{"a": 1}') == {"a": 1}
    with pytest.raises(ValueError, match="hf_overrides: not valid JSON"):
        parse_hf_overrides("{architectures")
    with pytest.raises(ValueError, match="hf_overrides: must be a JSON object"):
        parse_hf_overrides("[1, 2]")
    for bad in ('{"architectures": "Qwen3ForCausalLM"}', '{"architectures": []}'):
        with pytest.raises(ValueError, match="hf_overrides: 'architectures' must be"):
            parse_hf_overrides(bad)


def test_apply_hf_overrides_sets_flat_and_nested_keys() -> None:
    from transformers import AutoConfig

    config: Any = AutoConfig.for_model("gemma3", text_config={"hidden_size": 32})
    apply_hf_overrides(config, {"use_sep_token": False, "text_config": {"hidden_size": 48}})
    assert config.use_sep_token is False
    assert config.text_config.hidden_size == 48


def test_original_qwen3_reranker_overrides_resolve_a_one_label_classifier(tmp_path: Path) -> None:
    path = _model_dir(tmp_path / "reranker")
    mc = ModelConfig.from_pretrained(str(path), runner="pooling", hf_overrides=_RERANKER)
    assert mc.architecture == "Qwen3ForSequenceClassification"
    assert (mc.runner_type, mc.convert_type) == ("pooling", "classify")
    assert mc.supported_tasks == ("classify", "token_classify")
    assert not mc.needs_lm_head
    # vLLM's Qwen3ForSequenceClassificationConfig + SequenceClassificationConfig.
    assert mc.hf_config.method == "from_2_way_softmax"
    assert mc.hf_config.num_labels == 1
    assert mc.hf_config.use_sep_token is False
    # Without the overrides the same directory is a generative model.
    plain = ModelConfig.from_pretrained(str(path))
    assert plain.runner_type == "generate" and plain.needs_lm_head


def test_seq_cls_checkpoint_config_is_a_pooling_classifier(tmp_path: Path) -> None:
    path = _model_dir(tmp_path / "seq-cls", "Qwen3ForSequenceClassification", num_labels=3)
    mc = ModelConfig.from_pretrained(str(path))
    assert (mc.runner_type, mc.convert_type) == ("pooling", "classify")
    assert mc.hf_config.num_labels == 3
    assert getattr(mc.hf_config, "use_sep_token", True) is True  # not an LM reranker
    with pytest.raises(ValueError, match="cannot generate text"):
        ModelConfig.from_pretrained(str(path), runner="generate")


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({**_RERANKER, "classifier_from_token": ["yes"]}, "classifier_from_token: an original"),
        ({**_RERANKER, "classifier_from_token": ["no", "nope"]}, r"\['nope'\] not in the"),
        (
            {"architectures": ["Qwen3ForSequenceClassification"], "method": "argmax"},
            "method: 'argmax' is not supported",
        ),
        (
            {"architectures": ["Qwen3ForSequenceClassification"], "method": "no_post_processing"},
            "classifier_from_token: method 'no_post_processing' needs a list",
        ),
        ({"architectures": ["NopeForSequenceClassification"]}, "is not supported by paged"),
    ],
)
def test_bad_reranker_overrides_fail_before_loading(
    tmp_path: Path, overrides: dict[str, Any], match: str
) -> None:
    path = _model_dir(tmp_path / "m")
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_pretrained(str(path), runner="pooling", hf_overrides=overrides)
