"""Structured output: grammars (llguidance) that constrain sampling to JSON, regex, choices.

grammar.py   StructuredOutputsParams -> llguidance grammar text (GrammarError: the problem)
compiler.py  GrammarCompiler: compile within llguidance's limits; LRU of compiled grammars
backend.py   StructuredOutputBackend: the scheduler's StructuredOutputProvider (masks, accept)
factory.py   StructuredOutputConfig: picklable recipe; builds the backend in the engine process
defaults.py  cache size and compile timeout defaults (a leaf: compiler and factory both read them)
validate.py  check_compiles: the frontend's check, a bad constraint is InvalidRequestError
"""

from paged.server.structured_output.backend import StructuredOutputBackend
from paged.server.structured_output.compiler import (
    GrammarCompiler,
    load_ll_tokenizer,
    try_load_ll_tokenizer,
)
from paged.server.structured_output.factory import StructuredOutputConfig
from paged.server.structured_output.grammar import GrammarError, GrammarKey, grammar_key

__all__ = [
    "GrammarCompiler",
    "GrammarError",
    "GrammarKey",
    "StructuredOutputBackend",
    "StructuredOutputConfig",
    "grammar_key",
    "load_ll_tokenizer",
    "try_load_ll_tokenizer",
]
