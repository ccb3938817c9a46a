"""Adaptive drafting: stop drafting for a request whose drafts keep being rejected.

Each verification step of a request with k drafts of which a were accepted
updates an exponential average of a / k. Once a request has been verified a
few times and its average is below the threshold, it gets no drafts for a
backoff of steps (its decode then costs what it costs without speculation);
afterwards it is probed again, and each time it is found low again the
backoff doubles (up to 64x). Text that never repeats thus pays for a few
rejected probes, not for a draft every step.
"""

from __future__ import annotations

from dataclasses import dataclass

_EMA_WEIGHT = 0.3  # weight of the newest step in the average
_MIN_STEPS = 4  # verifications before a request can be paused
_MAX_BACKOFF_FACTOR = 64


@dataclass(slots=True)
class _RequestAcceptance:
    average: float = 1.0
    steps: int = 0
    paused_steps_left: int = 0
    backoff: int = 0


class AdaptiveDrafting:
    """Per-request acceptance tracking; `threshold` 0 never pauses anyone."""

    def __init__(self, threshold: float, backoff_steps: int) -> None:
        self.threshold = threshold
        self.backoff_steps = backoff_steps
        self._requests: dict[str, _RequestAcceptance] = {}

    def should_draft(self, req_id: str) -> bool:
        """Whether to draft for `req_id` this step (counts down a pause)."""
        state = self._requests.get(req_id)
        if state is None or state.paused_steps_left == 0:
            return True
        state.paused_steps_left -= 1
        return False

    def record(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        if num_drafts <= 0:
            return
        state = self._requests.get(req_id)
        if state is None:
            state = self._requests[req_id] = _RequestAcceptance()
        rate = num_accepted / num_drafts
        state.average = (1 - _EMA_WEIGHT) * state.average + _EMA_WEIGHT * rate
        state.steps += 1
        if self.threshold > 0 and state.steps >= _MIN_STEPS and state.average < self.threshold:
            if state.backoff == 0:
                state.backoff = self.backoff_steps
            else:
                state.backoff = min(state.backoff * 2, self.backoff_steps * _MAX_BACKOFF_FACTOR)
            state.paused_steps_left = state.backoff
            # Probe afresh: one good step after the pause keeps it drafting.
            state.average = self.threshold
            state.steps = _MIN_STEPS - 1

    def is_paused(self, req_id: str) -> bool:
        state = self._requests.get(req_id)
        return state is not None and state.paused_steps_left > 0

    def forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
