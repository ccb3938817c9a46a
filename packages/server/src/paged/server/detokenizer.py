"""Incremental detokenization and stop-string detection (seed: Detokenizer).

Text is produced by decoding a short sliding window of token ids, not one
token at a time: byte-level BPE splits a multi-byte character over several
tokens, and SentencePiece decoders drop a leading space at the start of a
decoded string. Two offsets into `token_ids` define the window:

    token_ids:  [ ... already emitted ... | context | pending | ]
                                          ^prefix    ^read
    prefix_text = decode(ids[prefix:read])    (already emitted)
    new_text    = decode(ids[prefix:])        (emitted + candidate)

The candidate `new_text[len(prefix_text):]` is emitted only when it does not
end in U+FFFD, i.e. when the last character is complete. The window starts a
few prompt tokens back so the first generated token decodes with context.
"""

from __future__ import annotations

from dataclasses import dataclass

from paged.server.tokenizer import TokenizerLike

# How many prompt tokens seed the window (vLLM uses the same number).
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5
_REPLACEMENT_CHAR = "\ufffd"


@dataclass(frozen=True, slots=True)
class StopMatch:
    """A stop string found in the output: which one, and where the text is cut."""

    stop_str: str
    truncate_to: int  # len(output_text) after truncation


def check_stop_strings(
    output_text: str, new_char_count: int, stop: list[str], include_in_output: bool
) -> StopMatch | None:
    """Find the first stop string that overlaps the `new_char_count` newest chars.

    Only matches that end inside the new text are considered: older text was
    already checked. The earliest match in the text wins (ties: longest).
    """
    if not stop or new_char_count <= 0:
        return None
    best: StopMatch | None = None
    best_index = len(output_text) + 1
    for stop_str in stop:
        # A match must end after the start of the new text.
        start = max(0, len(output_text) - new_char_count - len(stop_str) + 1)
        index = output_text.find(stop_str, start)
        if index == -1:
            continue
        if index < best_index or (
            index == best_index and best is not None and len(stop_str) > len(best.stop_str)
        ):
            best_index = index
            cut = index + len(stop_str) if include_in_output else index
            best = StopMatch(stop_str, cut)
    return best


class IncrementalDetokenizer:
    """Turns a request's generated token ids into text, one step at a time.

    `update()` appends tokens, returns a stop string if one appeared (the text
    is then already truncated). `get_next_output_text()` returns the text for
    the next `RequestOutput`: everything (cumulative) or what is new (delta).
    While unfinished it holds back the last `len(longest stop) - 1` chars so a
    stop string that is still forming is never streamed to the user.
    """

    def __init__(
        self,
        tokenizer: TokenizerLike,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = list(stop or [])
        self._include_stop = include_stop_str_in_output
        context = prompt_token_ids[-INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET:]
        self._ids: list[int] = list(context)  # window context, then generated ids
        self._num_context = len(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.output_text = ""
        self._last_output_offset = 0
        self._stopped = False
        self.stop_buffer_length = (
            max(len(s) for s in self._stop) - 1 if self._stop and not self._include_stop else 0
        )

    @property
    def output_token_ids(self) -> list[int]:
        return self._ids[self._num_context :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _decode_next(self, flush: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) and not flush:
            return ""
        if new_text.endswith(_REPLACEMENT_CHAR) and not flush:
            return ""  # an incomplete multi-byte character: wait for more tokens
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return delta

    def update(self, new_token_ids: list[int], finished: bool) -> str | None:
        """Append tokens; return the stop string that ended the text, if any.

        `finished`: the engine finished the request with these tokens, so any
        held-back bytes are flushed (an unfinished character decodes as U+FFFD,
        exactly as a one-shot decode of all tokens would show it).
        """
        if self._stopped:
            return None
        for i, token_id in enumerate(new_token_ids):
            self._ids.append(token_id)
            flush = finished and i == len(new_token_ids) - 1
            before = len(self.output_text)
            self.output_text += self._decode_next(flush)
            match = check_stop_strings(
                self.output_text, len(self.output_text) - before, self._stop, self._include_stop
            )
            if match is not None:
                # Tokens after the one that completed the stop string are never
                # appended: they are not part of the output.
                self.output_text = self.output_text[: match.truncate_to]
                self._stopped = True
                return match.stop_str
        if finished and not new_token_ids and len(self._ids) > self._read_offset:
            self.output_text += self._decode_next(flush=True)
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text for the next output: all of it, or the part not yet returned."""
        buffer = 0 if finished else self.stop_buffer_length
        length = len(self.output_text) - buffer
        if not delta:
            return self.output_text[:length] if buffer else self.output_text
        last = self._last_output_offset
        if last < length:
            self._last_output_offset = length
            return self.output_text[last:length]
        return ""
