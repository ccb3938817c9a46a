"""HF parity of the Llama-family model on tiny random checkpoints, driven through a paged cache.

Each family is saved with save_pretrained and loaded both by transformers and by
paged.runner.loader; paged runs with shuffled block ids, chunked prefills,
mixed prefill/decode batches and a preempted-then-recomputed request, and every
step's logits must match transformers' full recompute within 1e-4 (fp32), so
the greedy tokens are identical.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from paged.runner.config import ModelConfig
from paged.runner.loader import load_model

ATOL = 1e-4

FAMILY_CASES: list[tuple[str, dict[str, Any]]] = [
    ("llama", {}),
    ("llama", {"attention_bias": True, "mlp_bias": True}),
    ("llama_tied_scaled", {}),
    ("mistral", {"sliding_window": 8}),
    ("qwen2", {}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    ("qwen3", {}),
]
CASE_IDS = ["llama", "llama-bias", "llama3-rope-tied", "mistral-swa", "qwen2", "qwen2-swa", "qwen3"]


HFLogits = Callable[[Any, list[int]], torch.Tensor]


def _load(path: Path) -> Any:
    return load_model(ModelConfig.from_pretrained(str(path)), "cpu")


@pytest.mark.parametrize(("family", "overrides"), FAMILY_CASES, ids=CASE_IDS)
def test_chunked_prefill_logits_match_hf(
    tiny_checkpoint: Callable[..., Path],
    make_driver: Callable[..., Any],
    hf_logits: HFLogits,
    hf_model: Callable[[Path], Any],
    family: str,
    overrides: dict[str, Any],
) -> None:
    path = tiny_checkpoint(family, **overrides)
    model, hf = _load(path), hf_model(path)
    prompt = torch.randint(3, 128, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    driver = make_driver(model, block_size=4)
    driver.add("r", prompt)
    done = 0
    for chunk in (5, 1, 9, 8):  # chunks straddle block boundaries
        logits = driver.step([("r", chunk)])
        done += chunk
        ref = hf_logits(hf, prompt[:done])
        torch.testing.assert_close(logits[0], ref, atol=ATOL, rtol=0)


def _hf_greedy(
    hf_logits: HFLogits, hf: Any, prompt: list[int], steps: int
) -> tuple[list[int], list[torch.Tensor]]:
    tokens = list(prompt)
    all_logits = []
    for _ in range(steps):
        logits = hf_logits(hf, tokens)
        all_logits.append(logits)
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt) :], all_logits


@pytest.mark.parametrize(("family", "overrides"), FAMILY_CASES, ids=CASE_IDS)
def test_mixed_batch_greedy_matches_hf(
    tiny_checkpoint: Callable[..., Path],
    make_driver: Callable[..., Any],
    hf_logits: HFLogits,
    hf_model: Callable[[Path], Any],
    family: str,
    overrides: dict[str, Any],
) -> None:
    """Three requests over 34 steps: A decodes from step 0, B prefills in chunks
    alongside, C joins late; A is preempted (blocks freed) and recomputed."""
    path = tiny_checkpoint(family, **overrides)
    model, hf = _load(path), hf_model(path)
    gen = torch.Generator().manual_seed(2)
    prompts = {
        "A": torch.randint(3, 128, (6,), generator=gen).tolist(),
        "B": torch.randint(3, 128, (13,), generator=gen).tolist(),
        "C": torch.randint(3, 128, (3,), generator=gen).tolist(),
    }
    steps = 34
    expected = {r: _hf_greedy(hf_logits, hf, p, steps) for r, p in prompts.items()}
    driver = make_driver(model, num_blocks=64, block_size=4, seed=3)
    outputs: dict[str, list[int]] = {r: [] for r in prompts}
    start_step = {"A": 0, "B": 0, "C": 5}
    b_chunks = [4, 4, 5]  # B's prompt as a chunked prefill over three steps
    for step in range(steps + 8):
        schedule: list[tuple[str, int]] = []
        for r in prompts:
            if step < start_step[r] or len(outputs[r]) >= steps:
                continue
            if r not in driver.tokens:
                driver.add(r, prompts[r])
            remaining = len(driver.tokens[r]) - driver.computed[r]
            n = b_chunks.pop(0) if r == "B" and b_chunks else remaining
            schedule.append((r, n))
        if not schedule:
            break
        logits = driver.step(schedule)
        for row, (r, _) in enumerate(schedule):
            if driver.computed[r] < len(driver.tokens[r]):
                continue  # mid-prefill chunk: nothing sampled
            k = len(outputs[r])
            torch.testing.assert_close(logits[row], expected[r][1][k], atol=ATOL, rtol=0)
            token = int(logits[row].argmax())
            outputs[r].append(token)
            driver.tokens[r].append(token)
        if step == 12:
            # Preempt A: drop its cache; it resumes next step by recomputing everything.
            tokens_a = driver.tokens["A"]
            driver.free_request("A")
            driver.add("A", tokens_a)
    for r in prompts:
        assert outputs[r] == expected[r][0], r


def test_profile_run_without_cache_matches_hf(
    tiny_checkpoint: Callable[..., Path], hf_logits: HFLogits, hf_model: Callable[[Path], Any]
) -> None:
    """attn_metadata=None (profiling) attends causally over the call's tokens."""
    from paged.runner.attention.metadata import ForwardContext

    path = tiny_checkpoint("qwen3")
    model, hf = _load(path), hf_model(path)
    prompt = list(range(3, 20))
    with torch.no_grad():
        hidden = model.forward(
            torch.tensor(prompt), torch.arange(len(prompt)), ForwardContext(None, [])
        )
        logits = model.compute_logits(hidden[-1:])
    torch.testing.assert_close(logits[0], hf_logits(hf, prompt), atol=ATOL, rtol=0)


def test_logits_are_float32_of_true_vocab(tiny_checkpoint: Callable[..., Path]) -> None:
    model = _load(tiny_checkpoint("llama"))
    logits = model.compute_logits(torch.zeros(3, 64))
    assert logits.dtype == torch.float32
    assert logits.shape == (3, 128)
