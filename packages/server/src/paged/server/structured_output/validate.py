"""Frontend check of a request's constraint: compile it (cached) before it reaches the engine.

`AsyncLLM.add_request` awaits `check_compiles_async` (a grammar not compiled
yet is compiled on a thread), `LLM` calls `check_compiles` inline; a bad
schema, regex or grammar becomes an `InvalidRequestError` (a 400 at the API)
naming the field, and never an engine-side failure.
"""

from __future__ import annotations

import asyncio

from paged.scheduler import SamplingParams
from paged.server.errors import InvalidRequestError
from paged.server.structured_output.compiler import GrammarCompiler
from paged.server.structured_output.grammar import GrammarError, grammar_key


def check_compiles(compiler: GrammarCompiler | None, params: SamplingParams) -> None:
    """Compile `params`' constraint (cached); `InvalidRequestError` naming what is wrong."""
    constraint = params.structured_outputs
    if constraint is None:
        return
    if compiler is None:
        raise InvalidRequestError(
            "structured_outputs",
            "structured outputs are not available on this server (its model's tokenizer "
            "could not be read by the grammar backend; see the server log)",
        )
    try:
        compiler.compile(grammar_key(constraint))
    except GrammarError as e:
        raise InvalidRequestError(e.param, e.message) from None


async def check_compiles_async(compiler: GrammarCompiler | None, params: SamplingParams) -> None:
    """`check_compiles` for the event loop: a cached grammar inline, a new one on a thread.

    A compile is bounded by the compiler's `compile_timeout_s`; waiting for it
    on a thread keeps the loop serving other requests meanwhile, however
    small the constraint's text (a short regex can still be slow to compile).
    """
    constraint = params.structured_outputs
    if constraint is None:
        return
    if compiler is not None:
        try:
            cached = compiler.is_cached(grammar_key(constraint))
        except GrammarError as e:
            raise InvalidRequestError(e.param, e.message) from None
        if not cached:
            await asyncio.to_thread(check_compiles, compiler, params)
            return
    check_compiles(compiler, params)
