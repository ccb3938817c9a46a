"""PoolerConfig keys (`--pooler-config`) and load_pooler_config's resolution order.

Sentence-transformers directories are written here by hand in the layouts
vLLM 0.33 reads (modules.json, `pooling_mode_*` flags or a `pooling_mode`
string, a Normalize module, Dense modules); tests/test_pooling_sentence_transformers.py
checks the files sentence-transformers itself writes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from paged.runner.pooling import PoolerConfig, load_pooler_config, load_st_dense_layers
from paged.runner.pooling.st_files import parse_pooling_type, st_pooling_defaults

BERT = {"architectures": ["BertModel"], "model_type": "bert"}
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}


def _st_dir(path: Path, pooling: dict[str, Any], normalize: bool) -> Path:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (path / "1_Pooling").mkdir(parents=True)
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return path


def test_pooling_type_resolves_into_seq_or_tok() -> None:
    assert PoolerConfig.from_json('{"pooling_type": "MEAN"}').seq_pooling_type == "MEAN"
    cfg = PoolerConfig.from_json({"pooling_type": "STEP", "step_tag_id": 7})
    assert (cfg.tok_pooling_type, cfg.seq_pooling_type, cfg.step_tag_id) == ("STEP", None, 7)


def test_every_vllm_key_is_accepted() -> None:
    cfg = PoolerConfig.from_json(
        {
            "task": "embed",
            "seq_pooling_type": "CLS",
            "tok_pooling_type": "ALL",
            "use_activation": False,
            "enable_flash_late_interaction": False,
            "dimensions": 8,
            "enable_chunked_processing": True,
            "max_embed_len": 1024,
            "logit_mean": 0.5,
            "logit_sigma": 2,
            "step_tag_id": 3,
            "returned_token_ids": [1, 2],
        }
    )
    assert cfg.dimensions == 8 and cfg.logit_sigma == 2 and cfg.returned_token_ids == [1, 2]


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ({"pooling": "MEAN"}, "unknown key 'pooling'"),
        ({"normalize": True}, "Parameter `normalize` was removed; use `use_activation`"),
        ({"task": "score"}, "`score` task was removed; use `classify` instead"),
        ({"task": "encode"}, "`encode` task was removed"),
        ({"task": "generate"}, "task must be one of"),
        ({"pooling_type": "MAX"}, "pooling_type must be one of"),
        ({"seq_pooling_type": "ALL"}, "seq_pooling_type must be one of"),
        ({"pooling_type": "CLS", "seq_pooling_type": "CLS"}, "both `pooling_type` and `seq"),
        ({"pooling_type": "ALL", "tok_pooling_type": "ALL"}, "both `pooling_type` and `tok"),
        ({"use_activation": "yes"}, "use_activation must be a boolean"),
        ({"dimensions": 0}, "dimensions must be a positive integer"),
        ({"dimensions": True}, "dimensions must be a positive integer"),
        ({"logit_sigma": 0}, "logit_sigma cannot be 0"),
        ({"logit_mean": "1"}, "logit_mean must be a number"),
        ({"returned_token_ids": [1, "a"]}, "returned_token_ids must be a list of integers"),
        ("[1, 2]", "expected a JSON object"),
        ("{bad json", "not valid JSON"),
    ],
)
def test_bad_pooler_config_raises_naming_the_key(value: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PoolerConfig.from_json(value)


def test_parse_pooling_type_follows_vllm() -> None:
    assert parse_pooling_type("pooling_mode_mean_tokens") == "MEAN"
    assert parse_pooling_type("pooling_mode_cls_token") == "CLS"
    assert parse_pooling_type("pooling_mode_lasttoken") == "LAST"
    assert parse_pooling_type("mean") == "MEAN"
    assert parse_pooling_type("pooling_mode_weightedmean_tokens") == "WEIGHTEDMEAN"


def test_st_flags_and_normalize_set_the_defaults(tmp_path: Path) -> None:
    flags = {
        "word_embedding_dimension": 32,
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False,
        "pooling_mode_lasttoken": False,
    }
    d = _st_dir(tmp_path, flags, normalize=True)
    cfg = load_pooler_config(str(d), BERT, None, None)
    # MEAN from the flags beats BERT's CLS default; Normalize -> use_activation.
    assert (cfg.seq_pooling_type, cfg.tok_pooling_type, cfg.use_activation) == ("MEAN", "ALL", True)


def test_st_without_normalize_turns_activation_off(tmp_path: Path) -> None:
    d = _st_dir(tmp_path, {"pooling_mode": "lasttoken"}, normalize=False)
    cfg = load_pooler_config(d, QWEN3, None, "embed")
    assert (cfg.seq_pooling_type, cfg.use_activation) == ("LAST", False)


def test_user_override_wins_over_st_files(tmp_path: Path) -> None:
    d = _st_dir(tmp_path, {"pooling_mode": "mean"}, normalize=True)
    override = PoolerConfig.from_json({"pooling_type": "CLS", "use_activation": False})
    cfg = load_pooler_config(d, BERT, override, None)
    assert (cfg.seq_pooling_type, cfg.use_activation) == ("CLS", False)


def test_architecture_defaults_without_st_files(tmp_path: Path) -> None:
    assert load_pooler_config(tmp_path, BERT, None, None).seq_pooling_type == "CLS"
    xlmr = {"architectures": ["XLMRobertaForSequenceClassification"]}
    assert load_pooler_config(None, xlmr, None, None).seq_pooling_type == "CLS"
    cfg = load_pooler_config(None, QWEN3, None, "embed")
    assert (cfg.seq_pooling_type, cfg.tok_pooling_type, cfg.use_activation) == ("LAST", "ALL", None)


def test_modules_without_pooling_module_give_no_defaults(tmp_path: Path) -> None:
    (tmp_path / "modules.json").write_text(
        json.dumps([{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"}])
    )
    assert st_pooling_defaults(tmp_path) is None


def test_bad_convert_is_rejected() -> None:
    with pytest.raises(ValueError, match="convert: 'reward' is not one of"):
        load_pooler_config(None, QWEN3, None, "reward")


def test_dense_modules_are_read_in_order(tmp_path: Path) -> None:
    modules = [
        {"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
        {"idx": 3, "path": "3_Dense", "type": "sentence_transformers.models.Dense"},
    ]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    w2, b2, w3 = torch.randn(16, 32), torch.randn(16), torch.randn(8, 16)
    for folder, cfg, state in (
        (
            "2_Dense",
            {
                "in_features": 32,
                "out_features": 16,
                "bias": True,
                "activation_function": "torch.nn.modules.activation.Tanh",
            },
            {"linear.weight": w2, "linear.bias": b2},
        ),
        (
            "3_Dense",
            {
                "in_features": 16,
                "out_features": 8,
                "bias": False,
                "activation_function": "torch.nn.modules.linear.Identity",
            },
            {"linear.weight": w3},
        ),
    ):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "config.json").write_text(json.dumps(cfg))
        save_file(state, str(tmp_path / folder / "model.safetensors"))
    layers = load_st_dense_layers(tmp_path)
    assert [tuple(layer.weight.shape) for layer in layers] == [(16, 32), (8, 16)]
    assert layers[0].bias is not None and torch.equal(layers[0].bias, b2)
    assert layers[1].bias is None and layers[0].activation.endswith("Tanh")
