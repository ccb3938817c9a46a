"""Resolving a model's PoolerConfig and building its Pooler.

load_pooler_config follows vLLM 0.33's order (vllm/config/model.py:775-804):
the user's `--pooler-config` wins; fields it leaves unset come from the
sentence-transformers files (modules.json, the Pooling module's config.json,
a Normalize module); the rest from the architecture's defaults
(`default_seq_pooling_type`: CLS for the BERT family, bert.py:451/789,
roberta.py:114/266; LAST otherwise, interfaces_base.py:163; tokenwise ALL,
interfaces_base.py:173).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from paged.runner.models.bert import ENCODER_ONLY_ARCHITECTURES
from paged.runner.pooling.activations import classifier_activation
from paged.runner.pooling.config import PoolerConfig
from paged.runner.pooling.heads import build_classifier_head, is_seq_cls_architecture
from paged.runner.pooling.pooler import Pooler, Projector
from paged.runner.pooling.st_files import DenseLayer, st_pooling_defaults

# vllm/config/model.py:87-88 (ConvertOption).
CONVERT_OPTIONS = ("auto", "none", "embed", "classify")


def _architecture(hf_config: Mapping[str, Any]) -> str:
    archs = hf_config.get("architectures") or []
    return str(archs[0]) if archs else ""


def _check_convert(convert: str | None) -> None:
    if convert is not None and convert not in CONVERT_OPTIONS:
        raise ValueError(f"convert: {convert!r} is not one of {', '.join(CONVERT_OPTIONS)}")


def load_pooler_config(
    model_dir: str | Path | None,
    hf_config: Mapping[str, Any],
    override: PoolerConfig | None,
    convert: str | None,
) -> PoolerConfig:
    """The PoolerConfig a pooling model runs with (every pooling type resolved)."""
    _check_convert(convert)
    config = override if override is not None else PoolerConfig()
    st_defaults = st_pooling_defaults(model_dir)
    if st_defaults is not None:
        config = config.with_defaults(**st_defaults)
    seq_default = "CLS" if _architecture(hf_config) in ENCODER_ONLY_ARCHITECTURES else "LAST"
    return config.with_defaults(seq_pooling_type=seq_default, tok_pooling_type="ALL")


def build_pooler(
    config: PoolerConfig,
    hidden_size: int,
    head_state_dict: Mapping[str, torch.Tensor],
    hf_config: Mapping[str, Any],
    *,
    dense_layers: Sequence[DenseLayer] = (),
    convert: str | None = None,
) -> Pooler:
    """The Pooler of one model.

    A *ForSequenceClassification architecture, or `convert="classify"` (with
    a `score.weight` in `head_state_dict`), gives a classifier (classify,
    token_classify); anything else an embedder (embed, token_embed) whose
    projector is `dense_layers` (from `load_st_dense_layers(model_dir)`).
    `config` must come from `load_pooler_config` (pooling types resolved).
    """
    _check_convert(convert)
    config.get_seq_pooling_type()
    config.get_tok_pooling_type()
    architecture = _architecture(hf_config)
    if is_seq_cls_architecture(architecture) or convert == "classify":
        head = build_classifier_head(architecture, hidden_size, head_state_dict)
        return Pooler(
            config=config,
            hf_config=hf_config,
            hidden_size=hidden_size,
            projector=None,
            classifier=head,
            activation=classifier_activation(hf_config),
        )
    projector = Projector(dense_layers) if dense_layers else None
    if projector is not None and projector.in_features != hidden_size:
        raise ValueError(
            f"the first Dense module takes {projector.in_features} features, "
            f"the model's hidden size is {hidden_size}"
        )
    return Pooler(
        config=config,
        hf_config=hf_config,
        hidden_size=hidden_size,
        projector=projector,
        classifier=None,
        activation=classifier_activation(hf_config),
    )
