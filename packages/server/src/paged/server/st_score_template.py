"""A score template the model brings: a sentence-transformers CrossEncoder's (read as
vLLM 0.33 reads it), or a llama.cpp reranker GGUF's rerank prompt.

sentence-transformers (5.x) saves a CrossEncoder whose Transformer module takes
`message` inputs with `processing_kwargs.chat_template` in its
`sentence_bert_config.json`; it then formats each pair as the messages
`{"role": "query"}`, `{"role": "document"}` through the tokenizer's chat template.
vLLM 0.33 does the same when no score template is given explicitly:

- vllm/transformers_utils/config.py:1371-1446 (`get_sentence_transformers_chat_template_kwargs`):
  only when `config_sentence_transformers.json` says `model_type: CrossEncoder`,
  `modules.json` holds one Transformer module at the root (no `path`), and
  `sentence_bert_config.json` has `transformer_task: sequence-classification` and a
  `modality_config` with `message`. `processing_kwargs.chat_template` must be an
  object (its `chat_template` key a string naming the template), `restore_suffix` is
  dropped, `tokenize` / `tools` are refused.
- vllm/entrypoints/pooling/scoring/io_processor.py:463-475, 496-525: the named template
  (`"default"` or none: the tokenizer's default) comes from the tokenizer; a missing one
  is an error at start-up unless a template was given explicitly, which always wins
  (:720-724); the saved kwargs are the defaults under the request's
  `chat_template_kwargs` (vllm/renderers/params.py:38-50, `merge_kwargs`: request
  values other than None / "auto" win).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# vllm/transformers_utils/config.py:92-95.
_ST_TRANSFORMER_MODULE_TYPES = frozenset(
    {
        "sentence_transformers.models.Transformer",
        "sentence_transformers.base.modules.transformer.Transformer",
    }
)


@dataclass(frozen=True)
class SavedScoreTemplate:
    """The template text a CrossEncoder saved, and the kwargs it renders with."""

    template: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_st_chat_template_kwargs(model_dir: str | Path | None) -> dict[str, Any] | None:
    """The saved `processing_kwargs.chat_template` (possibly empty), or None when the
    directory is not a `message`-input CrossEncoder. ValueError for settings vLLM refuses."""
    if model_dir is None or not Path(model_dir).is_dir():
        return None
    root = Path(model_dir)
    st_config = _read_json(root / "config_sentence_transformers.json")
    if not isinstance(st_config, dict) or st_config.get("model_type") != "CrossEncoder":
        return None
    modules = _read_json(root / "modules.json")
    if isinstance(modules, dict):
        modules = modules.get("modules")
    transformer = _read_json(root / "sentence_bert_config.json")
    if not (
        isinstance(modules, list)
        and len(modules) == 1
        and isinstance(modules[0], dict)
        and modules[0].get("type") in _ST_TRANSFORMER_MODULE_TYPES
        and not modules[0].get("path")
        and isinstance(transformer, dict)
        and transformer.get("transformer_task") == "sequence-classification"
        and isinstance(transformer.get("modality_config"), dict)
        and "message" in transformer["modality_config"]
    ):
        return None
    processing = transformer.get("processing_kwargs") or {}
    kwargs = processing.get("chat_template") or {} if isinstance(processing, dict) else None
    if not isinstance(kwargs, dict):
        raise ValueError(
            "The Sentence Transformers processing_kwargs.chat_template must be a JSON object."
        )
    kwargs = dict(kwargs)
    kwargs.pop("restore_suffix", None)  # vLLM does not restore the suffix after truncation
    if not isinstance(kwargs.get("chat_template", ""), str):
        raise ValueError("The Sentence Transformers chat template name must be a string.")
    reserved = sorted({"tokenize", "tools"} & kwargs.keys())
    if reserved:
        raise ValueError(f"Unsupported Sentence Transformers chat template settings: {reserved}")
    return kwargs


def _named_template(tokenizer: Any, name: str | None) -> str | None:
    """The tokenizer's template called `name` (None: its default), as transformers picks it."""
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):
        found = own.get(name or "default")
        return found if isinstance(found, str) else None
    return own if name is None and isinstance(own, str) else None


def saved_score_template(
    model_dir: str | Path | None, tokenizer: Any, *, explicit: str | None = None
) -> SavedScoreTemplate | None:
    """The CrossEncoder's saved score template, or None.

    A bad or missing saved template is a ValueError, unless `explicit` (the
    user's --chat-template) is given: it takes precedence anyway.
    """
    try:
        kwargs = read_st_chat_template_kwargs(model_dir)
        if kwargs is None:
            return None
        name = kwargs.pop("chat_template", None)
        if name == "default":
            name = None
        template = _named_template(tokenizer, name)
        if template is None:
            raise ValueError(
                "The Sentence Transformers config declares message inputs, but the "
                f"checkpoint has no {name or 'default'!r} chat template."
            )
    except ValueError:
        if explicit is None:
            raise
        return None
    return SavedScoreTemplate(template, kwargs)


def llama_cpp_rerank_template(prompt: str) -> str:
    """A GGUF reranker's `tokenizer.chat_template.rerank` as a score template.

    llama.cpp substitutes the query and the document for `{query}` / `{document}` in
    that text (tools/server/server-common.cpp, format_prompt_rerank); here the rest of
    the text becomes Jinja string literals (JSON-escaped, which Jinja reads the same),
    so nothing in it is taken for template syntax or trimmed by transformers'
    `trim_blocks`, and the placeholders the messages' contents.
    """
    fields = {
        "{query}": "{{ messages[0].content }}",
        "{document}": "{{ messages[1].content }}",
    }
    parts = re.split(r"(\{query\}|\{document\})", prompt)
    return "".join(fields.get(p, "{{ " + json.dumps(p) + " }}") for p in parts if p)


def score_template_for(
    explicit: str | None,
    saved: SavedScoreTemplate | None,
    request_kwargs: Mapping[str, Any] | None,
) -> tuple[str | None, Mapping[str, Any] | None]:
    """(template, kwargs) one score request renders with: the explicit template and the
    request's kwargs; else the saved template, the request's kwargs over the saved ones."""
    if explicit is not None or saved is None:
        return explicit, request_kwargs
    merged = dict(saved.kwargs)
    merged.update({k: v for k, v in (request_kwargs or {}).items() if v not in (None, "auto")})
    return saved.template, merged
