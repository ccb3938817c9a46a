"""Spawn target for the TP=2 test (test_layers_tensor_parallel.py).

torch.multiprocessing.spawn pickles its target by module name, and test
modules are not importable by name under --import-mode=importlib, so the
worker lives here; the test puts this directory on sys.path, which spawn
passes on to the children.
"""

from __future__ import annotations

import random
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from paged.runner.attention.backends import AttentionMetadataBuilder
from paged.runner.attention.metadata import ForwardContext
from paged.runner.config import ModelConfig
from paged.runner.loader import load_model

BLOCK_SIZE = 4
NUM_BLOCKS = 32


def greedy_with_cache(checkpoint: str, tp_rank: int, tp_size: int, steps: int) -> torch.Tensor:
    """Prefill a fixed prompt in two chunks, then decode greedily; logits [steps + 1, V]."""
    model = load_model(ModelConfig.from_pretrained(checkpoint), "cpu", tp_rank, tp_size)
    attn = model.attention_layers()  # type: ignore[attr-defined]
    # Each rank really holds a shard: half the heads, half the (padded) vocabulary.
    hf = model.model_config.hf_config  # type: ignore[attr-defined]
    assert all(a.num_heads * tp_size == hf.num_attention_heads for a in attn)
    embed_rows = model.model.embed_tokens.weight.shape[0]  # type: ignore[attr-defined]
    assert embed_rows == -(-hf.vocab_size // tp_size)
    caches = [torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, a.num_kv_heads, a.head_size) for a in attn]
    blocks = list(range(NUM_BLOCKS))
    random.Random(7).shuffle(blocks)  # same order on every rank
    tokens = [5, 17, 99, 3, 42, 8, 61, 77, 12, 100, 4]
    chunks = [7, 4] + [1] * steps
    done = 0
    out = []
    builder = AttentionMetadataBuilder()
    for n in chunks:
        positions = list(range(done, done + n))
        slots = [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]
        width = -(-(done + n) // BLOCK_SIZE)
        metadata = builder.build(
            num_reqs=1,
            num_actual_tokens=n,
            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            seq_lens=torch.tensor([done + n], dtype=torch.int32),
            block_table=torch.tensor([blocks[:width]], dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            max_query_len=n,
            max_seq_len=done + n,
        )
        with torch.no_grad():
            hidden = model.forward(
                torch.tensor(tokens[done : done + n]),
                torch.tensor(positions),
                ForwardContext(metadata, caches),
            )
            logits = model.compute_logits(hidden[-1:])[0]
        done += n
        if done == len(tokens):
            out.append(logits)
            tokens.append(int(logits.argmax()))
    return torch.stack(out)


def run(rank: int, world_size: int, port: int, checkpoint: str, out_file: str, steps: int) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    try:
        logits = greedy_with_cache(checkpoint, rank, world_size, steps)
        torch.save(logits, str(Path(out_file).with_suffix(f".rank{rank}.pt")))
    finally:
        dist.destroy_process_group()
