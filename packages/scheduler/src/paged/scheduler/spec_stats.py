"""Counting drafted and accepted tokens per step for `SchedulerStats.spec_decoding_stats`.

A request verified k drafts when `SchedulerOutput.scheduled_spec_decode_tokens`
held k tokens for it; the runner returned the accepted drafts plus one token,
so len(sampled) - 1 were accepted (counted before any stop condition cuts the
run short, as vLLM does).
"""

from __future__ import annotations

from paged.scheduler.boundary import ModelRunnerOutput, SchedulerOutput, SpecDecodingStats


class SpecDecodingCounter:
    """Accumulates between two `take()` calls."""

    def __init__(self, num_spec_tokens: int) -> None:
        self.num_spec_tokens = num_spec_tokens
        self._reset()

    def _reset(self) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.per_pos = [0] * self.num_spec_tokens

    def observe(self, so: SchedulerOutput, mro: ModelRunnerOutput) -> None:
        spec = so.scheduled_spec_decode_tokens
        if not spec:
            return
        index = {req_id: i for i, req_id in enumerate(mro.req_ids)}
        for req_id, drafts in spec.items():
            i = index.get(req_id)
            if i is None or not drafts or not mro.sampled_token_ids[i]:
                continue
            accepted = min(len(mro.sampled_token_ids[i]) - 1, len(drafts))
            self.num_drafts += 1
            self.num_draft_tokens += len(drafts)
            self.num_accepted_tokens += accepted
            if len(drafts) > len(self.per_pos):
                self.per_pos.extend([0] * (len(drafts) - len(self.per_pos)))
            for j in range(accepted):
                self.per_pos[j] += 1

    def take(self) -> SpecDecodingStats:
        stats = SpecDecodingStats(
            num_spec_tokens=self.num_spec_tokens,
            num_drafts=self.num_drafts,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            num_accepted_tokens_per_pos=list(self.per_pos),
        )
        self._reset()
        return stats
