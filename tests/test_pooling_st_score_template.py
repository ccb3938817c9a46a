"""LLM.score on a sentence-transformers CrossEncoder that saved a chat template (its
Transformer module takes `message` inputs): the pairs are rendered through the
tokenizer's template with the saved kwargs, as vLLM 0.33 does
(scoring/io_processor.py:496-525,720-724); `chat_template=` still wins. Scores equal
transformers on the rendered text (fp32, 1e-5)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

pytestmark = pytest.mark.slow

ATOL = 1e-5
WORDS = ["find", "pets", "query", "document", "cat", "dog", "sat", "on", "a", "mat", ":", "|"]
SAVED = (
    "{{ instruction }} : query "
    '{{ messages | selectattr("role", "eq", "query") | map(attribute="content") | first }} '
    '| document {{ messages | selectattr("role", "eq", "document") '
    '| map(attribute="content") | first }}'
)
EXPLICIT = "{{ messages[1].content }} {{ messages[0].content }}"


def _cross_encoder(root: Path) -> tuple[Any, Any]:
    root.mkdir()
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    tok = transformers.BertTokenizer(vocab={w: i for i, w in enumerate(vocab)})
    tok.chat_template = SAVED
    tok.save_pretrained(root)
    config_cls: Any = transformers.BertConfig  # num_labels is a PretrainedConfig kwarg
    cfg = config_cls(
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=1,
    )
    torch.manual_seed(0)
    model_cls: Any = transformers.BertForSequenceClassification
    model = model_cls(cfg).eval()
    model.save_pretrained(root)
    # What sentence-transformers 5+ saves for a CrossEncoder over `message` inputs.
    (root / "config_sentence_transformers.json").write_text(
        json.dumps({"model_type": "CrossEncoder"})
    )
    module = {
        "idx": 0,
        "name": "0",
        "path": "",
        "type": "sentence_transformers.base.modules.transformer.Transformer",
    }
    (root / "modules.json").write_text(json.dumps([module]))
    st_config = {
        "transformer_task": "sequence-classification",
        "modality_config": {"message": {"method": "forward", "method_output_name": "logits"}},
        "module_output_name": "scores",
        "processing_kwargs": {"chat_template": {"instruction": "find pets"}},
    }
    (root / "sentence_bert_config.json").write_text(json.dumps(st_config))
    return model, tok


def _reference(model: Any, tok: Any, template: str, query: str, doc: str, **kw: Any) -> float:
    messages = [{"role": "query", "content": query}, {"role": "document", "content": doc}]
    text = tok.apply_chat_template(messages, chat_template=template, tokenize=False, **kw)
    with torch.no_grad():
        logits = model(**tok(text, return_tensors="pt")).logits
    return float(torch.sigmoid(logits[0, 0]))


def test_llm_score_uses_the_saved_template_unless_one_is_given(tmp_path: Path) -> None:
    from paged.server.llm import LLM

    model, tok = _cross_encoder(tmp_path / "ce")
    query, docs = "cat", ["a cat sat on a mat", "dog"]
    saved = [_reference(model, tok, SAVED, query, d, instruction="find pets") for d in docs]
    explicit = [_reference(model, tok, EXPLICIT, query, d) for d in docs]
    llm = LLM(str(tmp_path / "ce"), kv_cache_memory_bytes=1 << 22)
    try:
        got_saved = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
        got_explicit = [
            o.outputs.score for o in llm.score(query, docs, use_tqdm=False, chat_template=EXPLICIT)
        ]
    finally:
        llm.shutdown()
    assert got_saved == pytest.approx(saved, abs=ATOL)
    assert got_explicit == pytest.approx(explicit, abs=ATOL)
