"""Output activations: L2 normalisation for embeddings, softmax/sigmoid for classifiers.

vLLM reference: vllm/model_executor/layers/pooler/activations.py:19-60
(get_act_fn: `problem_type` first, then the cross-encoder's saved activation,
then the default) and :118-142 (PoolerClassify: with the label count read from
the output's last dimension, fewer than 2 labels -> sigmoid, else softmax).
vLLM's poolers call it with `static_num_labels=False`
(seqwise/poolers.py:132-134, tokwise/poolers.py:139-141), so the width of the
logits decides, not `num_labels` in the config.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Activation = Callable[[torch.Tensor], torch.Tensor]


def normalize(x: torch.Tensor) -> torch.Tensor:
    return F.normalize(x, p=2, dim=-1)


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


def classify_by_width(x: torch.Tensor) -> torch.Tensor:
    """Sigmoid for a single logit (a relevance score), softmax over 2+ labels."""
    if x.shape[-1] < 2:
        return torch.sigmoid(x)
    return torch.softmax(x, dim=-1)


def classifier_activation(hf_config: Mapping[str, Any]) -> Activation:
    """The activation vLLM applies to classification logits for this model."""
    problem_type = hf_config.get("problem_type") or ""
    if problem_type == "regression":
        return identity
    if problem_type == "single_label_classification":
        return classify_by_width
    if problem_type == "multi_label_classification":
        return torch.sigmoid
    # A sentence-transformers CrossEncoder saves its activation in config.json.
    function_name: str | None = None
    st = hf_config.get("sentence_transformers")
    if isinstance(st, Mapping) and "activation_fn" in st:
        function_name = st["activation_fn"]
    elif hf_config.get("sbert_ce_default_activation_function") is not None:
        function_name = hf_config["sbert_ce_default_activation_function"]
    if function_name is not None:
        module = _torch_module(str(function_name))
        if isinstance(module, nn.Identity):
            return identity
        if isinstance(module, nn.Sigmoid | nn.Softmax):
            return classify_by_width
        return module
    return classify_by_width


def _torch_module(qualname: str) -> nn.Module:
    # vLLM refuses anything outside torch.nn.modules "for security reasons"
    # (activations.py:51-56): a config must not name arbitrary code.
    if not qualname.startswith("torch.nn.modules."):
        raise ValueError(
            "Loading of activation functions is restricted to torch.nn.modules for "
            f"security reasons (got {qualname!r})"
        )
    module_name, _, class_name = qualname.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"activation function {qualname!r} does not exist in torch") from exc
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(f"activation function {qualname!r} is not a torch.nn.Module")
    module: nn.Module = cls()
    return module


# vllm/model_executor/layers/activation.py:793-842 (get_act_fn, used for Dense layers).
_DENSE_ACTIVATIONS: dict[str, Activation] = {
    "identity": identity,
    "tanh": torch.tanh,
    "relu": torch.relu,
    "sigmoid": torch.sigmoid,
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def dense_activation(name: str) -> Activation:
    """A Dense module's `activation_function` (e.g. torch.nn.modules.activation.Tanh)."""
    key = name.lower()
    if key.startswith("torch.nn.modules."):
        key = key.rsplit(".", 1)[-1]
    if key not in _DENSE_ACTIVATIONS:
        raise ValueError(f"Activation function {name!r} is not supported.")
    return _DENSE_ACTIVATIONS[key]
