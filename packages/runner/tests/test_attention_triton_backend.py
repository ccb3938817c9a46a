"""The `triton` attention backend through the model, in Triton's CPU interpreter.

TRITON_INTERPRET must be set before triton defines its kernels, so the check
runs in a fresh interpreter. On a GPU the same backend is the CUDA default.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

SCRIPT = """
import sys, torch
from paged.runner.attention.backends import AttentionMetadataBuilder
from paged.runner.attention.metadata import ForwardContext
from paged.runner.config import ModelConfig
from paged.runner.loader import load_model

def run(backend):
    model = load_model(ModelConfig.from_pretrained(sys.argv[1], attention_backend=backend), "cpu")
    assert all(a.backend.name == backend for a in model.attention_layers())
    caches = [torch.zeros(2, 8, 4, a.num_kv_heads, a.head_size) for a in model.attention_layers()]
    # Request a: 6-token chunk in blocks [5, 2]; request b: 3-token prompt in block [7].
    md = AttentionMetadataBuilder().build(
        num_reqs=2, num_actual_tokens=9,
        query_start_loc=torch.tensor([0, 6, 9], dtype=torch.int32),
        seq_lens=torch.tensor([6, 3], dtype=torch.int32),
        block_table=torch.tensor([[5, 2], [7, 0]], dtype=torch.int32),
        slot_mapping=torch.tensor([20, 21, 22, 23, 8, 9, 28, 29, 30]),
        max_query_len=6, max_seq_len=6,
    )
    ids = torch.tensor([3, 4, 5, 6, 7, 8, 50, 51, 52])
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2])
    with torch.no_grad():
        return model.compute_logits(model.forward(ids, positions, ForwardContext(md, caches)))

diff = (run("torch") - run("triton")).abs().max().item()
print(diff)
assert diff < 1e-4, diff
"""


@pytest.mark.slow
def test_triton_backend_matches_torch_backend(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("qwen3")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
