"""`RequestGrammar`: one request's grammar state, with vLLM's `StructuredOutputGrammar` API.

    accept_tokens(tokens)    advance; False if a token breaks the grammar (state unchanged by it)
    validate_tokens(tokens)  how many leading tokens the grammar would accept (state unchanged)
    rollback(n)              undo the last n accepted tokens (speculative drafts)
    is_terminated()          the grammar is complete: only EOS may follow

A finished grammar's mask allows only the EOS tokens, and llguidance then
refuses to consume EOS ("parser stopped"). EOS is what we asked for, so it
is accepted here without touching the matcher, and counted, so that a
rollback over it stays exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance


class RequestGrammar:
    """One request's position in its grammar (an `LLMatcher` copied from the compiled template)."""

    __slots__ = ("_eos_after_stop", "_num_processed", "eos_token_ids", "matcher")

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids: frozenset[int]) -> None:
        self.matcher = matcher
        self.eos_token_ids = eos_token_ids
        self._num_processed = 0  # tokens accepted and not rolled back
        # EOS tokens accepted after the grammar stopped (not consumed by the matcher).
        self._eos_after_stop = 0

    @property
    def num_processed_tokens(self) -> int:
        return self._num_processed

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_stopped())

    def accept_tokens(self, tokens: Sequence[int]) -> bool:
        """Advance over `tokens`; at the first one the grammar refuses, stop and return False."""
        for token in tokens:
            if self.matcher.is_stopped():
                if token not in self.eos_token_ids:
                    return False
                self._eos_after_stop += 1
            elif not self.matcher.consume_token(token):
                return False
            self._num_processed += 1
        return not self.matcher.is_error()

    def validate_tokens(self, tokens: Sequence[int]) -> int:
        """Length of the longest prefix of `tokens` the grammar accepts; the state does not move.

        The scheduler truncates a request's draft tokens to this prefix, so a
        draft the grammar forbids is never verified (vLLM does the same).
        """
        if not tokens:
            return 0
        if self.matcher.is_stopped():
            n = 0
            while n < len(tokens) and tokens[n] in self.eos_token_ids:
                n += 1
            return n
        n = int(self.matcher.validate_tokens(list(tokens)))
        if n < len(tokens) and n > 0:
            # llguidance stops at a token that completes the grammar; EOS may follow it.
            probe = self.matcher.deep_copy()
            probe.consume_tokens(list(tokens[:n]))
            while probe.is_stopped() and n < len(tokens) and tokens[n] in self.eos_token_ids:
                n += 1
        return n

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (ValueError beyond what was accepted)."""
        if num_tokens < 0 or num_tokens > self._num_processed:
            raise ValueError(
                f"num_tokens must be in [0, {self._num_processed}] (tokens accepted), "
                f"got {num_tokens}"
            )
        from_eos = min(num_tokens, self._eos_after_stop)
        self._eos_after_stop -= from_eos
        if num_tokens - from_eos:
            self.matcher.rollback(num_tokens - from_eos)
        self._num_processed -= num_tokens
