"""Compiling grammars against the model's vocabulary, with limits and an LRU cache.

A compiled `LLMatcher` is kept per `GrammarKey`; each request gets a
`deep_copy()` of it (cheap: the compiled grammar is shared, only the parse
state is copied), so the same schema sent by many requests compiles once.
llguidance bounds compilation by its parser limits (grammar size, lexer fuel
per step, lexer states) rather than by wall-clock time: a schema that
exceeds them fails to compile with an error naming the limit, which becomes a
400 at the API. Construction drops the GIL, so compiling on a worker thread
leaves the event loop (or the engine's other thread) running.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import llguidance

from paged.server.structured_output.factory import DEFAULT_CACHE_SIZE
from paged.server.structured_output.grammar import GrammarError, GrammarKey, grammar_text

logger = logging.getLogger(__name__)


def load_ll_tokenizer(
    hf_tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int] = ()
) -> llguidance.LLTokenizer:
    """llguidance's view of a Hugging Face fast tokenizer, padded to the model's `vocab_size`.

    Costs ~0.5 s for a 49k vocabulary: build once per process. `eos_token_ids`
    (the model's, which may differ from the tokenizer's) are the tokens a
    finished grammar allows.
    """
    import llguidance.hf  # pulls in transformers; only the processes that compile need it

    eos: int | list[int] | None = list(eos_token_ids) or None
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)


def try_load_ll_tokenizer(
    hf_tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int] = ()
) -> llguidance.LLTokenizer | None:
    """`load_ll_tokenizer`, or None (logged) when llguidance cannot read this tokenizer.

    A model whose tokenizer llguidance does not understand (e.g. one without a
    decoder) is still served; only its constrained requests are refused with a 400.
    """
    try:
        return load_ll_tokenizer(hf_tokenizer, vocab_size, eos_token_ids)
    except Exception as e:  # llguidance raises plain ValueError/RuntimeError here
        logger.warning("structured outputs are off for this model: llguidance: %s", e)
        return None


class GrammarCompiler:
    """Compiles `GrammarKey`s into matchers; thread-safe, LRU-bounded to `cache_size` grammars."""

    def __init__(
        self,
        tokenizer: llguidance.LLTokenizer,
        *,
        eos_token_ids: Sequence[int] = (),
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        self.tokenizer = tokenizer
        self.vocab_size: int = tokenizer.vocab_size
        # The tokens that end a request whose grammar is complete.
        self.eos_token_ids = frozenset(eos_token_ids or (tokenizer.eos_token,))
        self.cache_size = cache_size
        self._cache: OrderedDict[GrammarKey, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # cache misses, for tests and the benchmark

    def compile(self, key: GrammarKey) -> llguidance.LLMatcher:
        """The compiled template for `key` (do not advance it: `new_matcher` copies it).

        `GrammarError` naming the request field if the constraint is malformed
        or unsupported (unknown schema keyword, unparsable regex, bad grammar).
        """
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        matcher = self._build(key)  # outside the lock: compiling may take a while
        with self._lock:
            self._cache[key] = matcher
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            self.num_compiled += 1
        return matcher

    def is_cached(self, key: GrammarKey) -> bool:
        """Whether `key` is compiled already (does not refresh its LRU position)."""
        with self._lock:
            return key in self._cache

    def new_matcher(self, key: GrammarKey) -> llguidance.LLMatcher:
        """A fresh matcher at the start of `key`'s grammar, owned by the caller."""
        return self.compile(key).deep_copy()

    def _build(self, key: GrammarKey) -> llguidance.LLMatcher:
        grammar = grammar_text(key)
        # log_level 0: errors are read from the matcher and reported, not logged.
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(key.kind, f"invalid {_describe(key.kind)}: {matcher.get_error()}")
        return matcher


def _describe(kind: str) -> str:
    return {
        "json": "JSON schema",
        "json_object": "JSON object constraint",
        "regex": "regex",
        "choice": "choice",
        "grammar": "grammar",
    }.get(kind, kind)
