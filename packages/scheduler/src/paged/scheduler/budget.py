"""Per-step budgets as small value objects.

`StepBudget` is created at the start of each `schedule()` and only shrinks,
except when a request scheduled earlier in the same step is preempted again
(priority policy), which gives its share back.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StepBudget:
    """Tokens the model may compute and encoder embeddings it may produce in one step."""

    tokens: int
    encoder_embeds: int

    def take_tokens(self, n: int) -> None:
        if n > self.tokens:
            raise RuntimeError(f"token budget overdrawn: {n} > {self.tokens}")
        self.tokens -= n

    def give_back_tokens(self, n: int) -> None:
        self.tokens += n
