"""From `--speculative-config` to the runner's `SpeculativeConfig`, draft model resolved.

The draft model is loaded with the target's dtype, device and max_model_len
(its positions are the target's) and must share the target's tokenizer:
checked here, at start-up, before any weights load. The check compares what
both models declare (vocabulary size, EOS and BOS ids) and, when both come
with tokenizer files, the two vocabularies themselves.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from paged.runner.config import ModelConfig
    from paged.runner.spec_decode import SpeculativeConfig

logger = logging.getLogger(__name__)


def resolve_speculative_config(
    value: str | dict[str, Any] | None, target: ModelConfig
) -> SpeculativeConfig | None:
    """Parse and validate; a `ValueError` names the offending key."""
    if value is None:
        return None
    from paged.runner.config import ModelConfig
    from paged.runner.spec_decode import parse_speculative_config

    config = parse_speculative_config(value)
    if config.method != "draft_model":
        return config
    assert config.model is not None
    try:
        draft = ModelConfig.from_pretrained(
            config.model,
            dtype=target.dtype,
            max_model_len=target.max_model_len,
            device=target.device,
            attention_backend=target.attention_backend,
            enforce_eager=True,  # the draft runs eagerly (no CUDA graphs of its own)
            cpu_weight_panels=target.cpu_weight_panels,
        )
    except ValueError as e:
        raise ValueError(f"speculative_config.model: {e}") from None
    check_same_tokenizer(target, draft)
    return dataclasses.replace(config, draft_model_config=draft)


def check_same_tokenizer(target: ModelConfig, draft: ModelConfig) -> None:
    """Raise `ValueError` when the draft cannot share the target's token ids."""
    for what, a, b in (
        ("vocabulary size", target.vocab_size, draft.vocab_size),
        ("EOS token ids", target.eos_token_ids, draft.eos_token_ids),
        ("BOS token id", target.bos_token_id, draft.bos_token_id),
    ):
        if a != b:
            raise ValueError(
                f"speculative_config.model: the draft model's {what} ({b}) differs from the "
                f"target's ({a}); a draft model must use the target's tokenizer"
            )
    if target.weights_path == draft.weights_path:
        return
    target_vocab, draft_vocab = _vocab(target), _vocab(draft)
    if target_vocab is None or draft_vocab is None:
        logger.info("draft tokenizer check: no tokenizer files on one side; ids and size agree")
        return
    if target_vocab != draft_vocab:
        differing = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()))[:3]
        raise ValueError(
            "speculative_config.model: the draft model's tokenizer differs from the target's "
            f"(e.g. {differing}); a draft model must use the target's tokenizer"
        )


def _vocab(config: ModelConfig) -> dict[str, int] | None:
    from paged.server.tokenizer import load_tokenizer

    source = str(config.weights_path) if config.gguf_file is not None else config.tokenizer
    try:
        tok = load_tokenizer(source)
    except (OSError, ValueError, TypeError) as e:
        logger.debug("no tokenizer for %s: %s", source, e)
        return None
    vocab: dict[str, int] = tok.get_vocab()
    return vocab
