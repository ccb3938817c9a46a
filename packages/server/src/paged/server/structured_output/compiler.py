"""Compiling grammars against the model's vocabulary, with limits and an LRU cache.

A compiled `LLMatcher` is kept per `GrammarKey`; each request gets a
`deep_copy()` of it (cheap: the compiled grammar is shared, only the parse
state is copied), so the same schema sent by many requests compiles once.
llguidance bounds compilation by its parser limits (grammar size, lexer fuel
per step, lexer states): a schema that exceeds them fails to compile with an
error naming the limit, which becomes a 400 at the API. On top of that,
`compile_timeout_s` bounds the wall-clock time: compilation runs on the
compiler's own threads and a caller waits at most that long, then gets a
`GrammarError` saying so (a 400). llguidance cannot be interrupted, so the
compile runs on to its end in the background, and its result is dropped;
the key is remembered as too slow, so repeating the request fails at once
instead of queueing another compile. Construction drops the GIL, so
compiling never stalls the event loop or the engine loop.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import llguidance

from paged.server.structured_output.defaults import DEFAULT_CACHE_SIZE, DEFAULT_COMPILE_TIMEOUT_S
from paged.server.structured_output.grammar import GrammarError, GrammarKey, grammar_text
from paged.server.structured_output.json_options import JsonGrammarOptions

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


# How many keys that timed out are remembered (each is then refused at once).
_MAX_TOO_SLOW = 64
# Compiles at once; more wait in line (each still bounded by the timeout).
_COMPILE_THREADS = 2


class GrammarCompiler:
    """Compiles `GrammarKey`s into matchers; thread-safe, LRU-bounded to `cache_size` grammars.

    Each compile is bounded by `compile_timeout_s` seconds of wall-clock time
    (see the module docstring); concurrent callers of one key share one compile.
    """

    def __init__(
        self,
        tokenizer: llguidance.LLTokenizer,
        *,
        eos_token_ids: Sequence[int] = (),
        cache_size: int = DEFAULT_CACHE_SIZE,
        compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        json_options: JsonGrammarOptions | None = None,
    ) -> None:
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        if not compile_timeout_s > 0:
            raise ValueError(f"compile_timeout_s must be > 0, got {compile_timeout_s}")
        self.compile_timeout_s = compile_timeout_s
        # Fixed for the compiler's life, so the cache key need not carry them.
        self.json_options = json_options or JsonGrammarOptions()
        self._pool = ThreadPoolExecutor(_COMPILE_THREADS, thread_name_prefix="paged-compile")
        self._in_flight: dict[GrammarKey, Future[llguidance.LLMatcher]] = {}
        self._too_slow: OrderedDict[GrammarKey, None] = OrderedDict()
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
            if key in self._too_slow:
                raise self._timeout_error(key)
            future = self._in_flight.get(key)
            if future is None:
                future = self._pool.submit(self._build_and_cache, key)
                self._in_flight[key] = future
        try:
            return future.result(timeout=self.compile_timeout_s)
        except FutureTimeout:
            with self._lock:
                self._too_slow[key] = None
                while len(self._too_slow) > _MAX_TOO_SLOW:
                    self._too_slow.popitem(last=False)
            raise self._timeout_error(key) from None

    def _build_and_cache(self, key: GrammarKey) -> llguidance.LLMatcher:
        try:
            matcher = self._build(key)
        except BaseException:
            with self._lock:
                self._in_flight.pop(key, None)
            raise
        with self._lock:  # leaves in-flight and enters the cache at once: no second compile
            self._in_flight.pop(key, None)
            if key in self._too_slow:
                return matcher  # its callers gave up: keep refusing it, do not cache
            self._cache[key] = matcher
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            self.num_compiled += 1
        return matcher

    def _timeout_error(self, key: GrammarKey) -> GrammarError:
        return GrammarError(
            key.kind,
            f"compiling the {_describe(key.kind)} took longer than {self.compile_timeout_s:g} s "
            "(the structured-output compile timeout); simplify it",
        )

    def is_cached(self, key: GrammarKey) -> bool:
        """Whether `key` is compiled already (does not refresh its LRU position)."""
        with self._lock:
            return key in self._cache

    def new_matcher(self, key: GrammarKey) -> llguidance.LLMatcher:
        """A fresh matcher at the start of `key`'s grammar, owned by the caller."""
        return self.compile(key).deep_copy()

    def _build(self, key: GrammarKey) -> llguidance.LLMatcher:
        grammar = grammar_text(key, self.json_options)
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
        "structural_tag": "structural tag",
    }.get(kind, kind)
