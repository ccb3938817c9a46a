"""`StructuredOutputConfig`: what the engine process needs to build its grammar backend.

The engine core is built from a picklable factory in a spawned process, and
llguidance's tokenizer is not picklable; this small frozen record (a path and
two numbers) crosses instead, and `build()` loads the tokenizer there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from paged.server.structured_output.defaults import DEFAULT_CACHE_SIZE, DEFAULT_COMPILE_TIMEOUT_S
from paged.server.structured_output.json_options import JsonGrammarOptions

if TYPE_CHECKING:  # imported in build(): the engine core imports this module at start-up
    from paged.server.structured_output.backend import StructuredOutputBackend
    from paged.server.structured_output.compiler import GrammarCompiler
    from paged.server.tokenizer import TokenizerLike


@dataclass(frozen=True, slots=True)
class StructuredOutputConfig:
    """Recipe for the backend: the tokenizer source, the model's vocabulary and EOS ids.

    `compile_timeout_s`: how long one grammar may compile before its request fails.
    """

    tokenizer_path: str
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()
    cache_size: int = DEFAULT_CACHE_SIZE
    compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S
    json_options: JsonGrammarOptions = field(default_factory=JsonGrammarOptions)
    # `--reasoning-parser`: the grammar starts after the thinking, unless
    # `enable_in_reasoning` (vLLM's structured-outputs key) constrains it too.
    reasoning_parser: str | None = None
    enable_in_reasoning: bool = False

    def build_compiler(self, hf: TokenizerLike | None = None) -> GrammarCompiler:
        from paged.server.structured_output.compiler import GrammarCompiler, load_ll_tokenizer
        from paged.server.tokenizer import load_tokenizer

        hf = hf if hf is not None else load_tokenizer(self.tokenizer_path)
        ll = load_ll_tokenizer(hf, self.vocab_size, self.eos_token_ids)
        return GrammarCompiler(
            ll,
            eos_token_ids=self.eos_token_ids,
            cache_size=self.cache_size,
            compile_timeout_s=self.compile_timeout_s,
            json_options=self.json_options,
        )

    def build(self) -> StructuredOutputBackend:
        from paged.server.reasoning import REASONING_SPECS, ReasoningEndDetector
        from paged.server.structured_output.backend import StructuredOutputBackend
        from paged.server.tokenizer import load_tokenizer

        hf = load_tokenizer(self.tokenizer_path)
        detector = None
        if self.reasoning_parser is not None and not self.enable_in_reasoning:
            detector = ReasoningEndDetector(REASONING_SPECS[self.reasoning_parser], hf)
        return StructuredOutputBackend(self.build_compiler(hf), reasoning=detector)
