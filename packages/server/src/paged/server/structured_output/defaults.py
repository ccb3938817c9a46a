"""Defaults shared by the compiler, its picklable recipe and the CLI options.

A leaf module: factory.py builds the compiler and the backend, so the compiler
cannot take its defaults from there without an import cycle.
"""

DEFAULT_CACHE_SIZE = 256
# Wall-clock bound of one grammar compile (vLLM has none; xgrammar and
# llguidance compile typical schemas in milliseconds). Past it: a 400.
DEFAULT_COMPILE_TIMEOUT_S = 10.0
