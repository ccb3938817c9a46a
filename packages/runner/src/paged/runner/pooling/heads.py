"""Classification heads read from checkpoint tensors, and which tensors are head tensors.

    decoder *ForSequenceClassification     pooled -> score  (score.weight [L, H], bias optional)
    BertForSequenceClassification          pooled -> tanh(pooler.dense) -> classifier
    (XLM)RobertaForSequenceClassification  pooled -> tanh(classifier.dense) -> classifier.out_proj
    a llama.cpp `bert` GGUF reranker       pooled -> [tanh(cls)] -> [cls.output]

Per token (token_classify) vLLM applies the classifier alone: BERT's
`classifier` without the pooler dense, RoBERTa's whole classification head.
vLLM reference: vllm/model_executor/models/adapters.py:307-413 (as_seq_cls_model:
`score`, bias loaded when present), bert.py:97-124 and :790-842 (BertPooler dense +
tanh, classifier), roberta.py:94-112 and :349-396 (RobertaClassificationHead),
layers/pooler/special.py:37-57 (for_seq_cls: classify + token_classify).
Heads run in float32 (vLLM's pooling head_dtype default, config/model.py:2108-2119).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from paged.runner.loader.gguf_config import LLAMA_CPP_RANK_TENSORS
from paged.runner.loader.safetensors_weights import safetensors_files
from paged.runner.models.architectures import DECODER_SEQ_CLS_ARCHITECTURES

__all__ = ["DECODER_SEQ_CLS_ARCHITECTURES"]  # re-exported by paged.runner.pooling

Classifier = Callable[[torch.Tensor], torch.Tensor]

BERT_SEQ_CLS_ARCHITECTURES = frozenset({"BertForSequenceClassification"})
ROBERTA_SEQ_CLS_ARCHITECTURES = frozenset(
    {"RobertaForSequenceClassification", "XLMRobertaForSequenceClassification"}
)


def is_seq_cls_architecture(architecture: str) -> bool:
    return architecture.endswith("ForSequenceClassification")


def is_head_tensor(architecture: str, name: str) -> bool:
    """Whether checkpoint tensor `name` belongs to the pooling head, not the body."""
    if architecture in BERT_SEQ_CLS_ARCHITECTURES:
        return name.startswith(("bert.pooler.", "classifier."))
    if architecture in ROBERTA_SEQ_CLS_ARCHITECTURES:
        return name.startswith("classifier.")
    return name.startswith("score.")


def load_head_state_dict(model_dir: str | Path, architecture: str) -> dict[str, torch.Tensor]:
    """The head tensors of a safetensors checkpoint (only those are read), float32."""
    out: dict[str, torch.Tensor] = {}
    for path in safetensors_files(Path(model_dir)):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not mappings
                if is_head_tensor(architecture, name):
                    out[name] = f.get_tensor(name).float()
    return out


def score_weight_from_lm_head(
    lm_head_weight: torch.Tensor, token_ids: list[int], method: str
) -> torch.Tensor:
    """The `score.weight` of an LM converted to a classifier (Qwen3-Reranker style).

    `from_2_way_softmax` (token_ids = [false_id, true_id]): one logit
    w[true] - w[false], so sigmoid(score) equals the 2-way softmax's "true"
    probability; `no_post_processing`: the rows of the listed tokens.
    vllm/model_executor/models/adapters.py:416-446 (num_labels), :516-590, :593-656.
    """
    if method == "from_2_way_softmax":
        if len(token_ids) != 2:
            raise ValueError(
                f"classifier_from_token: from_2_way_softmax needs 2 tokens, got {len(token_ids)}"
            )
        false_id, true_id = token_ids
        w = lm_head_weight.float()
        return w[[true_id]] - w[[false_id]]
    if method == "no_post_processing":
        if not token_ids:
            raise ValueError("classifier_from_token: no_post_processing needs at least one token")
        return lm_head_weight.float()[token_ids]
    raise ValueError(
        f"method: {method!r} is not supported; use from_2_way_softmax or no_post_processing"
    )


def load_converted_score_head(
    model_dir: str | Path, hf_config: Mapping[str, object], token_ids: list[int]
) -> dict[str, torch.Tensor]:
    """`{"score.weight": ...}` of a causal LM served as a classifier (`--convert classify`).

    `hf_config["method"]` names the conversion and `classifier_from_token` the
    tokens, whose ids the caller looks up with the model's tokenizer
    (`token_ids`, same order). The LM head is `lm_head.weight`, or the input
    embeddings when the config ties them. vllm/model_executor/models/adapters.py:416-446.
    """
    method = hf_config.get("method")
    if not isinstance(method, str):
        raise ValueError(
            "method: a converted classifier needs `method` (from_2_way_softmax or "
            "no_post_processing) and `classifier_from_token` in its config"
        )
    tied = bool(hf_config.get("tie_word_embeddings", False))
    names = ("model.embed_tokens.weight",) if tied else ("lm_head.weight",)
    for path in safetensors_files(Path(model_dir)):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in names:
                if name in f.keys():  # noqa: SIM118 - safe_open handles are not mappings
                    return {
                        "score.weight": score_weight_from_lm_head(
                            f.get_tensor(name), token_ids, method
                        )
                    }
    raise ValueError(f"model: no {names[0]!r} in {str(model_dir)!r} to derive score.weight from")


@dataclass(frozen=True)
class ClassifierHead:
    """`seq` maps pooled states [B, H] to logits [B, L]; `token` maps [n, H] to [n, L]."""

    seq: Classifier
    token: Classifier
    num_labels: int


def _tensor(head: Mapping[str, torch.Tensor], name: str, architecture: str) -> torch.Tensor:
    if name not in head:
        raise ValueError(
            f"{architecture}: the checkpoint has no {name!r}; "
            f"head tensors given: {sorted(head) or 'none'}"
        )
    return head[name].float()


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Classifier:
    return lambda x: F.linear(x.float(), weight, bias)


def _llama_cpp_rank_head(architecture: str, head: Mapping[str, torch.Tensor]) -> ClassifierHead:
    """llama.cpp's rank head (llama-graph.cpp, build_pooling, RANK): the pooled state,
    then `cls` + tanh if present, then `cls.output` if present. Per token the same."""
    dense = out = None
    if "cls.weight" in head:
        dense = _linear(head["cls.weight"].float(), head.get("cls.bias"))
    if "cls.output.weight" in head:
        out = _linear(head["cls.output.weight"].float(), head.get("cls.output.bias"))
    last = head.get("cls.output.weight", head.get("cls.weight"))
    if last is None or last.dim() != 2:
        raise ValueError(f"{architecture}: the GGUF rank head has no 2-D cls / cls.output weight")

    def rank(x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        if dense is not None:
            y = torch.tanh(dense(y))
        return y if out is None else out(y)

    return ClassifierHead(seq=rank, token=rank, num_labels=int(last.shape[0]))


def build_classifier_head(
    architecture: str, hidden_size: int, head: Mapping[str, torch.Tensor]
) -> ClassifierHead:
    """The classifier for `architecture` from its head tensors (checkpoint names)."""
    if LLAMA_CPP_RANK_TENSORS & set(head):
        return _llama_cpp_rank_head(architecture, head)
    # "pooler.dense.*" without the "bert." prefix is accepted too.
    head = {k.removeprefix("bert."): v for k, v in head.items()}
    if architecture in BERT_SEQ_CLS_ARCHITECTURES:
        dense = _linear(
            _tensor(head, "pooler.dense.weight", architecture), head.get("pooler.dense.bias")
        )
        out_w = _tensor(head, "classifier.weight", architecture)
        out = _linear(out_w, head.get("classifier.bias"))
        return ClassifierHead(
            seq=lambda x: out(torch.tanh(dense(x))), token=out, num_labels=out_w.shape[0]
        )
    if architecture in ROBERTA_SEQ_CLS_ARCHITECTURES:
        dense = _linear(
            _tensor(head, "classifier.dense.weight", architecture),
            head.get("classifier.dense.bias"),
        )
        out_w = _tensor(head, "classifier.out_proj.weight", architecture)
        out = _linear(out_w, head.get("classifier.out_proj.bias"))

        def roberta(x: torch.Tensor) -> torch.Tensor:
            return out(torch.tanh(dense(x)))

        return ClassifierHead(seq=roberta, token=roberta, num_labels=out_w.shape[0])
    weight = _tensor(head, "score.weight", architecture)
    if weight.dim() != 2 or weight.shape[1] != hidden_size:
        raise ValueError(
            f"{architecture}: score.weight has shape {list(weight.shape)}, "
            f"expected [num_labels, {hidden_size}]"
        )
    score = _linear(weight, head.get("score.bias"))
    return ClassifierHead(seq=score, token=score, num_labels=weight.shape[0])
