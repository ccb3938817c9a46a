"""The Pooler of a served model, from its resolved `ModelConfig` (pool-models' builders).

The head tensors (a classifier's `score.weight` / `classifier.*`, a
sentence-transformers directory's Dense modules) are read straight from the
checkpoint files: the model class loads the body only. A GGUF has no
sentence-transformers files; an embedder's has no head, so its pooler pools the
body's hidden states (LAST for a decoder unless `--pooler-config` says otherwise),
and a llama.cpp reranker's head comes from its `cls` / `cls.output` tensors
(loader/gguf_rank.py). An LM served as
a reranker (`classifier_from_token` + `method`, pooling/seq_cls.py) gets a
`score` head built from its LM head rows.
"""

from __future__ import annotations

from typing import Any

import torch

from paged.runner.model_config import ModelConfig
from paged.runner.pooling import (
    Pooler,
    build_pooler,
    load_converted_score_head,
    load_head_state_dict,
    load_st_dense_layers,
)
from paged.runner.pooling.heads import is_seq_cls_architecture
from paged.runner.pooling.seq_cls import conversion_tokens, token_ids_for


def hf_config_dict(model_config: ModelConfig) -> dict[str, Any]:
    """The HF config as the plain mapping pool-models' builders read."""
    hf = model_config.hf_config
    data = hf.to_dict() if hasattr(hf, "to_dict") else dict(hf)
    data.setdefault("architectures", [model_config.architecture])
    return dict(data)


def build_model_pooler(model_config: ModelConfig) -> Pooler:
    """The model's Pooler (ValueError if it has no pooler config)."""
    config = model_config.pooler_config
    if config is None:
        raise ValueError("pooler_config: the model was not configured as a pooling model")
    head: dict[str, torch.Tensor] = {}
    model_dir = None
    convert = model_config.convert_type if model_config.runner_type == "pooling" else "embed"
    hf_dict = hf_config_dict(model_config)
    tokens = conversion_tokens(model_config.hf_config)
    if model_config.weights_format == "safetensors":
        model_dir = model_config.model
        if tokens is not None and model_config.runner_type == "pooling":
            # An LM served as a reranker: `score` from its LM head rows (vLLM's
            # seq_cls_model_loader, adapters.py:516-680); the checkpoint has no score.*.
            token_ids = token_ids_for(model_config.tokenizer, tokens)
            head = load_converted_score_head(model_dir, hf_dict, token_ids)
        else:
            head = load_head_state_dict(model_dir, model_config.architecture)
    elif is_seq_cls_architecture(model_config.architecture):
        # A llama.cpp reranker GGUF: its rank head (loader/gguf_rank.py).
        from paged.runner.loader.gguf_rank import read_gguf_rank_head

        head = read_gguf_rank_head(model_config.weights_path)
    elif tokens is not None:
        raise ValueError(
            "classifier_from_token: deriving a score head from the LM head needs a "
            "safetensors checkpoint; this model is a GGUF"
        )
    return build_pooler(
        config,
        model_config.hidden_size,
        head,
        hf_dict,
        dense_layers=load_st_dense_layers(model_dir),
        convert=None if convert == "none" else convert,
    )
