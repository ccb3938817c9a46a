"""The structured-output hook: a grammar-bitmask provider (paged-server's is on llguidance).

EngineCore calls `Scheduler.get_grammar_bitmask(scheduler_output)` between
`execute_model()` and `sample_tokens()`, so the mask is computed while the
model runs; the result goes to the runner's `sample_tokens(grammar_output)`.
After sampling, `update_from_output` feeds accepted tokens back so the
grammar's state advances.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from paged.scheduler.boundary import GrammarOutput, SchedulerOutput
from paged.scheduler.request import Request


class StructuredOutputProvider(Protocol):
    """Owns the grammars of structured-output requests; the scheduler only routes calls."""

    def grammar_bitmask(
        self, requests: Sequence[Request], scheduler_output: SchedulerOutput
    ) -> GrammarOutput | None:
        """Masks for this step's scheduled `requests` it manages, or None if it manages none.

        Row order follows `GrammarOutput.structured_output_request_ids`; a request
        with scheduled draft tokens gets one row per position (drafts + bonus).
        """
        ...

    def accept_tokens(self, request_id: str, token_ids: Sequence[int]) -> bool:
        """Advance the request's grammar; False if a token violates it (the request fails)."""
        ...

    def remove_request(self, request_id: str) -> None:
        """Forget the request (finished or aborted). No-op for unknown ids."""
        ...


@runtime_checkable
class GrammarCompileGate(Protocol):
    """Optional for a provider: compiles grammars off the engine loop (vLLM's WAITING_FOR_FSM).

    The scheduler asks before admitting a WAITING request that has a
    constraint; False sets it aside for this step (it keeps its place at the
    head of the queue) while the others are admitted, so one slow grammar
    delays only its own request. Must be cheap: it is asked every step.
    """

    def grammar_ready(self, request: Request) -> bool:
        """True once `request`'s grammar is compiled (or it failed: the request then fails)."""
        ...


@runtime_checkable
class DraftTokenValidator(Protocol):
    """Optional for a provider: checks speculative drafts against a request's grammar.

    `Scheduler.update_draft_token_ids` keeps only the first
    `validate_draft_tokens(...)` drafts of a constrained request. The grammar's
    state must not move: drafts are unverified. (vLLM: `grammar.validate_tokens`.)
    """

    def validate_draft_tokens(self, request_id: str, draft_token_ids: Sequence[int]) -> int:
        """Length of the longest prefix of `draft_token_ids` the request's grammar accepts."""
        ...
