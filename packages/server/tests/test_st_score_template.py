"""A sentence-transformers CrossEncoder's saved score template, read as vLLM 0.33 reads it
(vllm/transformers_utils/config.py:1371-1446, scoring/io_processor.py:463-525,720-724)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from paged.server.st_score_template import (
    SavedScoreTemplate,
    llama_cpp_rerank_template,
    read_st_chat_template_kwargs,
    saved_score_template,
    score_template_for,
)

PAIR_TEMPLATE = "{{ instruction }}|{{ messages[0].content }}|{{ messages[1].content }}"


class _Tokenizer:
    def __init__(self, chat_template: str | dict[str, str] | None) -> None:
        self.chat_template = chat_template


def _cross_encoder(
    root: Path,
    chat_template_kwargs: Any = None,
    *,
    model_type: str = "CrossEncoder",
    modality: str = "message",
    module_path: str = "",
) -> Path:
    root.mkdir(exist_ok=True)
    (root / "config_sentence_transformers.json").write_text(json.dumps({"model_type": model_type}))
    module = {
        "idx": 0,
        "name": "0",
        "path": module_path,
        "type": "sentence_transformers.base.modules.transformer.Transformer",
    }
    (root / "modules.json").write_text(json.dumps([module]))
    config: dict[str, Any] = {
        "transformer_task": "sequence-classification",
        "modality_config": {modality: {"method": "forward", "method_output_name": "logits"}},
        "module_output_name": "scores",
    }
    if chat_template_kwargs is not None:
        config["processing_kwargs"] = {"chat_template": chat_template_kwargs}
    (root / "sentence_bert_config.json").write_text(json.dumps(config))
    return root


def test_only_a_message_cross_encoder_saves_a_template(tmp_path: Path) -> None:
    assert read_st_chat_template_kwargs(None) is None
    assert read_st_chat_template_kwargs(tmp_path) is None  # no sentence-transformers files
    embedder = _cross_encoder(tmp_path / "a", {}, model_type="SentenceTransformer")
    text_only = _cross_encoder(tmp_path / "b", {}, modality="text")
    in_subdir = _cross_encoder(tmp_path / "c", {}, module_path="0_Transformer")
    for root in (embedder, text_only, in_subdir):
        assert read_st_chat_template_kwargs(root) is None
        assert saved_score_template(root, _Tokenizer(PAIR_TEMPLATE)) is None
    saved = _cross_encoder(tmp_path / "d", {"instruction": "rank", "restore_suffix": True})
    assert read_st_chat_template_kwargs(saved) == {"instruction": "rank"}
    got = saved_score_template(saved, _Tokenizer(PAIR_TEMPLATE))
    assert got == SavedScoreTemplate(PAIR_TEMPLATE, {"instruction": "rank"})


def test_the_named_template_comes_from_the_tokenizer(tmp_path: Path) -> None:
    root = _cross_encoder(tmp_path / "m", {"chat_template": "rerank", "instruction": "x"})
    named = _Tokenizer({"default": "plain", "rerank": PAIR_TEMPLATE})
    assert saved_score_template(root, named) == SavedScoreTemplate(
        PAIR_TEMPLATE, {"instruction": "x"}
    )
    default = _cross_encoder(tmp_path / "d", {"chat_template": "default"})
    assert saved_score_template(default, named) == SavedScoreTemplate("plain", {})
    # A missing template is vLLM's start-up error, unless a template is given explicitly.
    with pytest.raises(ValueError, match="has no 'rerank' chat template"):
        saved_score_template(root, _Tokenizer(PAIR_TEMPLATE))
    with pytest.raises(ValueError, match="has no 'default' chat template"):
        saved_score_template(default, _Tokenizer(None))
    assert saved_score_template(root, _Tokenizer(None), explicit="{{ x }}") is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (["not", "an", "object"], "must be a JSON object"),
        ({"chat_template": 3}, "name must be a string"),
        (
            {"tokenize": True},
            r"Unsupported Sentence Transformers chat template settings: \['tokenize'\]",
        ),
        ({"tools": []}, r"\['tools'\]"),
    ],
)
def test_unsupported_saved_settings_are_refused(tmp_path: Path, kwargs: Any, message: str) -> None:
    root = _cross_encoder(tmp_path / "m", kwargs)
    with pytest.raises(ValueError, match=message):
        saved_score_template(root, _Tokenizer(PAIR_TEMPLATE))


def test_explicit_template_wins_and_request_kwargs_override_saved_ones() -> None:
    saved = SavedScoreTemplate(PAIR_TEMPLATE, {"instruction": "saved", "keep": 1})
    assert score_template_for("{{ x }}", saved, {"a": 1}) == ("{{ x }}", {"a": 1})
    assert score_template_for(None, None, {"a": 1}) == (None, {"a": 1})
    template, kwargs = score_template_for(None, saved, {"instruction": "mine", "keep": None})
    # vLLM's merge_kwargs: request values other than None / "auto" win.
    assert (template, kwargs) == (PAIR_TEMPLATE, {"instruction": "mine", "keep": 1})
    assert score_template_for(None, saved, None) == (PAIR_TEMPLATE, dict(saved.kwargs))


def test_llama_cpp_rerank_prompt_renders_verbatim() -> None:
    """A GGUF reranker's prompt: {query} / {document} substituted, every other character kept
    (quotes, braces, Jinja-looking text, newlines that trim_blocks would eat after a tag)."""
    import transformers

    bert: Any = transformers.BertTokenizer
    tok = bert(vocab={"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4})
    prompt = 'Judge "yes" or {no} {{ x }} {% raw %}\n<Query>: {query}\n<Document>: {document}\n'
    messages = [{"role": "query", "content": "q {x}"}, {"role": "document", "content": "d é"}]
    text = tok.apply_chat_template(
        messages, chat_template=llama_cpp_rerank_template(prompt), tokenize=False
    )
    assert text == prompt.replace("{query}", "q {x}").replace("{document}", "d é")
