"""Loading the model's tokenizer: a Hugging Face directory or a GGUF file.

`load_tokenizer()` is the only entry point. A GGUF file carries its own
tokenizer; transformers rebuilds it from the GGUF metadata, which costs ~8 s
of pure-Python parsing for a 49k-token vocabulary, so the rebuilt tokenizer is
saved once under a cache directory keyed by the file's path, size and mtime
and reloaded from there (well under a second) on later starts.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from paged.runner.default_model import default_model_path as default_model_path
from paged.runner.default_model import paged_cache_root

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@runtime_checkable
class TokenizerLike(Protocol):
    """The part of a Hugging Face tokenizer the frontend uses."""

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def all_special_ids(self) -> list[int]: ...

    def __len__(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


def resolve_tokenizer_source(model: str | os.PathLike[str] | None) -> tuple[Path, str | None]:
    """Map a model argument to (directory, gguf file name or None).

    `None` means the default model; a path to a `.gguf` file means that GGUF;
    a directory means a Hugging Face model directory.
    """
    path = default_model_path() if model is None else Path(model)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model: {path} is a file but not a .gguf file")
        return path.parent, path.name
    if path.is_dir():
        return path, None
    raise ValueError(f"model: {path} is neither a Hugging Face directory nor a .gguf file")


def _gguf_cache_dir(gguf_path: Path) -> Path:
    st = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return paged_cache_root() / "tokenizers" / f"{gguf_path.stem}-{digest}"


def load_tokenizer(
    model: str | os.PathLike[str] | None = None,
    *,
    tokenizer: str | os.PathLike[str] | None = None,
    use_cache: bool = True,
) -> Any:
    """Load the tokenizer for `model` (default model when None).

    `tokenizer` overrides where the tokenizer comes from (a directory or a
    GGUF file). Returns a transformers tokenizer (satisfies `TokenizerLike`).
    """
    from transformers import AutoTokenizer

    directory, gguf_file = resolve_tokenizer_source(tokenizer if tokenizer is not None else model)
    if gguf_file is None:
        return AutoTokenizer.from_pretrained(str(directory))
    gguf_path = directory / gguf_file
    cache_dir = _gguf_cache_dir(gguf_path) if use_cache else None
    if cache_dir is not None and (cache_dir / "tokenizer_config.json").is_file():
        try:
            return _with_default_chat_template(
                AutoTokenizer.from_pretrained(str(cache_dir)), gguf_path
            )
        except (OSError, ValueError) as e:  # a corrupt cache is rebuilt, never fatal
            logger.warning("ignoring unreadable tokenizer cache %s: %s", cache_dir, e)
    logger.info("building the tokenizer from %s (cached afterwards)", gguf_path)
    tok = _with_default_chat_template(_from_gguf(directory, gguf_file), gguf_path)
    if cache_dir is not None:
        _save_cache(tok, cache_dir)
    return tok


def tokenizer_directory(
    model: str | os.PathLike[str] | None = None,
    *,
    tokenizer: str | os.PathLike[str] | None = None,
) -> Path:
    """The Hugging Face tokenizer directory of `model` (default model when None).

    What load generators (aiperf, guidellm, `vllm bench`) take as their
    tokenizer: the model directory itself, or for a GGUF the directory paged
    saved the tokenizer it rebuilt from the file in (built now if absent).
    """
    directory, gguf_file = resolve_tokenizer_source(tokenizer if tokenizer is not None else model)
    if gguf_file is None:
        return directory
    cache_dir = _gguf_cache_dir(directory / gguf_file)
    if not (cache_dir / "tokenizer_config.json").is_file():
        load_tokenizer(directory / gguf_file)
    if not (cache_dir / "tokenizer_config.json").is_file():
        raise ValueError(f"tokenizer: could not save the GGUF's tokenizer in {cache_dir}")
    return cache_dir


def _from_gguf(directory: Path, gguf_file: str) -> Any:
    """transformers' tokenizer of a GGUF, or paged's for the `bert` files it cannot build."""
    from transformers import AutoTokenizer

    from paged.runner.loader.gguf_config import open_gguf
    from paged.server.gguf_bert_tokenizer import build_bert_gguf_tokenizer, is_bert_gguf_tokenizer

    reader = open_gguf(directory / gguf_file)
    if is_bert_gguf_tokenizer(reader):
        return build_bert_gguf_tokenizer(reader)
    return AutoTokenizer.from_pretrained(str(directory), gguf_file=gguf_file)


def _with_default_chat_template(tok: Any, gguf_path: Path) -> Any:
    """GGUFs without tokenizer.chat_template get their family's (paged.runner.models)."""
    if getattr(tok, "chat_template", None):
        return tok
    from paged.runner.loader.gguf_config import field_value, open_gguf
    from paged.runner.models.chat_templates import default_chat_template

    template = default_chat_template(str(field_value(open_gguf(gguf_path), "general.architecture")))
    if template is not None:
        tok.chat_template = template
    return tok


def _save_cache(tok: Any, cache_dir: Path) -> None:
    # Write to a temporary sibling and rename, so a concurrent reader never
    # sees half a cache.
    tmp = cache_dir.with_name(f"{cache_dir.name}.tmp{os.getpid()}")
    try:
        tok.save_pretrained(str(tmp))
        tmp.rename(cache_dir)
    except OSError as e:
        logger.warning("could not cache the tokenizer in %s: %s", cache_dir, e)
