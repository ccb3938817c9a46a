"""Turning the engine's `LogprobsLists` into per-position `Logprob` dicts."""

from __future__ import annotations

from paged.scheduler import LogprobsLists
from paged.server.outputs import Logprob, PositionLogprobs, PromptLogprobs, SampleLogprobs
from paged.server.tokenizer import TokenizerLike


def decode_token(tokenizer: TokenizerLike | None, token_id: int) -> str | None:
    """The text of one token on its own (a partial character shows as U+FFFD)."""
    if tokenizer is None:
        return None
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _position(
    tokenizer: TokenizerLike | None, ids: list[int], lps: list[float], rank: int, num_top: int
) -> PositionLogprobs:
    # Column 0 is the chosen token, columns 1.. the top alternatives.
    out: PositionLogprobs = {ids[0]: Logprob(lps[0], rank, decode_token(tokenizer, ids[0]))}
    for j in range(1, min(len(ids), num_top + 1)):
        if ids[j] not in out:
            out[ids[j]] = Logprob(lps[j], j, decode_token(tokenizer, ids[j]))
    return out


class LogprobsProcessor:
    """Accumulates sample and prompt logprobs for one request (seed: LogprobsProcessor)."""

    def __init__(
        self, tokenizer: TokenizerLike | None, num_logprobs: int | None, num_prompt: int | None
    ) -> None:
        self._tokenizer = tokenizer
        self.num_logprobs = num_logprobs
        self.num_prompt_logprobs = num_prompt
        self.logprobs: SampleLogprobs | None = [] if num_logprobs is not None else None
        self.prompt_logprobs: PromptLogprobs | None = None if num_prompt is None else [None]
        self.cumulative_logprob: float | None = 0.0 if num_logprobs is not None else None

    def update_sample(self, lists: LogprobsLists | None) -> None:
        if lists is None or self.logprobs is None or self.num_logprobs is None:
            return
        for ids, lps, rank in zip(lists.token_ids, lists.logprobs, lists.ranks, strict=True):
            self.logprobs.append(_position(self._tokenizer, ids, lps, rank, self.num_logprobs))
            assert self.cumulative_logprob is not None
            self.cumulative_logprob += lps[0]

    def update_prompt(self, lists: LogprobsLists | None) -> None:
        if lists is None or self.prompt_logprobs is None or self.num_prompt_logprobs is None:
            return
        n = self.num_prompt_logprobs
        for ids, lps, rank in zip(lists.token_ids, lists.logprobs, lists.ranks, strict=True):
            self.prompt_logprobs.append(_position(self._tokenizer, ids, lps, rank, n))

    def truncate(self, num_tokens: int) -> None:
        """Drop positions past `num_tokens` (tokens cut by a stop string)."""
        if self.logprobs is None or len(self.logprobs) <= num_tokens:
            return
        del self.logprobs[num_tokens:]
        self.cumulative_logprob = sum(
            next(iter(pos.values())).logprob for pos in self.logprobs if pos
        )
