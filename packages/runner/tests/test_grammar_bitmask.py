"""`apply_grammar_bitmask`: packed int32 words -> -inf on exactly the disallowed tokens."""

from __future__ import annotations

import random

import pytest
import torch

from paged.runner.runner_output import apply_grammar_bitmask
from paged.scheduler.boundary import GrammarOutput

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _random_words(rng: random.Random, vocab: int, signed: bool) -> list[int]:
    words = [rng.getrandbits(32) for _ in range(-(-vocab // 32))]
    return [w - (1 << 32) if signed and w >= 1 << 31 else w for w in words]


def _allowed(words: list[int], vocab: int) -> list[bool]:
    return [bool((words[t // 32] >> (t % 32)) & 1) for t in range(vocab)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("signed", [True, False])
def test_mask_matches_a_per_bit_reference(device: str, signed: bool) -> None:
    rng = random.Random(3)
    vocab = 1000  # not a multiple of 32: the last word is partly padding
    ids = ["a", "b", "c", "d"]
    logits = torch.randn(4, vocab, device=device)
    original = logits.clone()
    masks = {"b": _random_words(rng, vocab, signed), "d": _random_words(rng, vocab, signed)}
    grammar = GrammarOutput(
        structured_output_request_ids=["d", "b", "zz"],  # order differs; "zz" not sampled here
        grammar_bitmask=[masks["d"], masks["b"], masks["b"]],
    )
    out = apply_grammar_bitmask(logits, ids, grammar).cpu()
    for row, rid in enumerate(ids):
        if rid not in masks:
            assert torch.equal(out[row], original[row].cpu())
            continue
        allowed = torch.tensor(_allowed(masks[rid], vocab))
        assert torch.equal(out[row][allowed], original[row].cpu()[allowed])
        assert torch.isneginf(out[row][~allowed]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_full_batch_in_order_and_first_row_per_request(device: str) -> None:
    vocab = 64
    only = [[1 << 5, 0], [0, 1 << 2]]  # row 0 allows token 5, row 1 token 34
    grammar = GrammarOutput(
        structured_output_request_ids=["x", "y", "y"], grammar_bitmask=[*only, [-1, -1]]
    )
    out = apply_grammar_bitmask(torch.zeros(2, vocab, device=device), ["x", "y"], grammar)
    assert torch.isfinite(out).sum(dim=1).tolist() == [1, 1]
    assert out.argmax(dim=1).tolist() == [5, 34]
