"""N-gram proposer (vectorised) against a plain-Python reference; config parsing; adaptivity."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged.runner.spec_decode.adaptive import AdaptiveDrafting
from paged.runner.spec_decode.config import SpeculativeConfig, parse_speculative_config
from paged.runner.spec_decode.ngram import NgramProposer


def reference(seq: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """Longest n first; the most recent earlier occurrence; its followers (at most k)."""
    if k <= 0:
        return []
    for n in range(n_max, n_min - 1, -1):
        if len(seq) <= n:
            continue
        suffix = seq[-n:]
        for j in range(len(seq) - n - 1, -1, -1):
            if seq[j : j + n] == suffix:
                return seq[j + n : j + n + k]
    return []


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.integers(0, 5)),
        min_size=1,
        max_size=8,
    ),
    n_min=st.integers(1, 3),
    extra=st.integers(0, 2),
)
def test_ngram_matches_reference(rows: list[tuple[list[int], int]], n_min: int, extra: int) -> None:
    n_max = n_min + extra
    width = 48
    tokens = np.full((len(rows), width), -7, dtype=np.int32)  # junk past each row's end
    for r, (seq, _) in enumerate(rows):
        tokens[r, : len(seq)] = seq
    lengths = np.array([len(seq) for seq, _ in rows], dtype=np.int32)
    max_drafts = np.array([k for _, k in rows], dtype=np.int64)
    got = NgramProposer(n_min, n_max).propose(tokens, lengths, max_drafts)
    want = [reference(seq, n_min, n_max, k) for seq, k in rows]
    assert got == want


def test_ngram_copies_from_the_prompt() -> None:
    seq = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    tokens = np.array([seq], dtype=np.int32)
    out = NgramProposer(2, 3).propose(tokens, np.array([len(seq)]), np.array([4]))
    assert out == [[8, 9, 1, 2]]


def test_parse_vllm_keys_and_defaults() -> None:
    c = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = parse_speculative_config(
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    )
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    assert c.num_lookahead_tokens == 0
    c = parse_speculative_config({"model": "/m", "num_speculative_tokens": 3})
    assert c.method == "draft_model" and c.num_lookahead_tokens == 3


@pytest.mark.parametrize(
    ("value", "key"),
    [
        ("{not json", "speculative_config: not valid JSON"),
        ("[1]", "speculative_config: must be a JSON object"),
        ({"method": "eagle", "num_speculative_tokens": 1}, "speculative_config.method"),
        ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
        (
            {"method": "ngram", "num_speculative_tokens": 0},
            "speculative_config.num_speculative_tokens",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": "4"},
            "speculative_config.num_speculative_tokens",
        ),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "speculative_config.prompt_lookup_min",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0},
            "speculative_config.prompt_lookup_",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "model": "/m"},
            "speculative_config.model",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}, "speculative_config.bogus"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "acceptance_rate_threshold": 2},
            "speculative_config.acceptance_rate_threshold",
        ),
    ],
)
def test_errors_name_the_key(value: str | dict[str, object], key: str) -> None:
    with pytest.raises(ValueError, match=key.replace(".", r"\.").replace("(", r"\(")):
        parse_speculative_config(value)


def test_spec_config_direct_construction_is_validated() -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig("ngram", 0)


def test_adaptive_pauses_low_acceptance_and_probes_again() -> None:
    a = AdaptiveDrafting(threshold=0.3, backoff_steps=4)
    for _ in range(3):
        assert a.should_draft("r")
        a.record("r", 4, 0)
    assert a.should_draft("r")
    a.record("r", 4, 0)  # the 4th low step: paused for 4 steps
    assert [a.should_draft("r") for _ in range(5)] == [False] * 4 + [True]
    a.record("r", 4, 0)  # low again at the probe: paused twice as long
    assert [a.should_draft("r") for _ in range(9)] == [False] * 8 + [True]
    good = AdaptiveDrafting(threshold=0.3, backoff_steps=4)
    for _ in range(20):
        assert good.should_draft("g")
        good.record("g", 4, 3)
    off = AdaptiveDrafting(threshold=0.0, backoff_steps=4)
    for _ in range(10):
        off.record("x", 4, 0)
        assert off.should_draft("x")
