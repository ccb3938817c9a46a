"""Pooling: final hidden states -> embeddings, classification scores, token vectors.

config.py      PoolerConfig (`--pooler-config`, vLLM 0.33's keys)
st_files.py    sentence-transformers files: pooling defaults, Dense modules
activations.py normalisation, softmax/sigmoid, a cross-encoder's saved activation
heads.py       classifier heads from checkpoint tensors; which tensors are head tensors
pooler.py      PoolingInput, Pooler (CLS/LAST/MEAN/ALL/STEP), dimensions checks
build.py       load_pooler_config, build_pooler
"""

from paged.runner.pooling.build import CONVERT_OPTIONS, build_pooler, load_pooler_config
from paged.runner.pooling.config import POOLING_TASKS, PoolerConfig
from paged.runner.pooling.heads import (
    DECODER_SEQ_CLS_ARCHITECTURES,
    is_head_tensor,
    load_head_state_dict,
    score_weight_from_lm_head,
)
from paged.runner.pooling.pooler import Pooler, PoolingInput, check_dimensions
from paged.runner.pooling.st_files import DenseLayer, load_st_dense_layers

__all__ = [
    "CONVERT_OPTIONS",
    "DECODER_SEQ_CLS_ARCHITECTURES",
    "POOLING_TASKS",
    "DenseLayer",
    "Pooler",
    "PoolerConfig",
    "PoolingInput",
    "build_pooler",
    "check_dimensions",
    "is_head_tensor",
    "load_head_state_dict",
    "load_pooler_config",
    "load_st_dense_layers",
    "score_weight_from_lm_head",
]
