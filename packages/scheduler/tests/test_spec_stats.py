"""Spec-decoding counters from a step's drafts and the runner's sampled tokens."""

from __future__ import annotations

from paged.scheduler.boundary import ModelRunnerOutput, SchedulerOutput
from paged.scheduler.spec_stats import SpecDecodingCounter


def test_counts_drafts_accepted_and_positions() -> None:
    c = SpecDecodingCounter(3)
    so = SchedulerOutput(
        num_scheduled_tokens={"a": 4, "b": 3, "c": 1},
        total_num_scheduled_tokens=8,
        scheduled_spec_decode_tokens={"a": [1, 2, 3], "b": [4, 5]},
    )
    mro = ModelRunnerOutput(req_ids=["a", "b", "c"], sampled_token_ids=[[1, 2, 9], [7], [3]])
    c.observe(so, mro)
    s = c.take()
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (2, 5, 2)
    assert s.num_accepted_tokens_per_pos == [1, 1, 0]
    assert c.take().num_drafts == 0  # reset by take
