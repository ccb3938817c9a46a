"""N-gram (prompt lookup) proposer, vectorised over the batch.

For each request, the last n tokens of its sequence (prompt + output) are
looked for earlier in the same sequence; the tokens that followed the most
recent earlier occurrence are the drafts. The longest n in
[prompt_lookup_min, prompt_lookup_max] that matches wins (as vLLM).

The search is numpy over a [R, L] token matrix: one shifted equality per
n-gram position, so the Python-level work is O(n_max^2) array operations per
step, independent of the batch size and of the sequence lengths:

    tokens    a b c d a b c ?          L_r = 7 known tokens, suffix n=3 "a b c"
    starts j  0 1 2 3                   j + n <= L_r - 1 (an occurrence before the suffix)
    match     1 0 0 0                   tok[j+i] == suffix[i] for i < n, ANDed
    drafts    tok[j+n : j+n+k] = "d a b ..." (at most L_r - (j+n) known followers)
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt


class NgramProposer:
    """Stateless prompt-lookup drafting for a batch of token rows."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                "prompt_lookup_min/max: need 1 <= min <= max, got "
                f"{prompt_lookup_min}, {prompt_lookup_max}"
            )
        self.n_min = prompt_lookup_min
        self.n_max = prompt_lookup_max

    def propose(
        self,
        tokens: npt.NDArray[np.integer],
        num_tokens: npt.NDArray[np.integer],
        max_drafts: npt.NDArray[np.integer],
    ) -> list[list[int]]:
        """Drafts per row: `tokens[r, :num_tokens[r]]` is row r's sequence.

        `max_drafts[r]` caps row r's drafts (0: none). A row with no match gets [].
        """
        return self.propose_with_match_len(tokens, num_tokens, max_drafts)[0]

    def propose_with_match_len(
        self,
        tokens: npt.NDArray[np.integer],
        num_tokens: npt.NDArray[np.integer],
        max_drafts: npt.NDArray[np.integer],
    ) -> tuple[list[list[int]], list[int]]:
        """`propose`, plus the length of each row's winning n-gram (0: no match)."""
        num_rows = len(num_tokens)
        if num_rows == 0:
            return [], []
        lengths = num_tokens.astype(np.int64)
        width = int(lengths.max())
        tok = tokens[:, :width]
        follower_start = np.full(num_rows, -1, dtype=np.int64)
        match_len = np.zeros(num_rows, dtype=np.int64)
        pending = max_drafts > 0
        for n in range(self.n_max, self.n_min - 1, -1):
            eligible = np.flatnonzero(pending & (lengths > n))
            if len(eligible) == 0:
                continue
            starts = self._last_match(tok[eligible], lengths[eligible], n)
            found = starts >= 0
            follower_start[eligible[found]] = starts[found] + n
            match_len[eligible[found]] = n
            pending[eligible[found]] = False
        drafts: list[list[int]] = []
        for r, start in enumerate(follower_start.tolist()):
            if start < 0:
                drafts.append([])
                continue
            end = min(start + int(max_drafts[r]), int(lengths[r]))
            drafts.append(tok[r, start:end].tolist())
        return drafts, match_len.tolist()

    @staticmethod
    def _last_match(
        tok: npt.NDArray[np.integer], lengths: npt.NDArray[np.int64], n: int
    ) -> npt.NDArray[np.int64]:
        """Start of the most recent earlier occurrence of each row's last n tokens (-1: none)."""
        rows = np.arange(len(lengths))
        suffix = tok[rows[:, None], lengths[:, None] - n + np.arange(n)]  # [E, n]
        num_starts = tok.shape[1] - n  # j + n <= L - 1 for the longest row
        if num_starts <= 0:
            return np.full(len(lengths), -1, dtype=np.int64)
        match = tok[:, :num_starts] == suffix[:, :1]
        for i in range(1, n):
            match &= tok[:, i : num_starts + i] == suffix[:, i : i + 1]
        match &= np.arange(num_starts)[None, :] <= (lengths - n - 1)[:, None]
        has = match.any(axis=1)
        last = num_starts - 1 - np.argmax(match[:, ::-1], axis=1)
        return np.where(has, last, -1).astype(np.int64)
