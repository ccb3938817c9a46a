"""Where the thinking ends, seen from the engine: the grammar starts there.

vLLM 0.33 (v1/structured_output/__init__.py:284-365, accept_tokens :533-553)
leaves a constrained request's sampling free while it reasons and advances
its grammar only with the tokens after the end-of-think token; with
`--structured-outputs-config '{"enable_in_reasoning": true}'` the grammar
applies from the first token (:300). vLLM finds the end by token id and
refuses a tokenizer without think tokens (reasoning/basic_parsers.py:61-67);
paged uses the id when the tag is one token of the vocabulary and otherwise
the decoded text of each token, so a model that writes `</think>` as several
ordinary tokens works too.

`ReasoningEndDetector` is the tokenizer-bound part (one per engine);
`ReasoningGate` the state of one request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from paged.server.reasoning.parser import ReasoningSpec

if TYPE_CHECKING:
    from paged.server.tokenizer import TokenizerLike

# Prompt tokens decoded to find the last tag (text mode): a turn's header is far shorter.
_PROMPT_TAIL_TOKENS = 256


def _single_token_id(tokenizer: TokenizerLike, tag: str) -> int | None:
    """The id of `tag` if the vocabulary holds it as one token, else None."""
    ids = tokenizer.encode(tag, add_special_tokens=False)
    if len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=False) == tag:
        return ids[0]
    return None


class ReasoningEndDetector:
    """Finds the end of the thinking in token ids, by id or by decoded text."""

    def __init__(self, spec: ReasoningSpec, tokenizer: TokenizerLike) -> None:
        self.spec = spec
        self._tokenizer = tokenizer
        self.start_id = _single_token_id(tokenizer, spec.start_tag)
        self.end_id = _single_token_id(tokenizer, spec.end_tag)

    @property
    def by_token_id(self) -> bool:
        """True when the tags are dedicated tokens (vLLM's only mode)."""
        return self.start_id is not None and self.end_id is not None

    def prompt_tag(self, prompt_token_ids: Sequence[int]) -> bool | None:
        """What the prompt's last tag says: True the thinking ended, False it is open,
        None the prompt has no tag (as vLLM's `is_reasoning_end`, basic_parsers.py:71-80,
        which scans the prompt back to the last start or end token)."""
        if self.by_token_id:
            for token in reversed(prompt_token_ids):
                if token == self.start_id:
                    return False
                if token == self.end_id:
                    return True
            return None
        tail = list(prompt_token_ids[-_PROMPT_TAIL_TOKENS:])
        text = self._tokenizer.decode(tail, skip_special_tokens=False)
        start, end = text.rfind(self.spec.start_tag), text.rfind(self.spec.end_tag)
        if start < 0 and end < 0:
            return None
        return end > start

    def prompt_ends_reasoning(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether generation starts in the answer: the prompt's last tag decides; with
        no tag, deepseek_r1 and qwen3 start thinking, the generic parser in the answer."""
        tag = self.prompt_tag(prompt_token_ids)
        return tag if tag is not None else not self.spec.starts_in_reasoning

    def gate(self, prompt_token_ids: Sequence[int], reasoning_ended: bool | None) -> ReasoningGate:
        """A request's gate; `reasoning_ended` from the frontend wins over the prompt check."""
        ended = (
            reasoning_ended
            if reasoning_ended is not None
            else self.prompt_ends_reasoning(prompt_token_ids)
        )
        return ReasoningGate(self, ended)

    def end_offset(self, token_ids: Sequence[int], tail: str) -> tuple[int | None, str]:
        """(index of the token that completes the end tag or None, the new text tail).

        `tail` is the end of the text decoded so far, long enough to catch a
        tag split across tokens (text mode only).
        """
        if self.end_id is not None:
            for i, token in enumerate(token_ids):
                if token == self.end_id:
                    return i, ""
            return None, ""
        tag = self.spec.end_tag
        for i, token in enumerate(token_ids):
            tail += self._tokenizer.decode([token], skip_special_tokens=False)
            if tag in tail:
                return i, ""
            tail = tail[-(len(tag) - 1) :]
        return None, tail


class ReasoningGate:
    """One request: free while it thinks, then the grammar gets the answer's tokens."""

    def __init__(self, detector: ReasoningEndDetector, ended: bool) -> None:
        self._detector = detector
        self.ended = ended
        self._tail = ""

    def feed(self, token_ids: Sequence[int]) -> list[int] | None:
        """Tokens accepted this step -> those the grammar must take (None: still thinking).

        Once ended, every token goes to the grammar. The token that completes
        the end tag never does (vLLM: the grammar starts after it); in text
        mode, text that token carries after the tag is therefore unconstrained.
        """
        if self.ended:
            return list(token_ids)
        offset, self._tail = self._detector.end_offset(token_ids, self._tail)
        if offset is None:
            return None
        self.ended = True
        return list(token_ids[offset + 1 :])
