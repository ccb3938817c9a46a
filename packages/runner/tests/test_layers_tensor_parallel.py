"""Tensor parallelism: TP=2 over gloo on CPU gives TP=1's logits and greedy tokens."""

from __future__ import annotations

import importlib
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from paged.runner.layers.parallel import TPGroup

spawn: Any = mp.spawn  # type: ignore[attr-defined]  # untyped, not re-exported

TESTS_DIR = Path(__file__).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.mark.slow  # two spawned interpreters importing torch: ~1-2 min on 2 cores
def test_tp2_matches_tp1(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One checkpoint exercising every sharded piece: qkv bias, q/k norm, GQA,
    # the vocab-parallel embedding tied to the LM head, an odd (padded) vocab.
    monkeypatch.syspath_prepend(str(TESTS_DIR))
    worker = importlib.import_module("tp_worker_models")
    checkpoint = str(
        tiny_checkpoint("qwen3", vocab_size=127, tie_word_embeddings=True, attention_bias=True)
    )
    steps = 6
    expected = worker.greedy_with_cache(checkpoint, 0, 1, steps)
    out_file = str(tmp_path / "logits")
    spawn(
        worker.run,
        args=(2, _free_port(), checkpoint, out_file, steps),
        nprocs=2,
        join=True,
    )
    for rank in range(2):
        got = torch.load(str(tmp_path / f"logits.rank{rank}.pt"))
        assert got.shape == (steps + 1, 127)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_tp_group_validation() -> None:
    with pytest.raises(ValueError, match="tp_rank"):
        TPGroup(rank=2, size=2)
    with pytest.raises(ValueError, match="tp_size"):
        TPGroup(rank=0, size=0)
    with pytest.raises(ValueError, match="init_process_group"):
        TPGroup(rank=0, size=2)
    assert TPGroup().shard(3, "the KV heads") == (0, 3)
