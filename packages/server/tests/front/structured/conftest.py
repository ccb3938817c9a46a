"""Fixtures: a tiny random Llama with a real byte-level BPE tokenizer, loaded by `LLM`.

Random weights emit garbage, which is the point: the grammar must hold for
any model, so validity tests run on this (fast) model, not on a trained one.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Path:
    """The front tests' 400-token BPE tokenizer with a random one-layer Llama."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tokenizer
    path = tmp_path_factory.mktemp("tiny_so_llama")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_dir: Path) -> Iterator[Any]:
    from paged.server import LLM

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = LLM(str(tiny_model_dir), max_model_len=1024, kv_cache_memory_bytes=1 << 24)
    yield llm
    torch.set_num_threads(previous)
