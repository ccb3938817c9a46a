"""Shared fixtures for paged.runner tests: tiny random Hugging Face checkpoints.

`make_tiny_checkpoint(family, path, **overrides)` saves a 2-layer, hidden-64
model of the given family with random weights (seeded) into `path` and returns
the path; tests compare paged's model against transformers on it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from paged.kvcache import get_kv_cache_config
from paged.runner.executor import Executor
from paged.scheduler.boundary import CachedRequestData, NewRequestData, SchedulerOutput
from paged.scheduler.sampling_params import SamplingParams

TINY_BASE: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "tie_word_embeddings": False},
    "llama_tied_scaled": {
        "model_type": "llama",
        "tie_word_embeddings": True,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "mistral": {"model_type": "mistral", "sliding_window": None, "head_dim": 16},
    "qwen2": {"model_type": "qwen2", "tie_word_embeddings": True},
    "qwen3": {"model_type": "qwen3", "head_dim": 32, "tie_word_embeddings": False},
}


def make_tiny_checkpoint(family: str, path: Path, seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny random model of `family` (a FAMILIES key) to `path`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(FAMILIES[family])
    model_type = spec.pop("model_type")
    kwargs = {**TINY_BASE, **spec, **overrides}
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    auto: Any = AutoModelForCausalLM  # transformers' auto classes are untyped
    model = auto.from_config(config, dtype=torch.float32)
    # Random init leaves norms at 1 and biases at 0; perturb them so the
    # parity checks exercise every weight.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(str(path))
    return path


@pytest.fixture
def tiny_checkpoint(tmp_path: Path) -> Callable[..., Path]:
    """Factory fixture: tiny_checkpoint(family, **config_overrides) -> checkpoint dir."""
    counter = iter(range(1000))

    def build(family: str, seed: int = 0, **overrides: Any) -> Path:
        return make_tiny_checkpoint(
            family, tmp_path / f"{family}-{next(counter)}", seed=seed, **overrides
        )

    return build


class PagedDriver:
    """Drives a paged.runner model like a tiny scheduler + runner would.

    Owns per-layer KV caches ([2, num_blocks, block_size, Hkv, D]), hands out
    block ids in a shuffled order (so a request's blocks are not contiguous),
    and builds AttentionMetadata for a step given (request id, new tokens)
    pairs, so chunked prefills and decodes can be mixed in one batch.
    """

    def __init__(
        self, model: Any, *, num_blocks: int = 64, block_size: int = 4, seed: int = 0
    ) -> None:
        import random

        self.model = model
        self.block_size = block_size
        attn_layers = [layer.self_attn.attn for layer in model.model.layers]
        dtype = model.model_config.dtype
        self.kv_caches = [
            torch.zeros(2, num_blocks, block_size, a.num_kv_heads, a.head_size, dtype=dtype)
            for a in attn_layers
        ]
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tokens: dict[str, list[int]] = {}
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    def add(self, req_id: str, prompt: list[int]) -> None:
        self.tokens[req_id] = list(prompt)
        self.blocks[req_id] = []
        self.computed[req_id] = 0

    def free_request(self, req_id: str) -> None:
        self.free.extend(self.blocks.pop(req_id))
        del self.tokens[req_id], self.computed[req_id]

    def step(self, schedule: list[tuple[str, int]]) -> torch.Tensor:
        """Run one step; returns float32 logits [R, V] at each request's last new token."""
        from paged.runner.attention.backends import AttentionMetadataBuilder
        from paged.runner.attention.metadata import ForwardContext

        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        for req_id, n in schedule:
            start = self.computed[req_id]
            end = start + n
            assert end <= len(self.tokens[req_id])
            while len(self.blocks[req_id]) * self.block_size < end:
                self.blocks[req_id].append(self.free.pop())
            for pos in range(start, end):
                ids.append(self.tokens[req_id][pos])
                positions.append(pos)
                block = self.blocks[req_id][pos // self.block_size]
                slots.append(block * self.block_size + pos % self.block_size)
            starts.append(starts[-1] + n)
            seq_lens.append(end)
        width = max(len(self.blocks[r]) for r, _ in schedule)
        table = torch.zeros(len(schedule), width, dtype=torch.int32)
        for i, (req_id, _) in enumerate(schedule):
            row = self.blocks[req_id]
            table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
        metadata = AttentionMetadataBuilder().build(
            num_reqs=len(schedule),
            num_actual_tokens=len(ids),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=table,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            max_query_len=max(n for _, n in schedule),
            max_seq_len=max(seq_lens),
        )
        ctx = ForwardContext(metadata, self.kv_caches)
        with torch.no_grad():
            hidden = self.model.forward(
                torch.tensor(ids, dtype=torch.int64),
                torch.tensor(positions, dtype=torch.int64),
                ctx,
            )
            last = torch.tensor(starts[1:], dtype=torch.int64) - 1
            logits: torch.Tensor = self.model.compute_logits(hidden[last])
        for req_id, n in schedule:
            self.computed[req_id] += n
        return logits


def hf_last_logits(hf_model: Any, token_ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits at the last position of `token_ids` (full recompute)."""
    with torch.no_grad():
        out = hf_model(torch.tensor([token_ids]), use_cache=False)
    logits: torch.Tensor = out.logits[0, -1].float()
    return logits


def load_hf(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    auto: Any = AutoModelForCausalLM
    return auto.from_pretrained(str(path), dtype=torch.float32).eval()


# Test modules cannot import conftest under --import-mode=importlib, so the
# helpers above reach them as fixtures.
@pytest.fixture
def make_driver() -> Callable[..., PagedDriver]:
    """make_driver(model, num_blocks=64, block_size=4, seed=0) -> PagedDriver."""
    return PagedDriver


@pytest.fixture
def hf_logits() -> Callable[[Any, list[int]], torch.Tensor]:
    """hf_logits(hf_model, token_ids) -> float32 logits at the last position."""
    return hf_last_logits


@pytest.fixture
def hf_model() -> Callable[[Path], Any]:
    """hf_model(checkpoint_dir) -> transformers model in float32, eval mode."""
    return load_hf


def drive_greedy(
    executor: Executor, prompts: dict[str, list[int]], steps: int
) -> dict[str, list[int]]:
    """Prefill `prompts` in one step, then decode greedily `steps` times through `executor`."""
    kv = get_kv_cache_config(
        executor.get_kv_cache_specs(),
        executor.determine_available_memory(),
        num_gpu_blocks_override=64,
    )
    executor.initialize_from_config(kv)
    params = SamplingParams(temperature=0.0)
    blocks = {rid: list(range(1 + 16 * i, 1 + 16 * (i + 1))) for i, rid in enumerate(prompts)}
    new = [NewRequestData(rid, p, params, (blocks[rid],), 0) for rid, p in prompts.items()]
    so = SchedulerOutput(
        scheduled_new_reqs=new,
        num_scheduled_tokens={rid: len(p) for rid, p in prompts.items()},
        total_num_scheduled_tokens=sum(len(p) for p in prompts.values()),
    )
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    for _ in range(steps):
        assert executor.execute_model(so) is None
        result = executor.sample_tokens(None)
        for rid, toks in zip(result.req_ids, result.sampled_token_ids, strict=True):
            out[rid].extend(toks)
        ids = list(prompts)
        so = SchedulerOutput(
            scheduled_cached_reqs=CachedRequestData(
                ids,
                [False] * len(ids),
                [[] for _ in ids],
                [None] * len(ids),
                [len(prompts[r]) + len(out[r]) - 1 for r in ids],
                [len(out[r]) for r in ids],
            ),
            num_scheduled_tokens=dict.fromkeys(ids, 1),
            total_num_scheduled_tokens=len(ids),
        )
    return out


@pytest.fixture
def executor_greedy() -> Callable[..., dict[str, list[int]]]:
    """`drive_greedy` (executor tests of both backends share it)."""
    return drive_greedy
